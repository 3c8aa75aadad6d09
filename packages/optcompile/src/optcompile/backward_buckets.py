"""A bucket of the step inside backward: the parameters whose update runs as one compiled
step, and what the view that runs it shares with the optimizer (see ``optcompile.backward``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from optcompile.backward_hooks import Synced

OPTIONS_ATTR = "_optcompile_options"
# What a bucket's view does not share with the optimizer: its own groups, state and no hooks
# (they run once, in opt.step()); "step" is an LR scheduler's wrapper of the instance.
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_NOT_SHARED = frozenset(("param_groups", "state", "step", OPTIONS_ATTR, *_HOOK_DICTS))


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters whose update runs as one compiled step, and the view that runs it."""

    params: list[torch.Tensor]
    view: torch.optim.Optimizer | None = None
    step: Callable[[dict[str, Any]], Any] | None = None  # the view's Compiled
    L: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"opt": view}
    groups: list[Synced] = dataclasses.field(default_factory=list)
    entries: list[Any] = dataclasses.field(default_factory=list)  # the view's state, by param
    # CPython's version tags of the optimizer's and the view's state dicts after the last
    # update, where optguard's native module reads them (see update); _UNKNOWN: not known
    tags: tuple[Any, Any] = (None, None)
    arrived: int = 0  # gradients arrived in this backward
    # For sending its next update's host values ahead (InBackward.stage_ahead): the entry
    # it was found for, that entry's plan and the positions and fetch of the inputs it reads
    # (None: its plan sends nothing ahead)
    ahead: (
        tuple[Any, tuple[Any, list[int], Callable[[dict[str, Any]], list[Any]]] | None] | None
    ) = None
    # Its direct update (optcompile.backward_direct): the native object (None: never armed),
    # the param whose hooks it wraps, why it is not armed, its replays already folded
    direct: Any = None
    direct_on: torch.Tensor | None = None
    direct_reason: str | None = "not armed yet"
    direct_folded: int = 0
    direct_numbers: Any = None  # (backward_direct.Numbers: its param groups' numbers)
    direct_columns: list[torch.Tensor] = dataclasses.field(default_factory=list)
    direct_armed_at: int = 0  # its replays when last armed
    direct_misses: int = 0  # armings in a row not followed by a replay
