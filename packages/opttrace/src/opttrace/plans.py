"""Op plans: what a pointwise op seen before does, keyed by its arguments' kinds.

Most ops of a step repeat (each parameter of a shape class runs its class's ops): an op
whose arguments are traced tensors of known layouts and plain or symbolic scalars gets a
key (``plan_key``), and the Recorder keeps in ``meta.PLANS`` what the op did under that key
(a ``Plan``), so the next op with the key records its node and result with no inference
or in-place analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from opttrace.meta import Spec
from opttrace.symbolic import ScalarNode
from opttrace.traced_tensor import TracedTensor

if TYPE_CHECKING:
    from opttrace.recorder import Recorder


@dataclass(frozen=True)
class Plan:
    """What a pointwise op does, given its arguments' kinds (its key): the node it records
    (calling ``target``) and either the new tensor it makes (``spec`` on
    ``device``, of layout id ``layout``) or, for an in-place op, that it rebinds its
    ``self`` (``inplace``: the op eager ran, kept in the node's meta)."""

    target: Any
    inplace: Any
    spec: Spec
    device: torch.device
    layout: int


def plan_key(rec: Recorder, head: Any, args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """An op's plan key (``head``, then its arguments' kinds) and its node's arguments, or
    (None, []) where the op's arguments are of a kind a plan does not cover (the op is then
    recorded step by step). An op is keyed by its id (an OpOverload hashes in Python): its
    plan holds it, so no other op takes that id while the plan exists."""
    key: list[Any] = [head]
    node_args: list[Any] = []
    for a in args:
        kind = type(a)
        if kind is TracedTensor:
            node = a._node
            if node is None or a._recorder is not rec or a._stale is not None:
                return None, []
            key.append(a._layout)
            node_args.append(node)
        elif kind is float:
            key.append(float)  # (as meta.infer: a float's value never changes metadata)
            node_args.append(a)
        elif kind is int or kind is bool:
            key += (kind, a)
            node_args.append(a)
        elif kind is torch.SymFloat:
            scalar = a.node
            if type(scalar) is not ScalarNode:
                return None, []
            key.append(kind)
            node_args.append(scalar.fx_node if scalar.fx_node is not None else scalar.hint)
        else:
            return None, []
    return tuple(key), node_args


def plan_key_kw(
    rec: Recorder, key: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """``key`` extended by the keyword arguments (as ``plan_key``), and their node values."""
    names = tuple(kwargs)
    kw_key, values = plan_key(rec, names, list(kwargs.values()))
    if kw_key is None:
        return None, {}
    return (*key, *kw_key), dict(zip(names, values, strict=True))
