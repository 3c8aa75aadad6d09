"""The step inside backward: ``compile(opt, in_backward=True)``.

Each parameter gets a post-accumulate-grad hook. The first backward learns the buckets: the
parameters of each param group in the order their gradients arrive, a bucket closed once it
holds ``bucket_bytes`` of gradients (or every parameter of its group has arrived). A bucket
never mixes param groups: its update is then one lane program (one Triton part, one C
chain), where groups with other options (AdamW's weight decay 0 for biases) would make it
two, or none on the CPU (their op sequences differ: batched torch ops). Later backwards run
a bucket's update as soon as all of its gradients are there. A bucket's update is the
optimizer's own step over a *view*: an optimizer of the same class whose param groups hold
only the bucket's params (the group's other entries copied from the live group before each
update, so LR schedules apply) and whose state holds the very per-param state dicts of the
optimizer (both compared by identity with what the view held after its last update, and
copied only where they differ; skipped while CPython's version tags of the dicts say none
changed). The view is a compiled optimizer of its own: traced once, guarded, one fused
launch (one CUDA graph where graphs are on). Each gradient is set to None after its update
(all of the bucket's in one native call).

Hooks cost a plain Python call where dynamo is not running (``_torch_compat.autograd_hook``),
and autograd's engine a switch into Python per call: once the buckets are learned (at the
end of the first backward that gave every parameter a gradient), only two kinds of hooks
stay (``thin_out``): the first parameter's in arrival order, which checks that no other
parameter holds a gradient yet (then every gradient seen later in the same backward, the
same graph task, arrived in it), and each bucket's last one, which runs the bucket's update
when that check passed in this backward and all of the bucket's gradients are there. A
bucket whose check fails (a parameter without gradient this time, another order, gradients
kept from before) is left to the end of the backward. Under torch's compiled autograd every
parameter keeps its hook (its graph may run outside a graph task).

With ``send_ahead(opt, True)`` (off by default: measured no faster), the first param's
hook, finding no gradient held, also sends every bucket's host values for its update in this
backward ahead, in one copy (``stage_ahead``, ``optkernels.ahead``): lr and the other scalars
as the groups hold them, the bias corrections of the step counts each update advances. An
update then takes them (its plan checks that its scalars and step counts are what they were)
instead of computing and copying its own inside the busy backward.

The end of a backward (eager autograd: a callback queued on the engine) updates what a
bucket left: a bucket with parameters that got no gradient this time, gradients kept by
``accumulate()``, parameters added since. Under torch's compiled autograd that callback
cannot be queued from a hook, so ``opt.step()`` does it; with every parameter getting a
gradient there is nothing left. ``opt.step()`` runs the step hooks around that and refuses
a closure.

The pieces live next to this module: ``backward_hooks`` (``InBackward``: one optimizer's
hooks, the buckets it learns, their updates over views, the end-of-backward flush),
``backward_buckets`` (a bucket and what its view shares with the optimizer) and
``backward_refusals`` (gradient clipping and GradScaler refused over its params).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from opttrace import closure_reason

from optcompile import _torch_compat
from optcompile.backward_buckets import OPTIONS_ATTR
from optcompile.backward_buckets import Bucket as Bucket
from optcompile.backward_hooks import InBackward as InBackward
from optcompile.backward_hooks import _arrived as _arrived
from optcompile.backward_refusals import _install_refusals
from optcompile.errors import CompileError, warn_user
from optcompile.options import Options

_STATES: weakref.WeakKeyDictionary[torch.optim.Optimizer, InBackward] = weakref.WeakKeyDictionary()


def refuse_unsupported(base: type) -> None:
    """Raise CompileError for an optimizer class whose step cannot run in backward."""
    reason = closure_reason(base)
    if reason is not None:
        raise CompileError(
            f"in_backward=True: {reason}; in backward no closure can run. Compile "
            f"{base.__name__} without in_backward=True"
        )


def attach(opt: torch.optim.Optimizer, options: Options) -> None:
    """Hook ``opt``'s params (``compile(opt, in_backward=True)``)."""
    detach(opt)
    _install_refusals()
    state = _STATES[opt] = InBackward(opt, options)
    weakref.finalize(opt, state.detach)  # params that outlive the optimizer lose its hooks


def detach(opt: torch.optim.Optimizer) -> None:
    """Remove ``opt``'s hooks (compiled again without ``in_backward``)."""
    state = _STATES.pop(opt, None)
    if state is not None:
        state.detach()


def step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> None:
    """``opt.step()`` of an in-backward optimizer: step hooks, and the update of gradients
    the backward left (none when every parameter got one)."""
    if closure is not None:
        raise CompileError(
            f"{type(opt).__name__} was compiled with in_backward=True: it updates each "
            "parameter during backward, as its gradient arrives, so there is no moment at "
            "which a closure could see every gradient before the update. Call "
            "loss.backward() instead of passing a closure to step(), or compile without "
            "in_backward=True"
        )
    state = _STATES.get(opt)
    if state is None:  # a copy (deepcopy, pickle): hook its own params from now on
        attach(opt, opt.__dict__[OPTIONS_ATTR])
        state = _STATES[opt]
    args: tuple[Any, ...] = (opt,)
    kwargs: dict[str, Any] = {}
    for hook in _torch_compat.step_pre_hooks(opt):
        result = hook(opt, args, kwargs)
        if result is not None:
            args, kwargs = result
    with state.lock:
        state.callback_queued = False  # (a backward that raised never ran its callback)
        if not state.accumulating:
            state.flush()
    for hook in _torch_compat.step_post_hooks(opt):
        hook(opt, args, kwargs)


def zeros_not_held(opt: torch.optim.Optimizer) -> None:
    """``opt.zero_grad(set_to_none=False)``: say once that no zero gradient is held (each
    update inside backward set its gradients to None), so a parameter that gets no gradient
    in a later backward is skipped where eager would step it with its zero gradient."""
    state = _STATES.get(opt)
    if state is None or state.warned_zeros:
        return
    state.warned_zeros = True
    warn_user(
        f"optcompile: {type(opt).__name__}.zero_grad(set_to_none=False) on an optimizer "
        "compiled with in_backward=True: each update inside backward sets its gradients to "
        "None, so no zero gradient is held, and a parameter that gets no gradient in a later "
        "backward (frozen, unused) is skipped, where eager would step it with its held zero "
        "gradient (weight decay, momentum, step count). Call zero_grad() (set_to_none=True), "
        "or compile without in_backward=True to keep eager's zero gradients",
        UserWarning,
    )


@contextlib.contextmanager
def accumulate(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Backward passes inside the block accumulate gradients without updating ``opt``'s
    parameters; the first backward after it updates with the accumulated gradients::

        for micro_batch in batches[:-1]:
            with optcompile.accumulate(opt):
                model(micro_batch).sum().backward()
        model(batches[-1]).sum().backward()  # updates, frees the gradients
    """
    state = _state_of(opt, "optcompile.accumulate")
    with state.lock:
        state.accumulating += 1
    try:
        yield
    finally:
        with state.lock:
            state.accumulating -= 1


def replay_in_hooks(opt: torch.optim.Optimizer, enabled: bool) -> None:
    """Whether a bucket whose update is its CUDA graph's replay is updated from its
    trigger's hook in C++ (``backward_direct``; on by default). Off, every update runs in
    Python (what tests of that path and comparisons ask for)."""
    state = _state_of(opt, "replay_in_hooks")
    with state.lock:
        state.directs.enabled = enabled
        if not enabled:
            state.directs.uninstall(state.buckets)
            for bucket in state.buckets:
                bucket.direct_reason = "replay_in_hooks(opt, False)"


def send_ahead(opt: torch.optim.Optimizer, enabled: bool) -> None:
    """Whether a backward's first hook sends every bucket's host values ahead (off by
    default: each update computes and sends its own; on, GPT-2's iterations on an H200 were
    no faster, the one stage costing what the updates saved). Buckets replayed from their
    hooks (``replay_in_hooks``) get theirs sent there either way."""
    _state_of(opt, "send_ahead").ahead_enabled = enabled


def _state_of(opt: torch.optim.Optimizer, what: str) -> InBackward:
    """The in-backward state of ``opt``; a CompileError naming ``what`` if it has none."""
    state = _STATES.get(opt)
    if state is None:
        raise CompileError(
            f"{what} takes an optimizer compiled with in_backward=True; "
            f"{type(opt).__name__} is not (optcompile.compile(opt, in_backward=True))"
        )
    return state


def buckets(opt: torch.optim.Optimizer) -> list[tuple[list[torch.Tensor], Any]]:
    """Each learned bucket of an in-backward optimizer: its params and its view's Compiled
    (None before its first update), for explain() and tests."""
    from optcompile.optimizer import registered

    state = _STATES.get(opt)
    if state is None:
        return []
    return [
        (list(b.params), registered(b.view) if b.view is not None else None) for b in state.buckets
    ]


def direct_status(opt: torch.optim.Optimizer) -> list[str]:
    """Per learned bucket, whether its update is replayed natively from its trigger's hook
    (``backward_direct``): its replays and fallbacks, or why it runs in Python."""
    from optcompile.backward_direct import Directs

    state = _STATES.get(opt)
    if state is None:
        return []
    state.directs.fold(state.buckets)
    lines = []
    for b in state.buckets:
        replays, fallbacks, micros = Directs.stats(b)
        if b.direct_reason is None or replays:
            line = f"replayed from its hook without Python: {replays} time(s)"
            if replays:
                line += f" ({micros / replays:.1f} µs each in its hook, checks included)"
            if fallbacks:
                line += "; left to Python: " + "; ".join(
                    f"{n}x {why}" for why, n in fallbacks.items()
                )
            if b.direct_reason is not None:
                line += f"; not armed now: {b.direct_reason}"
        else:
            line = f"updated in Python: {b.direct_reason}"
        lines.append(line)
    return lines
