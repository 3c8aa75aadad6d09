"""Comparing a compiled side with eager in a differential case (test_differential.py):
bitwise where the graph runs eager's own ATen ops on the CPU, else within torch's
foreach-vs-for-loop tolerance plus how far eager's other path is."""

from __future__ import annotations

from typing import Any

import torch
from differential_cases import DEVICE, Case, is_foreach
from differential_sides import Side

# torch.testing's default (rtol, atol) per dtype: what torch's test_optim allows between its
# foreach and for-loop paths (test_foreach_matches_forloop).
TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def exact(case: Case) -> bool:
    """Whether the compiled step must match eager bitwise: on the CPU where the graph runs
    eager's own ATen ops (README: the torch backend, except RAdam's foreach path without
    capturable, traced on the capturable path). (On a GPU, ATen's CUDA kernels for the ops
    the trace records, a foreach op taken apart or Adafactor's scalars computed in the
    graph, differ from eager's in the last bit.)"""
    if case.backend != "torch" or DEVICE != "cpu":
        return False
    if case.optimizer != "RAdam" or case.defaults.get("capturable"):
        return True
    options = [{**case.defaults, **g.options} for g in case.group_specs()]
    if any(e.kind == "set" and e.args[1] == "foreach" for e in case.events):
        return False  # (a group switched to foreach between steps)
    return not any(is_foreach("RAdam", o.get("foreach")) for o in options)


def assert_close(
    case: Case,
    actual: Any,
    expected: Any,
    what: str,
    twin: Any = None,
    before: Any = None,
    steps: int = 1,
) -> None:
    """``actual`` (compiled) matches ``expected`` (eager): bitwise where ``exact(case)``,
    else within the dtype's tolerance plus how far eager's other path (``twin``: foreach
    for a for-loop step and vice versa) is from eager here.

    The relative part is taken of the largest magnitude the value has had (``before``):
    rounding errors scale with the operands, and an update that cancels most of a param (or
    ASGD's ``ax + (p - ax)``) leaves a small result with the operands' error. In float16
    and bfloat16 the relative part grows by half an ulp per step taken (``steps``; four on
    the C loops): a rounding a step makes otherwise than eager is carried into the steps
    after it."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{what}: {actual.device} != {expected.device}"
        assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
        if expected.is_complex():  # compared as (real, imag) pairs
            actual, expected = torch.view_as_real(actual), torch.view_as_real(expected)
            twin = _as_real(twin)
        if exact(case) or not expected.is_floating_point():
            equal = actual.eq(expected) | (actual.isnan() & expected.isnan())
            assert bool(equal.all()), f"{what}: not bitwise equal: {_worst(actual, expected)}"
            return
        rtol, atol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
        if expected.dtype in (torch.float16, torch.bfloat16):
            # (four ulps a step on the C loops, docs/cpu_backend.md: ATen's CPU kernels compute
            # the scalar tail of an op otherwise than its vectorized body, float16 ``add`` with
            # ``alpha`` rounding the product first there; the loops compute as the body does,
            # and a square of such a value (Adagrad's sum) is 2-3 ulps off)
            per_step = 4.0 if case.backend == "cpu" else 0.5
            rtol = max(rtol, steps * per_step * torch.finfo(expected.dtype).eps)
        a, e = actual.detach().double(), expected.detach().double()
        scale = e.abs()
        if isinstance(before, torch.Tensor) and before.shape == expected.shape:
            scale = torch.maximum(scale, before)
        bound = atol + rtol * scale
        if isinstance(twin, torch.Tensor) and twin.shape == expected.shape:
            bound = bound + (twin.detach().double() - e).abs().nan_to_num(0.0)
        ok = ((a - e).abs() <= bound) | (a == e) | (a.isnan() & e.isnan())
        assert bool(ok.all()), f"{what}: beyond eager's tolerance: {_worst(actual, expected)}"
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), what
        twins = twin if isinstance(twin, (tuple, list)) and len(twin) == len(expected) else None
        for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
            assert_close(case, x, y, f"{what}[{i}]", twins[i] if twins else None, None, steps)
    else:
        assert actual == expected or (actual != actual and expected != expected), (
            f"{what}: {actual!r} != {expected!r}"
        )


def _as_real(t: Any) -> Any:
    return torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t


Magnitudes = dict[tuple[int, str], torch.Tensor]


def _largest(magnitudes: Magnitudes, key: tuple[int, str], value: torch.Tensor) -> torch.Tensor:
    """The largest magnitude each element of ``value`` has had so far (and now)."""
    now = _as_real(value.detach()).double().abs().nan_to_num(0.0, 0.0, 0.0)
    seen = magnitudes.get(key)
    if seen is not None and seen.shape == now.shape:
        now = torch.maximum(seen, now)
    magnitudes[key] = now
    return now


def _averaged(largest: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """ASGD's ``ax`` (an average of the param's values; eager's for-loop copies the param
    while ``mu == 1``, and so does the compiled step) carries the param's rounding errors
    where those are not eager's (the kernels round as ATen does on CUDA), which scale with
    the largest magnitude the param has had: its own history starts only when its state is
    made (a param that joins by add_param_group), and the param's may be larger. Both
    count."""
    return torch.maximum(largest, param) if largest.shape == param.shape else largest


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.detach().double() - expected.detach().double()).abs().nan_to_num(float("inf"))
    if diff.numel() == 0:
        return "(empty)"
    i = int(diff.flatten().argmax())
    got, want = actual.detach().flatten()[i].item(), expected.detach().flatten()[i].item()
    return f"got {got!r}, eager {want!r} at flat index {i} ({int((diff > 0).sum())} differ)"


def compare(
    case: Case,
    got: Side,
    want: Side,
    when: str,
    twin: Side | None = None,
    magnitudes: Magnitudes | None = None,
    steps: int = 1,
) -> None:
    """Params, every state entry and the groups' hyperparameters match (``magnitudes``:
    the largest each eager value has had, see assert_close; updated here)."""
    twins = twin.params if twin is not None else [None] * len(want.params)
    seen: Magnitudes = {} if magnitudes is None else magnitudes
    for i, (p, q, r) in enumerate(zip(got.params, want.params, twins, strict=True)):
        where = f"{when}, param {i} {tuple(q.shape)} {q.dtype}"
        assert_close(case, p.detach(), q.detach(), where, r, _largest(seen, (i, ""), q), steps)
        assert p.stride() == q.stride(), f"{where}: stride {p.stride()} != {q.stride()}"
        assert (p in got.opt.state) == (q in want.opt.state), f"{where}: state exists?"
        if q in want.opt.state:
            mine, theirs = got.opt.state[p], want.opt.state[q]
            other = twin.opt.state.get(r, {}) if twin is not None else {}
            assert set(mine) == set(theirs), f"{where}: state keys {set(mine)} != {set(theirs)}"
            for key, value in theirs.items():
                what = f"{where}, state[{key!r}]"
                largest = _largest(seen, (i, key), value) if torch.is_tensor(value) else None
                if case.optimizer == "ASGD" and key == "ax" and largest is not None:
                    largest = _averaged(largest, seen[(i, "")])
                assert_close(case, mine[key], value, what, other.get(key), largest, steps)
    for i, (g, h) in enumerate(zip(got.opt.param_groups, want.opt.param_groups, strict=True)):
        assert set(g) == set(h), f"{when}, group {i} keys: {set(g) ^ set(h)}"
        for key in h:
            if key != "params":
                assert_close(case, g[key], h[key], f"{when}, group {i}[{key!r}]")


def compare_state_dicts(case: Case, got: dict[str, Any], want: dict[str, Any], when: str) -> None:
    """The compiled optimizer's state_dict() is eager's (the values compared by compare())."""
    assert set(got["state"]) == set(want["state"]), f"{when}: state_dict state keys"
    for index, entries in want["state"].items():
        assert set(got["state"][index]) == set(entries), f"{when}: state_dict state[{index}]"
    assert len(got["param_groups"]) == len(want["param_groups"]), f"{when}: groups"
    for g, h in zip(got["param_groups"], want["param_groups"], strict=True):
        assert set(g) == set(h), f"{when}: state_dict group keys {set(g) ^ set(h)}"
        for key in h:
            assert_close(case, g[key], h[key], f"{when}: state_dict group[{key!r}]")
