"""A randomized differential test: compiled optimizers against eager torch.optim.

Hypothesis draws a ``Case``: an optimizer (the eleven torch.optim ones with foreach and
for-loop paths, Adafactor, and custom steps from ``step_optimizers.py``), its constructor
options, param groups that override options of their own, parameters (0-dim, empty, small;
contiguous, transposed, strided slices of a larger tensor, views into one flat buffer;
float32 always, float64/bfloat16/float16 where supported), gradients (new tensors or written
in place, sometimes in a layout other than the param's; None for some params on some steps),
an LR scheduler (created before or after ``compile``), a ``state_dict`` round trip mid-run,
and the backend ("torch", or "triton" for a smaller share of cases). It steps a compiled
optimizer and an eager one over parameters built the same way, and after every step
compares the parameters, every state entry and the group hyperparameters:

- bitwise where the compiled graph runs eager's own ATen ops (backend "torch", except
  RAdam and ASGD without capturable, whose trace takes the capturable path: README);
- otherwise within the per-dtype tolerances torch's own test_optim allows between its
  foreach and for-loop paths (torch.testing's defaults).

The compiled optimizer must either have compiled (``explain(opt).traces >= 1``, no
fallback) or have fallen back with a ``FallbackWarning`` whose reason is a documented
limitation (``DOCUMENTED_FALLBACKS``): never silently different. Combinations eager
torch.optim itself rejects are not drawn or are rejected (never guessed).

Modes (environment variables):

- CI (default): ``CI_EXAMPLES`` examples, ``derandomize=True``, no example database: the
  same examples on every run, about 2 minutes on the 2-core CPU machine under
  ``TRITON_INTERPRET=1`` (the integration session sets it; without it the Triton backend
  is not drawn on CPU).
- ``OPTCOMPILE_FUZZ_EXAMPLES=2000``: that many random examples (``OPTCOMPILE_FUZZ_SEED=n``
  makes them reproducible), longer runs (up to 7 steps), larger shapes. On a CUDA machine
  the parameters live on the GPU, ``capturable`` is drawn, and backend "triton" (without
  the interpreter) and ``cudagraphs`` are exercised:
  ``OPTCOMPILE_FUZZ_EXAMPLES=2000 python -m pytest integration_tests/test_differential.py``.
- ``OPTCOMPILE_FUZZ_KNOWN_BUGS=1``: also draw the combinations of ``KNOWN_BUGS`` (open
  bugs, excluded from the draw until fixed; delete an entry to re-enable it for good).

A failure prints the shrunk ``Case``; ``run_case(<that repr>)`` replays it (``python -c
"from test_differential import *; run_case(Case(...))"`` from ``integration_tests/``).
"""

from __future__ import annotations

import copy
import io
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import optcompile
import torch
from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st
from step_optimizers import ClippedAdam, ForeachLamb, SophiaLike

optim = torch.optim
S = torch.optim.lr_scheduler

CI_EXAMPLES = 160
LONG_EXAMPLES = int(os.environ.get("OPTCOMPILE_FUZZ_EXAMPLES", "0"))
LONG = LONG_EXAMPLES > 0
SEED = os.environ.get("OPTCOMPILE_FUZZ_SEED")
WITH_KNOWN_BUGS = os.environ.get("OPTCOMPILE_FUZZ_KNOWN_BUGS") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"

settings.register_profile(
    "optcompile-fuzz",
    max_examples=LONG_EXAMPLES or CI_EXAMPLES,
    derandomize=not LONG,
    database=None if not LONG else settings.default.database,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("optcompile-fuzz")

# --------------------------------------------------------------------------- the case


@dataclass(frozen=True)
class T:
    """A hyperparameter given as a 0-dim tensor (a fresh one per optimizer)."""

    value: float

    def make(self) -> torch.Tensor:
        return torch.tensor(self.value)


@dataclass(frozen=True)
class Param:
    shape: tuple[int, ...]
    dtype: str = "float32"
    # "contiguous" | "transposed" (dims reversed) | "strided" (every other element of a
    # larger tensor's last dim) | "flat" (a view into one flat buffer per dtype)
    layout: str = "contiguous"
    grad_layout: str = "contiguous"  # | "like_param" (empty_like: the param's strides)


@dataclass(frozen=True)
class Group:
    params: tuple[Param, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    optimizer: str
    groups: tuple[Group, ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    steps: int = 3
    # Per step: indices (over all params, in group order) whose grad is None at that step.
    none_grads: tuple[tuple[int, ...], ...] = ()
    grads_in_place: bool = False  # write new grad values into the existing grad tensors
    scheduler: str | None = None
    scheduler_first: bool = False  # the scheduler is attached before compile()
    # (after step k, "fresh" | "in_place", through torch.save?): see round_trip
    round_trip: tuple[int, str, bool] | None = None
    backend: str = "torch"
    cudagraphs: bool = False
    seed: int = 0


# --------------------------------------------------------------------------- what is drawn

TORCH_OPTIMIZERS = [
    "Adam",
    "AdamW",
    "NAdam",
    "RAdam",
    "Adamax",
    "Adadelta",
    "Adagrad",
    "RMSprop",
    "Rprop",
    "SGD",
    "ASGD",
    "Adafactor",
]
CUSTOM = {"SophiaLike": SophiaLike, "ClippedAdam": ClippedAdam, "ForeachLamb": ForeachLamb}
CAPTURABLE = {"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "RMSprop", "Rprop", "ASGD"}
FUSED = {"Adam", "AdamW", "SGD", "Adagrad"}  # fused=True: an eager fallback (README)
LRS = {"Adadelta": [1.0, 0.5]}  # everything else: LR
LR = [1e-2, 1e-3, 0.1]
BETAS = [(0.9, 0.999), (0.8, 0.9), (0.0, 0.99), (0.95, 0.95)]
EPS = [1e-8, 1e-6]
WEIGHT_DECAY = [0.0, 0.1]

# Each option an optimizer accepts (beyond lr, foreach, capturable, fused, which every
# optimizer draws below as it accepts them) and the values drawn for it.
OPTIONS: dict[str, dict[str, list[Any]]] = {
    "Adam": {
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "amsgrad": [False, True],
        "maximize": [False, True],
        "decoupled_weight_decay": [False, True],
    },
    "AdamW": {
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": [0.01, 0.0, 0.1],
        "amsgrad": [False, True],
        "maximize": [False, True],
    },
    "NAdam": {
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum_decay": [4e-3, 1e-2],
        "decoupled_weight_decay": [False, True],
        "maximize": [False, True],
    },
    "RAdam": {
        "betas": BETAS,  # (0.8, 0.9) takes RAdam's rect > 5 branch from step 2 on
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "decoupled_weight_decay": [False, True],
        "maximize": [False, True],
    },
    "Adamax": {
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "maximize": [False, True],
    },
    "Adadelta": {
        "rho": [0.9, 0.8],
        "eps": [1e-6, 1e-5],
        "weight_decay": WEIGHT_DECAY,
        "maximize": [False, True],
    },
    "Adagrad": {
        "lr_decay": [0.0, 0.01],
        "weight_decay": WEIGHT_DECAY,
        "initial_accumulator_value": [0.0, 0.1],
        "eps": [1e-10, 1e-8],
        "maximize": [False, True],
    },
    "RMSprop": {
        "alpha": [0.99, 0.9],
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum": [0.0, 0.5, 0.9],
        "centered": [False, True],
        "maximize": [False, True],
    },
    "Rprop": {
        "etas": [(0.5, 1.2), (0.4, 1.5)],
        "step_sizes": [(1e-6, 50.0), (1e-5, 1.0)],
        "maximize": [False, True],
    },
    "SGD": {
        "momentum": [0.0, 0.9, 0.5],
        "dampening": [0.0, 0.1],
        "weight_decay": WEIGHT_DECAY,
        "nesterov": [False, True],
        "maximize": [False, True],
    },
    "ASGD": {
        "lambd": [1e-4, 1e-3],
        "alpha": [0.75, 0.5],
        "t0": [1e6, 1.0, 0.0],  # 1.0 / 0.0 start the averaging inside the run
        "weight_decay": WEIGHT_DECAY,
        "maximize": [False, True],
    },
    "Adafactor": {
        "beta2_decay": [-0.8, -0.5],
        "eps": [(None, 1e-3), (1e-4, 1e-2)],
        "d": [1.0, 2.0],
        "weight_decay": WEIGHT_DECAY,
        "maximize": [False, True],
    },
    "SophiaLike": {},
    "ClippedAdam": {},
    "ForeachLamb": {"weight_decay": [0.01, 0.0]},
}

# Open bugs, excluded from the draw until they are fixed (OPTCOMPILE_FUZZ_KNOWN_BUGS=1
# draws them): see _known_bug (params), _tensor_options and the warning filter in run_case.
KNOWN_BUGS: dict[str, str] = {
    "triton-fp64-fp16": "backend='triton' on float64/float16: the kernel computes in fp32",
    "cpu-foreach-half": "CPU foreach on fp16/bf16: in-place vs out-of-place foreach rounding",
    "radam-asgd-fp64": "RAdam/ASGD with capturable=False on float64 (capturable-path trace)",
    "sgd-tensor-wd": "SGD with a Tensor weight_decay falls back",
    "adafactor-tensor-lr": "Adafactor with a Tensor lr falls back",
    "deepcopy-compiled": "copy.deepcopy of a compiled optimizer (never drawn here)",
    # Found by this test:
    "inplace-0dim-promotion": "an in-place op on a 0-dim half tensor with a 0-dim float32 "
    "operand (a tensor hyperparameter) is traced out of place: float32, not rounded",
    "sched-before-compile": "a scheduler attached before compile() warns 'optimizer.step() "
    "has been overridden' on its first step (eager does not)",
}


def _has_tensors(options: dict[str, Any]) -> bool:
    return any(
        isinstance(v, T) or (isinstance(v, tuple) and T in map(type, v)) for v in options.values()
    )


def _known_bug(
    optimizer: str, backend: str, dtype: str, shape: tuple[int, ...], foreach: bool, tensors: bool
) -> str | None:
    """The KNOWN_BUGS entry a param of ``dtype`` and ``shape`` would hit, if any."""
    if tensors and shape == () and dtype in ("float16", "bfloat16"):
        return "inplace-0dim-promotion"
    if backend == "triton" and dtype in ("float64", "float16"):
        return "triton-fp64-fp16"
    if DEVICE == "cpu" and foreach and dtype in ("float16", "bfloat16"):
        return "cpu-foreach-half"
    if optimizer in ("RAdam", "ASGD") and dtype == "float64":
        return "radam-asgd-fp64"  # (capturable=False: CPU always; on CUDA when not drawn)
    return None


# Shapes: small ones everywhere; larger ones (blocks straddling tensor ends) in long runs.
SHAPES = [(3,), (), (0,), (1,), (2, 3), (3, 1, 2), (0, 3), (5,), (4, 2)]
LONG_SHAPES = [(33,), (7, 9), (130,), (1025,), (2, 3, 4)]


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


TINY = [s for s in SHAPES if _numel(s) <= 8]
DTYPES = ["float32", "float64", "bfloat16", "float16"]
SCHEDULERS = [None, "StepLR", "CosineAnnealingLR", "OneCycleLR", "LambdaLR"]
ROUND_TRIPS = ["fresh", "in_place"]


def _is_foreach(name: str, foreach: bool | None) -> bool:
    """The path eager takes: foreach=None picks foreach on CUDA, the for-loop on CPU."""
    if name in ("ClippedAdam", "ForeachLamb"):
        return True
    return foreach if foreach is not None else DEVICE == "cuda"


def _tensor_options(name: str, options: dict[str, Any], draw: Any) -> dict[str, Any]:
    """Some hyperparameters as 0-dim tensors where torch.optim accepts them."""
    # (not Adafactor's lr unless WITH_KNOWN_BUGS: KNOWN_BUGS["adafactor-tensor-lr"])
    lr_ok = name != "Adafactor" or WITH_KNOWN_BUGS
    if "lr" in options and lr_ok and draw(st.integers(0, 3)) == 0:
        options["lr"] = T(options["lr"])
    if name in ("Adam", "AdamW") and "betas" in options and draw(st.integers(0, 5)) == 0:
        options["betas"] = tuple(T(b) for b in options["betas"])
    # (KNOWN_BUGS["sgd-tensor-wd"])
    if name == "SGD" and WITH_KNOWN_BUGS and options.get("weight_decay") and draw(st.booleans()):
        options["weight_decay"] = T(options["weight_decay"])
    return options


@st.composite
def _options(draw: Any, name: str, group: bool) -> dict[str, Any]:
    """Constructor options (``group=False``) or a group's overrides (a sparser subset)."""
    table = OPTIONS[name]
    keep = st.integers(0, 3 if group else 1).map(lambda i: i == 0)
    options = {k: draw(st.sampled_from(v)) for k, v in table.items() if draw(keep)}
    takes_lr = name in TORCH_OPTIMIZERS or name == "ForeachLamb"  # (as an argument)
    if (takes_lr and not group) or (group and draw(keep)):
        options["lr"] = draw(st.sampled_from(LRS.get(name, LR)))
    if name in TORCH_OPTIMIZERS:
        if draw(keep):
            options["foreach"] = draw(st.sampled_from([None, True, False]))
        if name in CAPTURABLE and DEVICE == "cuda" and draw(keep):
            options["capturable"] = draw(st.booleans())
        if not group and name != "Adafactor" and draw(st.integers(0, 7)) == 0:
            options["differentiable"] = False  # (True is an eager fallback by design)
    if name == "SGD" and options.get("nesterov"):  # eager refuses nesterov without these
        options["momentum"] = options.get("momentum") or 0.9
        options["dampening"] = 0.0
    return _tensor_options(name, options, draw)


def _merged(defaults: dict[str, Any], group: Group) -> dict[str, Any]:
    return {**defaults, **group.options}


def _valid(name: str, options: dict[str, Any]) -> bool:
    """Constructor-time rules of torch.optim (so that few cases are rejected)."""
    # "lr as a Tensor is not supported for capturable=False and foreach=True"
    tensor_lr = name in ("Adam", "AdamW") and isinstance(options.get("lr"), T)
    if tensor_lr and _is_foreach(name, options.get("foreach")) and not options.get("capturable"):
        return False
    if name == "SGD" and options.get("nesterov"):
        return bool(options.get("momentum")) and not options.get("dampening")
    return not (options.get("fused") and options.get("foreach"))


@st.composite
def cases(draw: Any) -> Case:
    name = draw(st.sampled_from([*TORCH_OPTIMIZERS, *CUSTOM]))
    backend = "triton" if TRITON_OK and draw(st.integers(0, 5)) == 0 else "torch"
    defaults = draw(_options(name, group=False))
    if name in FUSED and draw(st.integers(0, 15)) == 0:
        defaults["fused"] = True
        defaults.pop("foreach", None)
    shapes = SHAPES + (LONG_SHAPES if LONG else [])
    if backend == "triton" and DEVICE == "cpu":
        shapes = TINY  # the interpreter is slow
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        options = draw(_options(name, group=True)) if draw(st.booleans()) else {}
        merged = {**defaults, **options}
        if not _valid(name, merged):
            options = {}
            if not _valid(name, defaults):
                reject()
        foreach = _is_foreach(name, merged.get("foreach"))
        params = []
        for _ in range(draw(st.integers(1, 3))):
            shape = draw(st.sampled_from(shapes))
            dtype = draw(st.sampled_from(DTYPES)) if draw(st.integers(0, 2)) == 0 else "float32"
            tensors = _has_tensors(defaults) or _has_tensors(options)
            if _known_bug(name, backend, dtype, shape, foreach, tensors) and not WITH_KNOWN_BUGS:
                dtype = "float32"
            layouts = ["contiguous", "flat"]
            if len(shape) >= 2:
                layouts.append("transposed")
            if len(shape) >= 1:
                layouts.append("strided")
            layout = layouts[0] if draw(st.integers(0, 2)) else draw(st.sampled_from(layouts))
            grad_layout = draw(st.sampled_from(["contiguous", "like_param"]))
            params.append(Param(shape, dtype, layout, grad_layout))
        groups.append(Group(tuple(params), options))
    n = sum(len(g.params) for g in groups)
    steps = draw(st.integers(2, 7 if LONG else 5))
    if draw(st.booleans()) and name != "SophiaLike":  # (SophiaLike steps every param)
        none = st.lists(st.integers(0, n - 1), max_size=n, unique=True).map(
            lambda xs: tuple(sorted(xs))
        )
        none_grads = tuple(draw(none) for _ in range(steps))
    else:
        none_grads = ((),) * steps
    scheduler = draw(st.sampled_from(SCHEDULERS))
    round_trip = None
    if draw(st.booleans()):
        kind = draw(st.sampled_from(ROUND_TRIPS))
        round_trip = (draw(st.integers(0, steps - 2)), kind, draw(st.booleans()))
    return Case(
        optimizer=name,
        groups=tuple(groups),
        defaults=defaults,
        steps=steps,
        none_grads=none_grads,
        grads_in_place=draw(st.booleans()),
        scheduler=scheduler,
        scheduler_first=scheduler is not None and draw(st.booleans()),
        round_trip=round_trip,
        backend=backend,
        cudagraphs=backend == "triton" and DEVICE == "cuda" and draw(st.booleans()),
        seed=draw(st.integers(0, 3)),
    )


# --------------------------------------------------------------------------- running a case


class Rejected(Exception):
    """Eager torch.optim refuses the case: it says nothing about the compiler."""


def _materialize(value: Any) -> Any:
    if isinstance(value, T):
        return value.make()
    if isinstance(value, tuple):
        return tuple(_materialize(v) for v in value)
    return value


def build_params(case: Case) -> list[torch.nn.Parameter]:
    """The case's parameters, the same values and layouts on every call."""
    gen = torch.Generator().manual_seed(case.seed)
    specs = [p for g in case.groups for p in g.params]
    flat: dict[str, torch.Tensor] = {}
    for dtype in {p.dtype for p in specs if p.layout == "flat"}:
        total = sum(_numel(p.shape) for p in specs if p.layout == "flat" and p.dtype == dtype)
        flat[dtype] = torch.randn(total + 1, generator=gen).to(DEVICE, getattr(torch, dtype))
    offsets = dict.fromkeys(flat, 1)  # (views start one element in: not at the base)
    params = []
    for spec in specs:
        dtype = getattr(torch, spec.dtype)
        shape = spec.shape
        if spec.layout == "flat":
            start, end = offsets[spec.dtype], offsets[spec.dtype] + _numel(shape)
            offsets[spec.dtype] = end
            tensor = flat[spec.dtype][start:end].view(shape)
        elif spec.layout == "transposed":
            base = torch.randn(shape[::-1], generator=gen).to(DEVICE, dtype)
            tensor = base.permute(*reversed(range(len(shape))))
        elif spec.layout == "strided":
            base = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen).to(DEVICE, dtype)
            tensor = base[..., ::2]
        else:
            tensor = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        params.append(torch.nn.Parameter(tensor))
    return params


def build_optimizer(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    groups, i = [], 0
    for group in case.groups:
        options = {k: _materialize(v) for k, v in group.options.items()}
        groups.append({"params": params[i : i + len(group.params)], **options})
        i += len(group.params)
    defaults = {k: _materialize(v) for k, v in case.defaults.items()}
    cls = CUSTOM.get(case.optimizer) or getattr(optim, case.optimizer)
    return cls(groups, **defaults)


def _lambda(epoch: int) -> float:
    return 0.9**epoch


def build_scheduler(case: Case, opt: torch.optim.Optimizer) -> Any:
    if case.scheduler == "StepLR":
        return S.StepLR(opt, step_size=2, gamma=0.5)
    if case.scheduler == "CosineAnnealingLR":
        return S.CosineAnnealingLR(opt, T_max=case.steps)
    if case.scheduler == "LambdaLR":
        return S.LambdaLR(opt, _lambda)
    if case.scheduler == "OneCycleLR":
        defaults = opt.defaults
        cycle = "momentum" in defaults or "betas" in defaults
        max_lr = 10 * LRS.get(case.optimizer, LR)[0]
        return S.OneCycleLR(opt, max_lr=max_lr, total_steps=case.steps + 1, cycle_momentum=cycle)
    return None


def set_grads(case: Case, params: list[torch.nn.Parameter], step: int) -> None:
    """Gradients for ``step``: the same values (and layouts) on every call."""
    gen = torch.Generator().manual_seed(1000 * case.seed + step)
    specs = [p for g in case.groups for p in g.params]
    none = case.none_grads[step] if step < len(case.none_grads) else ()
    for i, (p, spec) in enumerate(zip(params, specs, strict=True)):
        value = torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype)
        if i in none:
            p.grad = None
        elif case.grads_in_place and p.grad is not None:
            p.grad.copy_(value)
        elif spec.grad_layout == "like_param":
            p.grad = torch.empty_like(p).copy_(value)
        else:
            p.grad = value


@dataclass
class Side:
    """One optimizer (compiled or eager) over its own parameters, with its scheduler."""

    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any
    compiled: list[torch.optim.Optimizer] = field(default_factory=list)


def _compile(case: Case, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optcompile.compile(opt, backend=case.backend, cudagraphs=case.cudagraphs)


def make_side(case: Case, compiled: bool, params: list[torch.nn.Parameter] | None = None) -> Side:
    params = build_params(case) if params is None else params
    opt = build_optimizer(case, params)
    sched = None
    if case.scheduler_first:
        sched = build_scheduler(case, opt)
    if compiled:
        opt = _compile(case, opt)
    if not case.scheduler_first:
        sched = build_scheduler(case, opt)
    return Side(params, opt, sched, [opt] if compiled else [])


# torch.testing's default (rtol, atol) per dtype: what torch's test_optim allows between its
# foreach and for-loop paths (test_foreach_matches_forloop).
TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def exact(case: Case) -> bool:
    """Whether the compiled step runs eager's own ATen ops, so must match bitwise: the torch
    backend, except for RAdam and ASGD without capturable (traced on the capturable path)."""
    if case.backend != "torch":
        return False
    return case.optimizer not in ("RAdam", "ASGD") or bool(case.defaults.get("capturable"))


def _close(case: Case, actual: Any, expected: Any, what: str, twin: Any = None) -> None:
    """``actual`` (compiled) matches ``expected`` (eager): bitwise where ``exact(case)``,
    else within the dtype's tolerance plus how far eager's other path (``twin``: foreach
    for a for-loop step and vice versa) is from eager here."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{what}: {actual.device} != {expected.device}"
        assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
        if exact(case) or not expected.is_floating_point():
            equal = actual.eq(expected) | (actual.isnan() & expected.isnan())
            assert bool(equal.all()), f"{what}: not bitwise equal: {_worst(actual, expected)}"
            return
        rtol, atol = TOLERANCES.get(expected.dtype, (0.0, 0.0))
        a, e = actual.detach().double(), expected.detach().double()
        bound = atol + rtol * e.abs()
        if isinstance(twin, torch.Tensor) and twin.shape == expected.shape:
            bound = bound + (twin.detach().double() - e).abs().nan_to_num(0.0)
        ok = ((a - e).abs() <= bound) | (a == e) | (a.isnan() & e.isnan())
        assert bool(ok.all()), f"{what}: beyond eager's tolerance: {_worst(actual, expected)}"
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), what
        twins = twin if isinstance(twin, (tuple, list)) and len(twin) == len(expected) else None
        for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
            _close(case, x, y, f"{what}[{i}]", twins[i] if twins else None)
    else:
        assert actual == expected or (actual != actual and expected != expected), (
            f"{what}: {actual!r} != {expected!r}"
        )


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.detach().double() - expected.detach().double()).abs().nan_to_num(float("inf"))
    if diff.numel() == 0:
        return "(empty)"
    i = int(diff.flatten().argmax())
    got, want = actual.detach().flatten()[i].item(), expected.detach().flatten()[i].item()
    return f"got {got!r}, eager {want!r} at flat index {i} ({int((diff > 0).sum())} differ)"


def compare(case: Case, got: Side, want: Side, when: str, twin: Side | None = None) -> None:
    """Params, every state entry and the groups' hyperparameters match."""
    twins = twin.params if twin is not None else [None] * len(want.params)
    for i, (p, q, r) in enumerate(zip(got.params, want.params, twins, strict=True)):
        where = f"{when}, param {i} {tuple(q.shape)} {q.dtype}"
        _close(case, p.detach(), q.detach(), where, r)
        assert p.stride() == q.stride(), f"{where}: stride {p.stride()} != {q.stride()}"
        assert (p in got.opt.state) == (q in want.opt.state), f"{where}: state exists?"
        if q in want.opt.state:
            mine, theirs = got.opt.state[p], want.opt.state[q]
            other = twin.opt.state.get(r, {}) if twin is not None else {}
            assert set(mine) == set(theirs), f"{where}: state keys {set(mine)} != {set(theirs)}"
            for key, value in theirs.items():
                _close(case, mine[key], value, f"{where}, state[{key!r}]", other.get(key))
    for i, (g, h) in enumerate(zip(got.opt.param_groups, want.opt.param_groups, strict=True)):
        assert set(g) == set(h), f"{when}, group {i} keys: {set(g) ^ set(h)}"
        for key in h:
            if key != "params":
                _close(case, g[key], h[key], f"{when}, group {i}[{key!r}]")


def compare_state_dicts(case: Case, got: dict[str, Any], want: dict[str, Any], when: str) -> None:
    """The compiled optimizer's state_dict() is eager's (the values compared by compare())."""
    assert set(got["state"]) == set(want["state"]), f"{when}: state_dict state keys"
    for index, entries in want["state"].items():
        assert set(got["state"][index]) == set(entries), f"{when}: state_dict state[{index}]"
    assert len(got["param_groups"]) == len(want["param_groups"]), f"{when}: groups"
    for g, h in zip(got["param_groups"], want["param_groups"], strict=True):
        assert set(g) == set(h), f"{when}: state_dict group keys {set(g) ^ set(h)}"
        for key in h:
            _close(case, g[key], h[key], f"{when}: state_dict group[{key!r}]")


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
    states = [_through(side.opt.state_dict(), save) for side in (eager, compiled, eager)]
    scheds = [
        _through(side.sched.state_dict(), save) if side.sched is not None else None
        for side in (eager, compiled, eager)
    ]
    if kind == "fresh":
        fresh = make_side(case, compiled=True, params=compiled.params)
        fresh.compiled = compiled.compiled + fresh.compiled
        compiled, eager = fresh, make_side(case, compiled=False, params=eager.params)
        twin_case = other_path(case)
        if twin is not None and twin_case is not None:
            twin = make_side(twin_case, compiled=False, params=twin.params)
    sides = (compiled, eager, twin)
    for side, state, sched in zip(sides, states, scheds, strict=True):
        if side is not None:
            side.opt.load_state_dict(state)
            if side.sched is not None:
                side.sched.load_state_dict(sched)
    return compiled, eager, twin


# Why a compiled optimizer may run eagerly: limitations the README documents.
DOCUMENTED_FALLBACKS = {
    "fused=True": r"fused",
    "recompile limit": r"recompile limit \(\d+\) reached",
}


def _check_compiled_or_documented(opt: torch.optim.Optimizer, caught: list[Any]) -> None:
    report = optcompile.explain(opt)
    fallbacks = [
        str(w.message) for w in caught if issubclass(w.category, optcompile.FallbackWarning)
    ]
    if report.fallback_reason is None:
        assert report.traces >= 1, "never traced, yet no fallback"
        return
    assert any(report.fallback_reason in message for message in fallbacks), (
        f"fell back without a FallbackWarning: {report.fallback_reason}"
    )
    documented = [
        k
        for k, pattern in DOCUMENTED_FALLBACKS.items()
        if re.search(pattern, report.fallback_reason)
    ]
    assert documented, f"fell back for an undocumented reason: {report.fallback_reason}"


def _step(side: Side, step: int, case: Case, log: list[Any]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_grads(case, side.params, step)
        side.opt.step()
        if side.sched is not None:
            side.sched.step()
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
        return {**options, "foreach": not _is_foreach(case.optimizer, inherited)}

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
        compare(case, compiled, eager, "before step 0")
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
            compare(case, compiled, eager, f"after step {step}", twin)
            if case.round_trip is not None and case.round_trip[0] == step:
                _, kind, save = case.round_trip
                got, want = compiled.opt.state_dict(), eager.opt.state_dict()
                compare_state_dicts(case, got, want, f"state_dict after step {step}")
                compiled, eager, twin = round_trip(case, compiled, eager, twin, kind, save)
                compare(case, compiled, eager, f"after step {step} and {kind}", twin)
    extra = _user_warnings(compiled_log) - _user_warnings(eager_log)
    if not WITH_KNOWN_BUGS:  # KNOWN_BUGS["sched-before-compile"]
        extra = {m for m in extra if "has been overridden after learning rate" not in m}
    assert not extra, f"warnings eager does not give: {extra}"
    for opt in compiled.compiled:
        _check_compiled_or_documented(opt, caught + compiled_log)


def _seeded(test: Callable[..., None]) -> Callable[..., None]:
    """OPTCOMPILE_FUZZ_SEED=n: the long mode's random examples, reproducibly."""
    if SEED is None:
        return test
    from hypothesis import seed

    return seed(int(SEED))(test)


@_seeded
@FUZZ
@given(case=cases())
def test_compiled_optimizer_matches_eager_on_drawn_cases(case: Case) -> None:
    note(f"run_case({case!r})")
    try:
        run_case(case)
    except Rejected:
        reject()
