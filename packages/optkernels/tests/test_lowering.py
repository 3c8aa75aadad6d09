"""The one lowering of lane ops (``lowering``) and the two targets' spellings of its
primitives (``triton_ops``, ``c_kernel``). What each op computes is tested against the torch
backend in test_foreach_kernel and test_c_kernel; here, that both targets can spell every
primitive and that an op's structure is the same in both."""

from __future__ import annotations

import pytest
import torch
from optkernels.c_kernel import c_emitter
from optkernels.lanes import LaneOp, LaneProgram
from optkernels.lowering import PRIMITIVES, Emitter, expression
from optkernels.triton_ops import triton_emitter

TARGETS = {"triton": triton_emitter, "c": c_emitter}


def _emitter(target: str) -> Emitter:
    return TARGETS[target](LaneProgram(lanes=1))


@pytest.mark.parametrize("compute", [torch.float32, torch.float64])
@pytest.mark.parametrize("target", TARGETS)
def test_every_target_spells_every_primitive(target, compute):
    assert set(_emitter(target).code[compute]) == set(PRIMITIVES)


def _op(name: str, *args: object, **kwargs: object) -> LaneOp:
    return LaneOp(9, name, "default", args, tuple(kwargs.items()), small=False)


REFS = {0: "v0", 1: "v1"}


@pytest.mark.parametrize(
    ("target", "expected"),
    [("triton", "tl.fma((-v1), 2.0, v0)"), ("c", "fmaf((-v1), ((float)2.0), v0)")],
)
def test_sub_with_alpha_is_one_fma(target, expected):
    op = _op("sub", ("lane", 0), ("lane", 1), alpha=("const", 2))
    assert expression(op, REFS, torch.float32, _emitter(target)) == expected


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("triton", "tl.minimum(v0, (1.0 - tl.zeros_like(v0)), propagate_nan=tl.PropagateNan.ALL)"),
        ("c", "mnd(v0, ((double)1.0))"),
    ],
)
def test_clamp_without_a_lower_bound_only_takes_the_minimum(target, expected):
    op = _op("clamp", ("lane", 0), ("const", None), ("const", 1.0))
    assert expression(op, REFS, torch.float64, _emitter(target)) == expected


@pytest.mark.parametrize("target", TARGETS)
def test_a_scalar_read_in_float32_is_loaded_once_and_narrowed_once(target):
    emit = _emitter(target)
    op = _op("mul", ("scalar", 0), ("scalar", 0))
    expression(op, REFS, torch.float32, emit)
    expression(op, REFS, torch.float64, emit)
    assert len(emit.scalars.lines) == 2
