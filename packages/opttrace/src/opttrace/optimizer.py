"""Tracing ``torch.optim.Optimizer.step``: real state initialization, then the traced step."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from opttrace import asgd, radam, replicate
from opttrace._torch_compat import default_foreach, raw_step
from opttrace._torch_compat import for_loop as patch_for_loop
from opttrace.errors import TraceError
from opttrace.tracer import TracedStep, trace

EAGER_ONLY_OPTIONS = ("fused", "differentiable")


def eager_only_reason(opt: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's step must run eagerly (an option the compiler does not trace)."""
    for i, group in enumerate(opt.param_groups):
        for option in EAGER_ONLY_OPTIONS:
            if group.get(option):
                return (
                    f"param_groups[{i}] has {option}=True, which runs eagerly; "
                    f"pass {option}=False to compile this optimizer"
                )
    return None


def closure_reason(cls: type) -> str | None:
    """Why ``cls.step`` must run eagerly because it needs its closure inside the step (it
    evaluates the loss again, as LBFGS's line search does): a compiled step runs the closure
    once, before the traced update, which is how every other torch.optim optimizer uses it."""
    try:
        closure = inspect.signature(raw_step(cls)).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing to say
        return None
    if closure is None or closure.default is not inspect.Parameter.empty:
        return None
    return (
        f"{cls.__name__}.step(closure) needs its closure during the step (it evaluates the "
        "loss again, as a line search does); only a step that calls its closure once, before "
        "the update, can be compiled"
    )


def _init_group_arity(cls: type) -> int | None:
    """How many output lists ``cls._init_group(group, *lists)`` takes, if it has that form."""
    init = getattr(cls, "_init_group", None)
    if init is None:
        return None
    params = list(inspect.signature(init).parameters.values())[2:]  # self, group
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in positional or p.default is not p.empty for p in params):
        return None
    return len(params)


def init_state(opt: torch.optim.Optimizer) -> None:
    """Run the optimizer's own ``_init_group`` for real, so lazily created state exists
    (with eager's exact values) before the step is traced."""
    arity = _init_group_arity(type(opt))
    if arity is None:
        return
    init: Any = type(opt)._init_group  # type: ignore[attr-defined]
    with torch.no_grad():
        for group in opt.param_groups:
            init(opt, group, *([] for _ in range(arity)))


def trace_step(opt: torch.optim.Optimizer, capturable: bool = False) -> TracedStep:
    """Trace ``opt.step()`` (no closure) into a TracedStep whose inputs are ``L['opt']...``.

    ``capturable=True`` traces the path that keeps every value on the device (what fused
    kernels and CUDA graphs need); by default the path eager takes.
    """
    reason = eager_only_reason(opt)
    if reason is not None:
        raise TraceError(reason)
    init_state(opt)
    step = raw_step(type(opt))
    with replicate.replicated():
        return _trace_step(opt, step, capturable)


def _trace_step(opt: torch.optim.Optimizer, step: Any, capturable: bool) -> TracedStep:
    if capturable:
        try:
            with _eager_averaging(opt):
                return trace(
                    lambda opt: step(opt),
                    {"opt": opt},
                    capturable=True,
                    python_floats=_python_float_state(opt),
                )
        except TraceError as exc:
            # A step without a capturable path (Adafactor reads values with .item(); torch
            # 2.11's asserts on the ungrouped lists its compile path gets): the path eager
            # takes; the backend then says what it cannot capture.
            try:
                return trace(lambda opt: step(opt), {"opt": opt})
            except TraceError:
                raise exc from None
    try:
        with _eager_path(opt):
            return trace(lambda opt: step(opt), {"opt": opt})
    except TraceError as exc:
        if not any(group.get("capturable") is False for group in opt.param_groups):
            raise
        # Some non-capturable paths decide on step counts in Python (RAdam's rectification,
        # ASGD's averaging): the capturable path computes the same update on the device,
        # from the step counts in double, as eager's Python floats are.
        try:
            with _eager_averaging(opt):
                return trace(
                    lambda opt: step(opt),
                    {"opt": opt},
                    capturable=True,
                    python_floats=_python_float_state(opt),
                    float64_inputs=_python_float_state(opt, decided_on=True),
                )
        except TraceError:
            raise exc from None


def _eager_averaging(opt: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """In a trace of the capturable path: ASGD's and RAdam's for-loop groups without
    ``capturable`` compute their update as eager does, its Python decision an exact select
    (opttrace.asgd, opttrace.radam: ``capturable_for_loop``)."""
    if isinstance(opt, torch.optim.ASGD):
        return _own_for_loop(opt, "asgd", asgd.capturable_for_loop)
    if isinstance(opt, torch.optim.RAdam):
        return _own_for_loop(opt, "radam", radam.capturable_for_loop)
    return contextlib.nullcontext()


def _eager_path(opt: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """In a trace of the path eager takes: RAdam's and ASGD's for-loop groups without
    ``capturable`` traced as eager's own path, its Python decision an exact select
    (opttrace.radam, opttrace.asgd: ``for_loop``); ASGD's where its state lives on the CPU
    (with the params: eager reads the step counts, eta and mu by value on the host, its foreach
    groups their step counts; on a GPU that would be a device sync per param, and the
    capturable path is traced instead)."""
    on_cpu = all(p.device.type == "cpu" for group in opt.param_groups for p in group["params"])
    if on_cpu and isinstance(opt, torch.optim.ASGD):
        return _asgd_eager_path(opt)
    if isinstance(opt, torch.optim.RAdam):  # (its step counts live on the CPU)
        return _own_for_loop(opt, "radam", radam.for_loop)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _asgd_eager_path(opt: torch.optim.ASGD) -> Iterator[None]:
    """ASGD's for-loop groups as ``for_loop``, its foreach groups' mu from a step count read
    as a Python float recorded (opttrace.asgd.numbers_as_tensors)."""
    with _own_for_loop(opt, "asgd", asgd.for_loop), asgd.numbers_as_tensors():
        yield


def _own_for_loop(
    opt: torch.optim.Optimizer, module: str, replacement: Any
) -> contextlib.AbstractContextManager[None]:
    """torch.optim's ``module`` for-loop replaced by ``replacement`` for the groups without
    ``capturable``. Its step calls the functional (``asgd()``, ``radam()``) once per group, in
    order, and that calls the for-loop for the groups whose (resolved) foreach is off: those
    groups' own ``capturable`` options, in that order (a trace's view of the groups may say
    True)."""
    own = iter(
        [
            bool(group.get("capturable"))
            for group in opt.param_groups
            if not _foreach(group, type(opt))
        ]
    )

    def for_loop(original: Any, *args: Any, **kwargs: Any) -> Any:
        if next(own, True):
            return replicate.run(original, *args, **kwargs)
        return replicate.run(replacement, *args, **{**kwargs, "capturable": False})

    return patch_for_loop(module, for_loop)


def _foreach(group: dict[str, Any], cls: type) -> bool:
    foreach = group.get("foreach")
    return default_foreach(group["params"], cls) if foreach is None else bool(foreach)


# The 0-dim state torch.optim's capturable=False paths keep on the CPU and read as numbers.
_PYTHON_FLOAT_KEYS = ("step", "mu_product", "eta", "mu")


def _python_float_state(opt: torch.optim.Optimizer, decided_on: bool = False) -> list[torch.Tensor]:
    """The 0-dim float state tensors that torch.optim's own non-capturable paths read as
    Python floats (in groups with ``capturable=False``, or without the option: Adagrad):
    the step counts with ``.item()``, NAdam's mu_product, ASGD's eta and mu; they stay on
    the CPU. A group with ``capturable=True`` computes with them as tensors, in their
    dtype, as its trace does; so may a custom step (not marked).

    ``decided_on``: only those that a step branching on them in Python (RAdam's
    rectification, ASGD's averaging) reads as Python floats where its capturable path
    computes with tensors, a custom step's with ``capturable=False`` too: the step counts,
    except on ASGD's foreach path (which computes eta from them as float32 tensors); on
    ASGD's for-loop path eta and mu too."""
    own = getattr(raw_step(type(opt)), "__module__", "").startswith("torch.optim.")
    tensors = []
    for group in opt.param_groups:
        capturable = group.get("capturable", False if own else None)
        if capturable is not False or not (own or decided_on):
            continue
        keys: tuple[str, ...] = _PYTHON_FLOAT_KEYS  # (not a 0-dim param's exp_avg)
        if decided_on:
            keys = ("step",)
            if isinstance(opt, torch.optim.ASGD):
                keys = () if _foreach(group, type(opt)) else ("step", "eta", "mu")
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                small = isinstance(value, torch.Tensor) and value.dim() == 0
                if small and value.is_floating_point() and key in keys:
                    tensors.append(value)
    return tensors


def eager_step(opt: torch.optim.Optimizer) -> Any:
    """Run ``opt``'s own step eagerly, without torch.optim's hook wrapper (hooks run outside)."""
    return raw_step(type(opt))(opt)
