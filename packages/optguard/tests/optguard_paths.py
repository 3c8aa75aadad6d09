"""Sources into an optimizer, shared by the optguard tests."""

from __future__ import annotations

from optguard import AttrSource, ItemSource, KeyedSource, LocalSource

OPT = LocalSource("opt")
GROUPS = AttrSource(OPT, "param_groups")
GROUP = ItemSource(GROUPS, 0)
PARAMS = ItemSource(GROUP, "params")
PARAM = ItemSource(PARAMS, 0)
STATE = KeyedSource(AttrSource(OPT, "state"), PARAM)
