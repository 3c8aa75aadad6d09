"""The compiled optimizer: the same object, its class swapped for a compiled subclass.

``compile(opt)`` sets ``opt.__class__`` to a subclass of its class (made once per class,
named like it) whose ``step`` runs the compiled update; nothing is added to the instance's
public attributes, so the optimizer looks as it did to everything that reads them
(``state_dict()``, LR schedulers, torch's own tests). ``torch.optim`` does the same kind of
thing: it wraps each class's ``step`` once, for its hooks and the profiler.

The options the optimizer was compiled with live on the instance (``_optcompile_options``);
its Compiled (entries, statistics) lives in a registry and is built on first use. A
``copy.deepcopy``, ``copy.copy`` or ``pickle`` of a compiled optimizer is rebuilt as a
compiled optimizer of the same class with the same options (``__reduce_ex__``): its first
step traces its own entries.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from optguard import Locals, native
from optkernels import Backend
from opttrace import TracedStep, closure_reason, eager_step, trace_step

from optcompile import backward, compressed_state, logs
from optcompile._torch_compat import (
    has_step_hooks,
    profiler_enabled,
    step_post_hooks,
    step_pre_hooks,
    unhooked_step,
)
from optcompile.driver import Compiled
from optcompile.errors import CompileError
from optcompile.options import Options

OPTIONS_ATTR = "_optcompile_options"

_OPTIMIZERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Compiled] = (
    weakref.WeakKeyDictionary()
)
_CLASSES: dict[type, type] = {}  # optimizer class -> its compiled subclass
_REGISTERING = threading.RLock()


def compile_optimizer(opt: torch.optim.Optimizer, options: Options) -> torch.optim.Optimizer:
    """Make ``opt`` a compiled optimizer (in place) with ``options``; see the module."""
    old = opt.__dict__.get(OPTIONS_ATTR)
    if options.in_backward:
        backward.refuse_unsupported(type(opt).__dict__.get("_optcompile_base", type(opt)))
    if isinstance(old, Options) and is_compiled(opt):
        if options.differences(old):
            _recompile(opt, old, options)
            _in_backward(opt, options)
        return opt
    base = type(opt)
    reason = closure_reason(base)
    if reason is not None and options.fullgraph:
        raise CompileError(f"fullgraph=True: {reason}")
    options.backend_for(opt)  # a backend that cannot run here is refused now, not at step()
    opt.__class__ = compiled_class(base)
    opt.__dict__[OPTIONS_ATTR] = options
    _rewrap_scheduler_step(opt)
    registered(opt)
    _in_backward(opt, options)
    return opt


def _in_backward(opt: torch.optim.Optimizer, options: Options) -> None:
    """Hook the params for ``in_backward=True`` (optcompile.backward), or unhook them."""
    if options.in_backward:
        backward.attach(opt, options)
    else:
        backward.detach(opt)


def is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer made by ``compile_optimizer`` (or copied from one)."""
    return "_optcompile_base" in type(obj).__dict__


def registered(opt: torch.optim.Optimizer) -> Compiled:
    """The Compiled of a compiled optimizer, built on first use (a copy's is built here)."""
    compiled = _OPTIMIZERS.get(opt)
    if compiled is None:
        with _REGISTERING:  # two threads stepping a fresh copy build one Compiled
            compiled = _OPTIMIZERS.get(opt)
            if compiled is None:
                compiled = _OPTIMIZERS[opt] = _build(opt, opt.__dict__[OPTIONS_ATTR])
    return compiled


def _build(opt: torch.optim.Optimizer, options: Options) -> Compiled:
    backend = options.backend_for(opt)
    base: type = type(opt).__dict__["_optcompile_base"]

    def tracer(L: Locals) -> TracedStep:
        return trace_step(L["opt"], capturable=_traces_capturable(backend, L["opt"]))

    def eager(L: Locals) -> Any:
        return eager_step(L["opt"])

    fmt = options.state_format
    if fmt is not None:  # compressed state: traced over full precision, then rewritten
        traced_plain, eager_plain = tracer, eager
        tracer = functools.partial(compressed_state.traced_step, fmt=fmt, trace=traced_plain)
        eager = functools.partial(_eager_compressed, fmt=fmt, run=eager_plain)
    compiled = Compiled(
        f"{base.__name__}.step",
        tracer,
        eager,
        backend,
        options.fullgraph,
        options.recompile_limit,
        pin_inputs=True,
    )
    reason = closure_reason(base)
    if reason is not None:  # LBFGS: its own step (hooks, closure) runs; explain() says why
        compiled.fall_back(reason)
    # (a compile() with other options builds a new Compiled: _recompile)
    compiled.direct = reason is None and not options.in_backward and fmt is None
    # Entries fetch their inputs through Sources and pin only what the optimizer holds anyway
    # (params, state); what they own themselves (plans, graphs) goes with the optimizer: the
    # finalizer releases it even if something still holds `compiled`.
    weakref.finalize(opt, compiled.release)
    return compiled


def _eager_compressed(L: Locals, fmt: str, run: Callable[[Locals], Any]) -> Any:
    return compressed_state.eager_step(L["opt"], fmt, lambda: run(L))


# torch.optim steps whose capturable path rounds otherwise than eager's default one in
# float16 (every torch.optim optimizer with a capturable flag was compared): Adam and AdamW
# divide eps and the denominator by the step size (where eager's denominator underflows to
# 0 and its update is inf or NaN, this one stays finite; past 65504 it overflows where
# eager's update is finite), Adamax and NAdam apply their bias corrections as float16
# tensor ops. RAdam, RMSprop, Adadelta, Rprop and ASGD agree with eager to an ulp.
_FLOAT16_CAPTURABLE_ROUNDS_OTHERWISE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
)


def _traces_capturable(backend: Backend, opt: torch.optim.Optimizer) -> bool:
    """Whether to trace ``opt``'s capturable path: where the backend wants it (its kernels
    keep every value on the device), except for the optimizers above with float16
    parameters in a group with ``capturable=False``: their step traces eager's path, whose
    Python arithmetic on the step counts' ``.item()`` values the host computes as eager
    does (optkernels.numbers), the kernels the rest; so do groups with capturable=False
    and a Tensor hyperparameter in their step-count arithmetic (_tensor_step_arithmetic).
    ``capturable=True`` fuses eager's capturable path, with its results."""
    if not backend.wants_capturable:
        return False
    if _tensor_step_arithmetic(opt) or _eps_by_dtype(opt):
        return False
    return not (
        isinstance(opt, _FLOAT16_CAPTURABLE_ROUNDS_OTHERWISE)
        and any(
            group.get("capturable") is False
            and any(p.dtype is torch.float16 for p in group["params"])
            for group in opt.param_groups
        )
    )


def _eps_by_dtype(opt: torch.optim.Optimizer) -> bool:
    """Whether torch's Adafactor has a group of params in several dtypes with ``eps[0]``
    None: eager's foreach path takes that eps from each dtype's ``finfo`` (its params
    grouped by dtype), the path ``is_compiling()`` shows from the first param's dtype for
    all of them (no grouping there): a bfloat16 param beside a float32 one would clamp at
    float32's eps. Eager's own path is traced instead."""
    base = type(opt).__dict__.get("_optcompile_base", type(opt))
    if base is not getattr(torch.optim, "Adafactor", None):
        return False
    return any(
        group.get("eps", (None,))[0] is None and len({p.dtype for p in group["params"]}) > 1
        for group in opt.param_groups
    )


# The hyperparameters each torch.optim step combines with its step counts (bias corrections,
# step sizes); a class not listed is taken to combine all of _STEP_KEYS with them.
_STEP_KEYS = ("betas", "lr", "momentum_decay", "lr_decay", "lambd", "alpha", "t0")
_STEP_KEYS_OF: dict[type, tuple[str, ...]] = {
    torch.optim.Adam: ("betas", "lr"),
    torch.optim.AdamW: ("betas", "lr"),
    torch.optim.Adamax: ("betas", "lr"),
    torch.optim.RAdam: ("betas", "lr"),
    torch.optim.NAdam: ("betas", "lr", "momentum_decay"),
    torch.optim.Adagrad: ("lr", "lr_decay"),
    torch.optim.SGD: (),  # (no step counts)
    torch.optim.RMSprop: (),  # (its step counts are only counted)
    torch.optim.Adadelta: (),
    torch.optim.Rprop: (),
    # ASGD decides on its step counts in Python (its mu): the kernels take its capturable
    # path whatever its Tensors (opttrace.asgd), where eager's reads them with ``.item()`` and
    # Python's ``max``, which no kernel takes (the torch backend on the CPU traces that)
    torch.optim.ASGD: (),
}


def _tensor_step_arithmetic(opt: torch.optim.Optimizer) -> bool:
    """Whether a group of torch.optim's ``opt`` without ``capturable`` has a 0-dim Tensor
    hyperparameter that its step combines with the step counts (Tensor betas or lr in
    Adam's, NAdam's momentum_decay, Adagrad's lr_decay: ``_STEP_KEYS_OF``). Eager's path
    computes those bias corrections as float32 tensor ops on the CPU (``1 - beta2 ** step``,
    where an ulp of ``beta2 ** 3`` is 2e-5 of the result); the capturable path's graph has
    other ops, which the host computes in double. Eager's own path is traced instead, and
    the host computes its 0-dim ops as ATen does (optkernels.host; ASGD, which decides on
    the step counts in Python, is traced on its capturable path all the same). A Tensor lr
    that meets no step count (SGD's, RMSprop's) keeps the capturable path: eager's reads it
    with ``.item()`` per param, which no kernel takes (its step ran on the torch backend)."""
    base = type(opt).__dict__.get("_optcompile_base", type(opt))
    if not base.__module__.startswith("torch.optim."):
        return False
    keys = next((k for c, k in _STEP_KEYS_OF.items() if issubclass(base, c)), _STEP_KEYS)
    for group in opt.param_groups:
        if group.get("capturable", False):
            continue
        for key in keys:
            value = group.get(key)
            values = value if isinstance(value, tuple | list) else (value,)
            if any(isinstance(v, torch.Tensor) for v in values):
                return True
    return False


def _recompile(opt: torch.optim.Optimizer, old: Options, new: Options) -> None:
    """``compile()`` again with other options: the old entries go, the next step traces."""
    new.backend_for(opt)
    if old.state_format is not None and old.state_format != new.state_format:
        compressed_state.decompress_state(opt, old.state_format)  # the next trace compresses
    previous = _OPTIMIZERS.pop(opt, None)
    opt.__dict__[OPTIONS_ATTR] = new
    compiled = registered(opt)
    dropped = len(previous.cache.entries) if previous is not None else 0
    if previous is not None:
        previous.release()
    logs.recompiles.info(
        "%s: compile() with new options (%s): %d entr%s dropped, the next step traces",
        compiled.name,
        ", ".join(new.differences(old)),
        dropped,
        "y" if dropped == 1 else "ies",
    )


def compiled_class(base: type) -> type:
    """The compiled subclass of optimizer class ``base`` (one per class, named like it)."""
    if "_optcompile_base" in base.__dict__:
        return base
    cls = _CLASSES.get(base)
    if cls is None:
        raw = unhooked_step(base)

        def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
            if torch.compiler.is_compiling():  # (57 ns; a disabled function costs 300 ns)
                return _step_under_dynamo(self, closure)
            compiled = _OPTIMIZERS.get(self)
            # The usual call (no closure, no hook) goes straight to the prologue
            if (
                compiled is not None
                and compiled.direct
                and closure is None
                and not has_step_hooks(self)
            ):
                compiled({"opt": self})
                return None
            return _step(self, closure)

        step.__doc__ = raw.__doc__
        step.__qualname__ = f"{base.__qualname__}.step"
        # torch.optim's mark of a step that runs the hooks itself: torch does not wrap it
        # again (on unpickling), and opttrace finds the step to trace behind it.
        step.hooked = True  # type: ignore[attr-defined]
        step.__wrapped__ = raw  # type: ignore[attr-defined]
        namespace = {
            "step": step,
            "__reduce_ex__": _reduce_ex,
            "state_dict": _state_dict,
            "zero_grad": _zero_grad,
            "load_state_dict": _load_state_dict,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_optcompile_base": base,
            "_optcompile_own_step": closure_reason(base) is not None,
        }
        cls = _CLASSES[base] = type(base.__name__, (base,), namespace)
    return cls


def _step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    """The compiled ``step``: hooks and the closure run eagerly, the update is compiled."""
    compiled = _OPTIMIZERS.get(self)
    if compiled is None:
        compiled = registered(self)
    if self.__dict__[OPTIONS_ATTR].in_backward:  # the update ran in backward
        return backward.step(self, closure)
    if type(self).__dict__["_optcompile_own_step"]:
        base = type(self).__dict__["_optcompile_base"]
        return base.step(self, closure)
    if closure is None and not has_step_hooks(self):  # the usual call: nothing else to run
        compiled({"opt": self})
        _advance_rounding(self)
        return None
    args: tuple[Any, ...] = (self,)
    kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
    for hook in step_pre_hooks(self):
        result = hook(self, args, kwargs)
        if result is not None:
            args, kwargs = result
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    compiled({"opt": self})
    _advance_rounding(self)
    for hook in step_post_hooks(self):
        hook(self, args, kwargs)
    return loss


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """torch.optim's ``zero_grad``; its usual call (``set_to_none``, torch's own method, no
    profiler recording, not under dynamo) as one native pass per param group, ``p.grad =
    None`` for each param without a Python loop: a training loop calls it every iteration,
    and after an in-backward backward (every gradient already None) it is all it does."""
    zero_grad = type(self).__dict__["_optcompile_base"].zero_grad
    if not set_to_none and self.__dict__[OPTIONS_ATTR].in_backward:
        backward.zeros_not_held(self)
    if (
        torch.compiler.is_compiling()  # (first: torch's is dynamo-disabled, a graph break)
        or not set_to_none
        or zero_grad is not _TORCH_ZERO_GRAD
        or profiler_enabled()
        or (module := native.module()) is None
    ):
        zero_grad(self, set_to_none)
        return
    for group in self.param_groups:
        params = group["params"]
        module.clear_grads(params if type(params) is list else list(params))


def _advance_rounding(opt: torch.optim.Optimizer) -> None:
    """The next step draws new rounding bits (``state_dtype=torch.bfloat16``: its graph
    reads the counter as an input)."""
    count = opt.__dict__.get(compressed_state.COUNTER_ATTR)
    if count is not None:
        opt.__dict__[compressed_state.COUNTER_ATTR] = count + 1


# Inside a function torch.compile traces (a training step calling opt.step()), dynamo would
# trace this glue and the plan behind it, op by op, up to its recompile limits: the step is
# compiled already, so dynamo is told to run it as it is (a graph break).
_step_under_dynamo: Callable[..., Any] = torch.compiler.disable(_step)  # type: ignore[no-untyped-call]


def _reduce_ex(self: torch.optim.Optimizer, protocol: Any) -> tuple[Any, ...]:
    """Copies and pickles rebuild a compiled optimizer: same class, same options, its own
    entries (traced on its first step). The state is what the optimizer's class pickles."""
    base = type(self).__dict__["_optcompile_base"]
    return (_rebuild, (base, self.__dict__[OPTIONS_ATTR]), self.__getstate__())


def _state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict()``, compressed state at full precision (loadable into
    an eager optimizer)."""
    base = type(self).__dict__["_optcompile_base"]
    state_dict: dict[str, Any] = base.state_dict(self)
    fmt = options_of(self).state_format
    if fmt is None:
        return state_dict
    return compressed_state.full_precision_state_dict(self, fmt, state_dict)


def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """The optimizer's ``load_state_dict()``, then its state compressed (``state_dtype``)."""
    base = type(self).__dict__["_optcompile_base"]
    base.load_state_dict(self, state_dict)
    fmt = options_of(self).state_format
    if fmt is not None:
        compressed_state.compress_state(self, fmt)


def options_of(opt: torch.optim.Optimizer) -> Options:
    """The options ``opt`` was compiled with (the defaults for an optimizer that was not)."""
    options = opt.__dict__.get(OPTIONS_ATTR)
    return options if isinstance(options, Options) else Options()


def _rebuild(base: type[torch.optim.Optimizer], options: Options) -> torch.optim.Optimizer:
    """An empty compiled optimizer of class ``base``; pickle and copy then set its state."""
    opt = base.__new__(base)
    opt.__class__ = compiled_class(base)
    opt.__dict__[OPTIONS_ATTR] = options
    return opt


def _rewrap_scheduler_step(opt: torch.optim.Optimizer) -> None:
    """An LR scheduler made before ``compile`` wrapped the eager step on the instance: wrap
    the compiled one the same way (it tells the scheduler that the step was called)."""
    step = opt.__dict__.get("step")
    if step is None or not getattr(step, "_wrapped_by_lr_sched", False):
        return
    ref = weakref.ref(opt)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        assert target is not None  # the wrapper lives on the optimizer itself
        target._opt_called = True  # type: ignore[attr-defined]
        return type(target).step(target, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.__dict__["step"] = wrapper
