"""What the differential test draws: a ``Case`` (the optimizer, its options and groups, the
parameters, what happens between steps) and the hypothesis strategy ``cases()``.

A Case is plain data with an evaluable repr: a failing one, printed by hypothesis, replays
with ``run_case(Case(...))`` (test_differential.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import reject
from hypothesis import strategies as st
from optkernels.c_kernel import find_compiler
from step_optimizers import ClippedAdam, ForeachLamb, SophiaLike
from triton_setup import TRITON_RUNS

LONG_EXAMPLES = int(os.environ.get("OPTCOMPILE_FUZZ_EXAMPLES", "0"))
LONG = LONG_EXAMPLES > 0
WITH_KNOWN_BUGS = os.environ.get("OPTCOMPILE_FUZZ_KNOWN_BUGS") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = TRITON_RUNS
# backend "cpu" (generated C loop nests: what "auto" picks for CPU params) where a C
# compiler builds them; OPTCOMPILE_FUZZ_BACKEND=cpu draws it alone (a campaign over it)
CPU_OK = DEVICE == "cpu" and not isinstance(find_compiler(), str)
ONLY_BACKEND = os.environ.get("OPTCOMPILE_FUZZ_BACKEND")


@dataclass(frozen=True)
class T:
    """A hyperparameter given as a 0-dim tensor (a fresh one per optimizer)."""

    value: float

    def make(self) -> torch.Tensor:
        return torch.tensor(self.value)


@dataclass(frozen=True)
class N:
    """A hyperparameter given as a numpy float64 (README: symbolic like a Python float)."""

    value: float

    def make(self) -> np.float64:
        return np.float64(self.value)


def materialize(value: Any) -> Any:
    """A fresh hyperparameter value (tensors are never shared between optimizers)."""
    if isinstance(value, (T, N)):
        return value.make()
    if isinstance(value, tuple):
        return tuple(materialize(v) for v in value)
    return value


@dataclass(frozen=True)
class Param:
    shape: tuple[int, ...]
    dtype: str = "float32"
    # "contiguous" | "transposed" (dims reversed) | "strided" (every other element of a
    # larger tensor's last dim) | "flat" (a view into one flat buffer per dtype)
    layout: str = "contiguous"
    # "contiguous" | "like_param" (empty_like: the param's strides) | "strided"
    grad_layout: str = "contiguous"


@dataclass(frozen=True)
class Group:
    params: tuple[Param, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    """Something done to both sides after step ``after``.

    ``("set", (group, key, value))``: a user changes a hyperparameter (a tensor one is
    filled in place, as schedulers do); ``("add_group", Group)``: add_param_group (its params
    exist from the start, without an optimizer); ``("round_trip", (kind, through_save))``:
    state_dict round trip, see test_differential.round_trip; ``(kind, param)`` for a kind in
    PARAM_EVENTS; ``("reverse_params", group)``: the group's params list reversed in place;
    ``("deepcopy", None)``: each side goes on with a deep copy of its params, optimizer and
    scheduler (README: a compiled optimizer's copy is compiled with the same options).
    """

    after: int
    kind: str
    args: Any


@dataclass(frozen=True)
class Case:
    optimizer: str
    groups: tuple[Group, ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    steps: int = 3
    # Per step: indices (over all params, in group order) whose grad is None at that step.
    none_grads: tuple[tuple[int, ...], ...] = ()
    grads_in_place: bool = False  # write new grad values into the existing grad tensors
    share_grads: bool = False  # params of one shape and dtype get one grad tensor
    zero_grad: bool | None = None  # after each step: zero_grad(set_to_none=...)
    closure: bool = False  # step(closure), the closure setting the grads
    hooks: bool = False  # a step pre-hook halving the grads, a post-hook counting
    scheduler: str | None = None
    scheduler_first: bool = False  # the scheduler is attached before compile()
    events: tuple[Event, ...] = ()
    backend: str = "torch"
    cudagraphs: bool = False  # cudagraphs="auto" (else False)
    recompile_limit: int | None = None
    seed: int = 0

    def group_specs(self) -> list[Group]:
        """The constructor's groups, then those add_param_group adds."""
        return [*self.groups, *(e.args for e in self.events if e.kind == "add_group")]

    def param_specs(self) -> list[Param]:
        return [p for g in self.group_specs() for p in g.params]


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

# Each option an optimizer accepts (besides lr, foreach, capturable, fused, differentiable,
# drawn in _options as each optimizer accepts them) and the values drawn for it.
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

# Open bugs, excluded from the draw until they are fixed (OPTCOMPILE_FUZZ_KNOWN_BUGS=1 draws
# them): see known_bug. Fixed since
# this test was written, and drawn again: CPU foreach on float16/bfloat16, RAdam/ASGD
# without capturable on float64, an in-place op on a 0-dim half tensor with a tensor
# hyperparameter (found here), a scheduler attached before compile() warning (found here),
# copy.deepcopy of a compiled optimizer, the Triton plan's store of 0-dim bfloat16 results
# under the interpreter (found here), a frozen param given a grad later (found here),
# backend='triton' on float64 with capturable=False (bias corrections in double),
# Adafactor's foreach=None on CUDA (its for-loop, as eager), NAdam with capturable=False
# on backend='triton' with a param the kernels do not take (CPU step counts on CUDA),
# Rprop on backend='triton' over lanes of several dtypes (found here), backend='triton' on
# float16 (NAdam/Adamax over one 0-dim param: a KeyError in the plan), Adafactor with
# weight decay on a strided float16/bfloat16 param beside others (the batched torch plan
# computed its in-place ops on dense results: an ulp off; reproduced by the long mode),
# backend='triton' on float64 with capturable=False and a Tensor hyperparameter in the bias
# corrections (eager's are float32 tensor ops: its own path is traced now, and the host
# computes them as ATen does), ASGD on a float16/bfloat16 param on backend='triton' (its
# 'ax' a few ulps off eager's copy of the param while mu == 1, found by the long mode on a
# GPU; not reproduced by the direct test of the scenario and its neighbours,
# test_asgd_half.py, on the CPU; that test runs on CUDA too).
KNOWN_BUGS: dict[str, str] = {}


def known_bug(
    optimizer: str, backend: str, dtype: str, options: dict[str, Any] | None = None
) -> str | None:
    """The KNOWN_BUGS entry a param of ``dtype`` in a group with ``options`` would hit."""
    return None


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


# Small shapes everywhere (0-dim, empty, one element); a few larger ones, where blocks
# straddle tensor ends, except under the Triton interpreter (slow), which takes TINY.
SHAPES = [(3,), (), (0,), (1,), (2, 3), (3, 1, 2), (0, 3), (5,), (4, 2), (33,), (7, 9)]
LONG_SHAPES = [(130,), (1025,), (2, 3, 4), (4097,)]
TINY = [s for s in SHAPES if _numel(s) <= 8]
DTYPES = ["float32", "float64", "bfloat16", "float16", "complex64"]
SCHEDULERS = [None, "StepLR", "CosineAnnealingLR", "OneCycleLR", "LambdaLR"]
ROUND_TRIPS = ["fresh", "in_place"]
# Events on one param (by index) or its state: an in-place change of its values, new
# storage (``p.data = ...``, README: retraces), requires_grad off (eager still steps it),
# its state cleared, one state tensor zeroed in place or replaced by a copy.
PARAM_EVENTS = [
    "scale_param",
    "new_param_storage",
    "freeze_param",
    "clear_state",
    "zero_state",
    "new_state_tensor",
]


def is_foreach(name: str, foreach: bool | None) -> bool:
    """The path eager takes: foreach=None picks foreach on CUDA, the for-loop on CPU
    (Adafactor: the for-loop everywhere)."""
    if name in ("ClippedAdam", "ForeachLamb"):
        return True
    if foreach is None:
        return DEVICE == "cuda" and name != "Adafactor"
    return foreach


# Hyperparameters torch.optim accepts as 0-dim tensors, besides lr (README: compiled), and
# those its own step decides on in Python (README: eager, with a FallbackWarning).
TENSOR_OPTIONS = {
    "Adam": ["betas"],
    "AdamW": ["betas"],
    "NAdam": ["betas", "momentum_decay"],
    "RAdam": ["betas"],
    "Adamax": ["betas"],
    "Adadelta": ["rho"],
    "Adagrad": ["lr_decay", "initial_accumulator_value"],
    "RMSprop": ["alpha"],
    "Rprop": ["etas", "step_sizes"],
    "ASGD": ["lambd", "alpha", "t0"],
    "Adafactor": ["beta2_decay"],
}
TENSOR_FALLBACKS = {"SGD": ["weight_decay", "momentum"], "RMSprop": ["momentum"]}


def _tensor_options(name: str, options: dict[str, Any], draw: Any) -> dict[str, Any]:
    """Some hyperparameters as 0-dim tensors (where torch.optim accepts them) or numpy
    floats. (A Tensor weight_decay, SGD's and RMSprop's Tensor momentum, Adafactor's Tensor
    lr run eagerly: README; drawn rarely.)"""
    kind = draw(st.integers(0, 7))
    if "lr" in options and kind < 2 and name != "Adafactor":
        options["lr"] = T(options["lr"])
    elif "lr" in options and kind == 2 and name != "ASGD":
        # (ASGD makes its new eta a tensor of a number computed from lr: eager's is float64
        # for a numpy lr, the compiled step's the default dtype, which a float64 param's eta
        # after load_state_dict shows: README, the float hyperparameters row)
        options["lr"] = N(options["lr"])
    for key in TENSOR_OPTIONS.get(name, []):
        if key in options and draw(st.integers(0, 5)) == 0:
            value = options[key]
            options[key] = tuple(T(v) for v in value) if isinstance(value, tuple) else T(value)
    if name in TORCH_OPTIMIZERS:
        rare = [*TENSOR_FALLBACKS.get(name, []), "weight_decay", "lr"]
        for key in rare if name == "Adafactor" else rare[:-1]:
            value = options.get(key)
            if value and not isinstance(value, T | N) and draw(st.integers(0, 15)) == 0:
                options[key] = T(value)
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


def valid(name: str, options: dict[str, Any]) -> bool:
    """Constructor-time rules of torch.optim (so that few cases are rejected)."""
    # "lr as a Tensor is not supported for capturable=False and foreach=True"
    tensor_lr = name in ("Adam", "AdamW") and isinstance(options.get("lr"), T)
    if tensor_lr and is_foreach(name, options.get("foreach")) and not options.get("capturable"):
        return False
    # betas (and NAdam's momentum_decay) as Tensors: eager's foreach path refuses them
    tensors = [options.get("betas", (None,))[0], options.get("momentum_decay")]
    if any(isinstance(v, T) for v in tensors) and is_foreach(name, options.get("foreach")):
        return False
    if name == "SGD" and options.get("nesterov"):
        return bool(options.get("momentum")) and not options.get("dampening")
    return not (options.get("fused") and options.get("foreach"))


@st.composite
def _group(
    draw: Any, name: str, backend: str, defaults: dict[str, Any], shapes: list[Any]
) -> Group:
    options = draw(_options(name, group=True)) if draw(st.booleans()) else {}
    merged = {**defaults, **options}
    if not valid(name, merged):
        options, merged = {}, defaults
    dtypes = DTYPES if name in TORCH_OPTIMIZERS and name != "Adafactor" else DTYPES[:-1]
    params = []
    for _ in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from(shapes))
        dtype = draw(st.sampled_from(dtypes)) if draw(st.integers(0, 2)) == 0 else "float32"
        if known_bug(name, backend, dtype, merged) and not WITH_KNOWN_BUGS:
            dtype = "float32"
        layouts = ["contiguous", "flat"]
        if len(shape) >= 2:
            layouts.append("transposed")
        if len(shape) >= 1:
            layouts.append("strided")
        layout = layouts[0] if draw(st.integers(0, 2)) else draw(st.sampled_from(layouts))
        grads = ["contiguous", "like_param"] + (["strided"] if len(shape) >= 1 else [])
        if merged.get("fused") and DEVICE == "cpu":
            # torch 2.13's fused CPU steps (SGD, Adam, AdamW, Adagrad) read a grad as if it
            # were contiguous: a strided one's values are other elements', an expanded one's
            # lie past its storage (garbage, or a segmentation fault). optcompile runs
            # fused=True as eager does (README), so both sides would read what is there.
            grads = ["contiguous"]
        params.append(Param(shape, dtype, layout, draw(st.sampled_from(grads))))
    return Group(tuple(params), options)


@st.composite
def _set_event(draw: Any, name: str, groups: list[Group], after: int) -> Event:
    """A hyperparameter a user changes between steps (plain values only)."""
    table = dict(OPTIONS[name])
    table["lr"] = LRS.get(name, LR)
    if name in TORCH_OPTIMIZERS:
        table["foreach"] = [True, False, None]
    index = draw(st.integers(0, len(groups) - 1))
    key = draw(st.sampled_from(sorted(table)))
    return Event(after, "set", (index, key, draw(st.sampled_from(table[key]))))


@st.composite
def cases(draw: Any) -> Case:
    name = draw(st.sampled_from([*TORCH_OPTIMIZERS, *CUSTOM]))
    roll = draw(st.integers(0, 5))
    backend = "triton" if TRITON_OK and roll == 0 else "cpu" if CPU_OK and roll == 1 else "torch"
    if ONLY_BACKEND is not None:
        backend = ONLY_BACKEND
    defaults = draw(_options(name, group=False))
    if name in FUSED and draw(st.integers(0, 15)) == 0:
        defaults["fused"] = True
        defaults.pop("foreach", None)
    if not valid(name, defaults):
        reject()
    shapes = SHAPES + (LONG_SHAPES if LONG else [])
    if backend == "triton" and DEVICE == "cpu":
        shapes = TINY  # the interpreter is slow
    if name == "Adafactor":  # (eager divides by the numel)
        shapes = [s for s in shapes if _numel(s) > 0]
    groups = [draw(_group(name, backend, defaults, shapes)) for _ in range(draw(st.integers(1, 3)))]
    n = sum(len(g.params) for g in groups)  # (params that added groups bring come after)
    steps = draw(st.integers(2, 7 if LONG else 5))
    scheduler = draw(st.sampled_from(SCHEDULERS))
    events = []
    for after in range(steps - 1):
        if draw(st.integers(0, 5)) == 0:
            events.append(draw(_set_event(name, groups, after)))
        if scheduler is None and draw(st.integers(0, 9)) == 0:  # (schedulers zip groups)
            events.append(Event(after, "add_group", draw(_group(name, backend, defaults, shapes))))
        if draw(st.integers(0, 3)) == 0:
            kind = draw(st.sampled_from(ROUND_TRIPS))
            events.append(Event(after, "round_trip", (kind, draw(st.booleans()))))
        if draw(st.integers(0, 9)) == 0:
            events.append(Event(after, "deepcopy", None))
        if draw(st.integers(0, 5)) == 0:
            kind = draw(st.sampled_from([*PARAM_EVENTS, "reverse_params"]))
            target = draw(st.integers(0, 20)) % (len(groups) if kind == "reverse_params" else n)
            events.append(Event(after, kind, target))
    n += sum(len(e.args.params) for e in events if e.kind == "add_group")
    none_grads: tuple[tuple[int, ...], ...] = ((),) * steps
    if draw(st.booleans()) and name != "SophiaLike":  # (SophiaLike steps every param)
        none = st.lists(st.integers(0, n - 1), max_size=n, unique=True).map(
            lambda xs: tuple(sorted(xs))
        )
        none_grads = tuple(draw(none) for _ in range(steps))
    if name == "ClippedAdam":  # (its global norm stacks the group's norms: one at least)
        firsts = {sum(len(g.params) for g in groups[:i]) for i in range(len(groups))}
        none_grads = tuple(tuple(i for i in ng if i not in firsts) for ng in none_grads)
    return Case(
        optimizer=name,
        groups=tuple(groups),
        defaults=defaults,
        steps=steps,
        none_grads=none_grads,
        grads_in_place=draw(st.booleans()),
        share_grads=draw(st.integers(0, 5)) == 0,
        zero_grad=draw(st.sampled_from([None, None, True, False])),
        closure=name in TORCH_OPTIMIZERS and draw(st.integers(0, 5)) == 0,
        hooks=draw(st.integers(0, 5)) == 0,
        scheduler=scheduler,
        scheduler_first=scheduler is not None and draw(st.booleans()),
        events=tuple(events),
        backend=backend,
        cudagraphs=backend == "triton" and DEVICE == "cuda" and draw(st.booleans()),
        recompile_limit=draw(st.sampled_from([None] * 7 + [1, 2])),
        seed=draw(st.integers(0, 3)),
    )
