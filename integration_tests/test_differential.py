"""A randomized differential test: compiled optimizers against eager torch.optim.

Hypothesis draws a ``Case`` (differential_cases.py): an optimizer (the eleven torch.optim
ones with foreach and for-loop paths, Adafactor, and custom steps from step_optimizers.py),
its constructor options (every option each accepts, tensor and numpy-float hyperparameters
where torch accepts them, foreach True/False/None), param groups overriding options of their
own, parameters (0-dim, empty, one element, up to a few thousand; contiguous, transposed,
strided slices of a larger tensor, views into one flat buffer; float32 always, float64,
bfloat16, float16 and complex64 where supported), gradients (new tensors or written in place,
in the param's layout or another, one tensor shared by several params, None for some params
on some steps, set by a closure, halved by a step pre-hook), zero_grad between steps, an LR
scheduler (attached before or after ``compile``), events between steps (a hyperparameter
changed by hand, ``add_param_group``, ``state_dict`` round trips through fresh and existing
optimizers in both directions, deep-copied or through ``torch.save``), the backend ("torch",
or "triton" and "cpu" (generated C loops, where a C compiler builds them) for a smaller
share of cases each) and a recompile limit. It steps a compiled
optimizer and an eager one over parameters built the same way, and after every step and
event compares the parameters, every state entry, the group hyperparameters, the losses
``step(closure)`` returns, hook calls and the warnings eager gives:

- bitwise where the compiled graph runs eager's own ATen ops (backend "torch", except
  RAdam and ASGD without capturable, whose trace takes the capturable path: README);
- otherwise within torch.testing's per-dtype atol/rtol (what torch's test_optim allows
  between its foreach and for-loop paths), the relative part taken of the largest
  magnitude the value has had (ASGD's ``ax``: or its param has had), plus how far
  eager's other path (foreach for a for-loop step and vice versa, run alongside) is from
  eager at that point.

The compiled optimizer must either have compiled (``explain(opt).traces >= 1``, no
fallback) or have fallen back with a ``FallbackWarning`` whose reason is a documented
limitation (``DOCUMENTED_FALLBACKS``): never silently different. Combinations eager
torch.optim itself refuses are not drawn or are rejected (never guessed).

Modes (environment variables):

- CI (default): ``CI_EXAMPLES`` examples, ``derandomize=True``, no example database: the
  same examples on every run, about a minute on the 2-core CPU machine under
  ``TRITON_INTERPRET=1`` (52 s measured with ``OPTCOMPILE_NATIVE=sync``, as ``./nox -s
  integration`` runs it, with the machine shared; the integration session sets
  ``TRITON_INTERPRET``: without it backend "triton" is not drawn on CPU).
- ``OPTCOMPILE_FUZZ_EXAMPLES=2000``: that many random examples (``OPTCOMPILE_FUZZ_SEED=n``
  makes them reproducible), up to 7 steps, larger shapes, failures kept in hypothesis's
  example database. On a CUDA machine the parameters live on the GPU, ``capturable`` and
  foreach changes are drawn, backend "triton" runs compiled kernels (no interpreter) with
  and without CUDA graphs: ``OPTCOMPILE_FUZZ_EXAMPLES=2000 python -m pytest
  integration_tests/test_differential.py -x``.
- ``OPTCOMPILE_FUZZ_BACKEND=cpu`` (or ``torch``, ``triton``): every case on that backend.
- ``OPTCOMPILE_FUZZ_KNOWN_BUGS=1``: also draw the combinations of ``KNOWN_BUGS`` (open
  bugs, excluded from the draw until fixed; delete an entry to re-enable it for good).

A failure prints the shrunk ``Case``; from ``integration_tests/``, ``python -c "from
test_differential import *; run_case(Case(...))"`` replays it.
"""

from __future__ import annotations

import copy
import io
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import optcompile
import torch
from differential_cases import (
    KNOWN_BUGS,
    LONG,
    LONG_EXAMPLES,
    PARAM_EVENTS,
    TORCH_OPTIMIZERS,
    TRITON_OK,
    Case,
    Event,
    Group,
    N,
    Param,
    T,
    cases,
    is_foreach,
    materialize,
)
from differential_compare import Magnitudes, assert_close, compare, compare_state_dicts, exact
from differential_found import FOUND
from differential_sides import Side, group_dict, make_side, set_grads
from hypothesis import HealthCheck, example, given, note, reject, settings

__all__ = ["KNOWN_BUGS", "Case", "Event", "Group", "N", "Param", "T", "run_case"]

optim = torch.optim
S = torch.optim.lr_scheduler

CI_EXAMPLES = 700
SEED = os.environ.get("OPTCOMPILE_FUZZ_SEED")

FUZZ = settings(
    max_examples=LONG_EXAMPLES or CI_EXAMPLES,
    derandomize=not LONG,  # (CI: the same examples every run)
    database=None if not LONG else settings.default.database,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Rejected(Exception):
    """Eager torch.optim refuses the case: it says nothing about the compiler."""


def _through(state: dict[str, Any], save: bool) -> dict[str, Any]:
    """A copy of a state dict: deep-copied, or through torch.save / torch.load."""
    if not save:
        return copy.deepcopy(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def round_trip(
    case: Case, compiled: Side, eager: Side, twin: Side | None, kind: str, save: bool
) -> tuple[Side, Side, Side | None]:
    """Each side loads the other's state (torch.optim casts what it loads to the params'
    dtypes, so both sides load): "fresh" into a new optimizer and scheduler (a freshly
    compiled one from eager's state dict, a new eager one from the compiled one's),
    "in_place" into the optimizers the sides have. The twin loads eager's state."""
    sides = (eager, compiled, eager)
    states = [_through(side.opt.state_dict(), save) for side in sides]
    scheds = [_through(s.sched.state_dict(), save) if s.sched else None for s in sides]
    if kind == "fresh":
        fresh = make_side(case, True, compiled.params, compiled.added)
        fresh.stepped = compiled.stepped
        fresh.hook_calls, fresh.losses = compiled.hook_calls, compiled.losses
        new_eager = make_side(case, False, eager.params, eager.added)
        new_eager.hook_calls, new_eager.losses = eager.hook_calls, eager.losses
        compiled, eager = fresh, new_eager
        twin_case = other_path(case)
        if twin is not None and twin_case is not None:
            twin = make_side(twin_case, False, twin.params, twin.added)
    try:  # (eager first: torch.optim refuses some states, e.g. Adagrad's state cleared)
        _load(eager, states[1], scheds[1])
    except Exception as exc:
        raise Rejected(f"eager load_state_dict: {type(exc).__name__}: {exc}") from exc
    if twin is not None:
        try:
            _load(twin, states[2], scheds[2])
        except Exception:
            twin = None
    _load(compiled, states[0], scheds[0])
    return compiled, eager, twin


def _load(side: Side, state: dict[str, Any], sched: Any) -> None:
    side.opt.load_state_dict(state)
    if side.sched is not None:
        side.sched.load_state_dict(sched)


def deep_copy(side: Side) -> Side:
    """The side's params, optimizer and scheduler deep-copied together (one memo: the copy's
    optimizer and scheduler hold the copied params; a compiled optimizer's copy is compiled)."""
    params, opt, sched = copy.deepcopy((side.params, side.opt, side.sched))
    return replace(side, params=params, opt=opt, sched=sched)


def apply(case: Case, event: Event, side: Side) -> None:
    """An event other than a round trip, on one side (see differential_cases.Event)."""
    if event.kind in PARAM_EVENTS:
        p = side.params[event.args % len(side.params)]
        with torch.no_grad():
            if event.kind == "scale_param":
                p.mul_(0.5)
            elif event.kind == "new_param_storage":
                p.data = p.data.clone(memory_format=torch.contiguous_format)
            elif event.kind == "freeze_param":
                p.requires_grad_(False)
            else:
                _change_state(event.kind, side.opt.state.get(p))
    elif event.kind == "reverse_params":
        side.opt.param_groups[event.args]["params"].reverse()
    elif event.kind == "set":
        index, key, value = event.args
        group = side.opt.param_groups[index]
        if isinstance(group.get(key), torch.Tensor) and isinstance(value, float):
            group[key].fill_(value)  # (as LR schedulers do)
        else:
            group[key] = materialize(value)
    elif event.kind == "add_group":
        start = sum(len(g.params) for g in case.group_specs()[: len(case.groups) + side.added])
        params = side.params[start : start + len(event.args.params)]
        side.opt.add_param_group(group_dict(event.args, params))
        side.added += 1


def _change_state(kind: str, state: dict[str, Any] | None) -> None:
    if not state:
        return
    if kind == "clear_state":
        state.clear()
        return
    key = sorted(k for k, v in state.items() if torch.is_tensor(v))[0]
    if kind == "zero_state":
        state[key].zero_()
    else:  # "new_state_tensor"
        state[key] = state[key].clone()


def _tensor_option(case: Case, name: str, key: str) -> bool:
    options = [case.defaults, *(g.options for g in case.group_specs())]
    return case.optimizer == name and any(isinstance(o.get(key), T) for o in options)


# Why a compiled optimizer may run eagerly: limitations the README documents, each with the
# cases it may apply to.
DOCUMENTED_FALLBACKS: dict[str, tuple[str, Callable[[Case], bool]]] = {
    "fused=True (eager by design)": (r"has fused=True, which runs eagerly", lambda c: True),
    "recompile_limit": (r"recompile limit \(\d+\) reached; the guard", lambda c: True),
    # "a foreach op writing one tensor twice ... runs eagerly with a reason" (here: SGD's
    # nesterov foreach path adds into the grads, one shared by two params; the reason names
    # the shared grad)
    "a foreach op writing one tensor twice": (
        r"writes one tensor twice \(items \d+ and \d+",
        lambda c: c.share_grads,
    ),
    # "weight_decay as a Tensor (every torch.optim optimizer), momentum as a Tensor in SGD
    # and RMSprop, lr and d as Tensors in Adafactor: eager ... torch.optim's own step
    # decides on the tensor's value in Python" (on torch 2.11 with CUDA params, Adafactor's
    # trace fails earlier: "dtype is needed to compute eps1 when eps1 is unset")
    "a Tensor weight_decay, momentum (SGD, RMSprop), Adafactor's Tensor lr": (
        r"makes a Python decision on a tensor's value|dtype is needed to compute eps1",
        lambda c: any(
            _tensor_option(c, name, key)
            for name, key in [
                (c.optimizer, "weight_decay"),
                ("SGD", "momentum"),
                ("RMSprop", "momentum"),
                ("Adafactor", "lr"),
            ]
        ),
    ),
}


def _check_compiled_or_documented(
    case: Case, opt: torch.optim.Optimizer, caught: list[Any]
) -> None:
    report = optcompile.explain(opt)
    fallbacks = [
        str(w.message) for w in caught if issubclass(w.category, optcompile.FallbackWarning)
    ]
    reason = report.fallback_reason
    if reason is None:
        assert report.traces >= 1, "stepped, never traced, yet no fallback"
        return
    assert fallbacks, f"fell back without a FallbackWarning: {reason}"
    for why in [reason, *fallbacks]:
        assert _documented(case, why), f"fell back for an undocumented reason: {why}"


def _documented(case: Case, reason: str) -> bool:
    # A trace that fails is retried up to the recompile limit: the reason names the last
    # failure, which must be documented itself.
    retried = re.search(
        r"recompile limit \(\d+\) reached; \d+ traces? failed, the last: (.*)", reason
    )
    if retried:
        reason = retried.group(1)
    return any(
        re.search(pattern, reason) and applies(case)
        for pattern, applies in DOCUMENTED_FALLBACKS.values()
    )


def _step(side: Side, step: int, case: Case, log: list[Any]) -> None:
    if side.is_compiled and not any(opt is side.opt for opt in side.stepped):
        side.stepped.append(side.opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case.closure:

            def closure() -> torch.Tensor:
                set_grads(case, side.params, step)
                return torch.tensor(float(step))

            side.losses.append(side.opt.step(closure))
        else:
            set_grads(case, side.params, step)
            side.losses.append(side.opt.step())
        if side.sched is not None:
            side.sched.step()
        if case.zero_grad is not None:
            side.opt.zero_grad(set_to_none=case.zero_grad)
    log.extend(caught)


def _user_warnings(caught: list[Any]) -> set[str]:
    """Warnings a user sees (not ours, not numpy's inside the Triton interpreter)."""
    return {
        str(w.message)
        for w in caught
        if not issubclass(w.category, (optcompile.FallbackWarning, RuntimeWarning))
    }


def other_path(case: Case) -> Case | None:
    """The case on eager's other path (foreach for a for-loop group and vice versa): the
    measure of eager's own rounding where the compiled step need not be bitwise equal."""
    if exact(case) or case.optimizer not in TORCH_OPTIMIZERS or case.defaults.get("fused"):
        return None

    def flip(options: dict[str, Any], inherited: Any) -> dict[str, Any]:
        return {**options, "foreach": not is_foreach(case.optimizer, inherited)}

    inherited = case.defaults.get("foreach")
    groups = tuple(
        Group(g.params, flip(g.options, g.options["foreach"])) if "foreach" in g.options else g
        for g in case.groups
    )
    return replace(case, defaults=flip(case.defaults, inherited), groups=groups)


def _twin(case: Case) -> Side | None:
    """Eager on its other path, or None where eager refuses that path."""
    twin_case = other_path(case)
    if twin_case is None:
        return None
    try:
        return make_side(twin_case, compiled=False)
    except Exception:
        return None


def run_case(case: Case) -> None:
    """Step a compiled and an eager optimizer through ``case``, comparing after each step.

    Raises Rejected where eager torch.optim refuses the case, AssertionError on a mismatch.
    """
    if case.backend == "triton" and not TRITON_OK:
        raise Rejected("backend='triton' needs CUDA or TRITON_INTERPRET=1")
    optcompile.reset()
    eager_log: list[Any] = []
    compiled_log: list[Any] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            eager = make_side(case, compiled=False)
        except Exception as exc:
            raise Rejected(f"{type(exc).__name__}: {exc}") from exc
        twin = _twin(case)
        compiled = make_side(case, compiled=True)
        magnitudes: Magnitudes = {}
        compare(case, compiled, eager, "before step 0", None, magnitudes)
        for step in range(case.steps):
            try:
                _step(eager, step, case, eager_log)
            except Exception as exc:
                raise Rejected(f"step {step}: {type(exc).__name__}: {exc}") from exc
            if twin is not None:
                try:
                    _step(twin, step, case, [])
                except Exception:
                    twin = None
            _step(compiled, step, case, compiled_log)
            compare(case, compiled, eager, f"after step {step}", twin, magnitudes, step + 1)
            assert compiled.hook_calls == eager.hook_calls, "step post-hook calls"
            assert_close(case, compiled.losses, eager.losses, "losses returned by step(closure)")
            for event in (e for e in case.events if e.after == step):
                when = f"after step {step} and {event.kind} {event.args}"
                if event.kind == "round_trip":
                    got, want = compiled.opt.state_dict(), eager.opt.state_dict()
                    compare_state_dicts(case, got, want, f"state_dict {when}")
                    compiled, eager, twin = round_trip(case, compiled, eager, twin, *event.args)
                elif event.kind == "deepcopy":
                    compiled, eager = deep_copy(compiled), deep_copy(eager)
                    twin = deep_copy(twin) if twin is not None else None
                else:
                    try:
                        apply(case, event, eager)
                    except Exception as exc:
                        raise Rejected(f"{when}: {type(exc).__name__}: {exc}") from exc
                    for side in (compiled, twin):
                        if side is not None:
                            apply(case, event, side)
                compare(case, compiled, eager, when, twin, magnitudes, step + 1)
    extra = _user_warnings(compiled_log) - _user_warnings(eager_log)
    assert not extra, f"warnings eager does not give: {extra}"
    for opt in compiled.stepped:
        _check_compiled_or_documented(case, opt, caught + compiled_log)


def _seeded(test: Callable[..., None]) -> Callable[..., None]:
    """OPTCOMPILE_FUZZ_SEED=n: the long mode's random examples, reproducibly."""
    if SEED is None:
        return test
    from hypothesis import seed

    return seed(int(SEED))(test)


def _with_found(test: Callable[..., None]) -> Callable[..., None]:
    for case in reversed(FOUND):
        test = example(case=case)(test)
    return test


@_seeded
@FUZZ
@_with_found
@given(case=cases())
def test_compiled_optimizer_matches_eager_on_drawn_cases(case: Case) -> None:
    note(f"run_case({case!r})")
    try:
        run_case(case)
    except Rejected:
        reject()
