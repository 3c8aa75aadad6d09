"""Bucket updates replayed by autograd's engine itself, without entering Python.

Inside a busy backward each bucket update that runs in Python costs ~170 µs of host time
on an H200 host (its objects, the interpreter's and the driver's code are out of the core's
caches after autograd's work since the last hook), against ~30 µs alone. For a bucket
whose update is one CUDA graph's replay and nothing else, that is almost all checks: this
module arms optguard's native *direct update* (``_native.cpp``) so that the next backward
replays the graph from the trigger param's hook in C++.

Armed after an update that ran in Python (its prologue checked every guard, its plan
prepared every buffer) when:

- the update is the graph's replay alone: a recorded CUDA graph, no ops beside it, no value
  the host computes per call (``replays_alone`` of the plan: no step count on the CPU, no
  0-dim CPU tensor read), no side effect to replay after it;
- everything its guards and inputs reach is rooted in the view (``L['opt']``): dicts (their
  version tags), lists (their items), tensors (pointers and metadata) and other objects'
  ``__dict__``; what the view syncs from the optimizer (its param groups, its state) too.
  Gradients are checked apart: each of the bucket's params must hold one with the metadata
  and data pointer of that update (the graph's address tables hold those pointers);
- the trigger param carries no post-accumulate-grad hook but ours, and the backward's first
  hook found no gradient held (the gate: ``InBackward.arrived_thin``).

The native hook wraps the trigger's Python hooks: any check that fails (an LR scheduler's new
lr, a state loaded, a gradient at a new address, the graph re-recorded) lets the Python hook
run the update as before, which arms the bucket again. Replays are counted natively and
folded into the graph's counters at the end of the backward (``fold``). Under torch's
compiled autograd the wrapper hands its hooks over unwrapped (nothing native runs).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from optguard import GuardSet, compile_check, compile_fetch, native
from optguard.guard import guard_sources
from optguard.sources import AttrSource, AutocastSource, ItemSource, KeyedSource, LocalSource
from optsidefx.ledger import Const, Return, TensorWrite

from optcompile import _torch_compat

if TYPE_CHECKING:
    from optcompile.backward_buckets import Bucket
    from optcompile.backward_hooks import InBackward

# Why the native hook left an update to Python, by the index _native.cpp counts it under
FALLBACKS = (
    "not armed",
    "another backward (its first hook found a gradient held)",
    "autocast state",
    "an object the update reads changed",
    "a param or state tensor changed",
    "a gradient missing or at another address",
    "device context or stream",
    "graph launch failed",
    "host values not sent for this backward (its step counts changed since)",
)

# Arming costs a walk of what the update reads: a bucket whose hook fell back to Python after
# this many armings in a row (its gradients move every backward, a hook changes its lr) is
# not armed again
MAX_MISSES = 4

# Values the walk needs no snapshot of (their containers' tags cover them)
_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None), tuple, torch.dtype, torch.device)


class NotDirect(Exception):
    """Why a bucket's update is not replayed natively (its message)."""


def _module() -> Any:
    found = native.module()
    return found if found is not None and hasattr(found, "direct_arm") else None


class Directs:
    """One in-backward optimizer's direct updates: its gate and each armed bucket's hook."""

    def __init__(self) -> None:
        self.gate: Any = None
        self.enabled = True  # (backward.replay_in_hooks)

    def open(self, task: int) -> None:
        """The backward's first hook: ``task`` found no gradient held (-1: it did)."""
        if self.gate is not None:
            _module().gate_open(self.gate, task)

    def arm(self, inb: InBackward, bucket: Bucket) -> None:
        """After ``bucket``'s update ran in Python, its grads still held: arm its direct
        update, or say why not (``bucket.direct_reason``)."""
        try:
            self._arm(inb, bucket)
            bucket.direct_reason = None
        except NotDirect as exc:
            bucket.direct_reason = str(exc)
            if bucket.direct is not None:
                module = _module()
                module.direct_disarm(bucket.direct)
                if bucket.direct_misses >= MAX_MISSES and bucket.direct_on is not None:
                    module.direct_uninstall(bucket.direct, bucket.direct_on)  # (for good)
                    bucket.direct_on = None

    def _arm(self, inb: InBackward, bucket: Bucket) -> None:
        module = _module()
        if module is None:
            raise NotDirect(f"optguard's native module is not loaded ({native.status()})")
        if not self.enabled:
            raise NotDirect("replay_in_hooks(opt, False)")
        if bucket.direct is not None:  # (armed before: did its hook replay since?)
            replays, fallbacks, _ = module.direct_stats(bucket.direct)
            missed = replays == bucket.direct_armed_at
            bucket.direct_misses = bucket.direct_misses + 1 if missed else 0
            bucket.direct_armed_at = replays
            if bucket.direct_misses >= MAX_MISSES:
                why = max(range(1, len(fallbacks)), key=fallbacks.__getitem__)  # (armed ones)
                raise NotDirect(
                    f"armed {MAX_MISSES} times in a row without a replay (most often: "
                    f"{FALLBACKS[why]}); left to Python for good"
                )
        if not inb.thin or inb.compiled_autograd:
            raise NotDirect("the hooks are not thinned out (buckets learning, compiled autograd)")
        trigger = bucket.params[-1]
        device = trigger.device
        if device.type != "cuda":
            raise NotDirect(f"its params live on {device}")
        if trigger is inb.first:
            raise NotDirect("its last parameter is the backward's first (its hook checks it)")
        entry = getattr(bucket.step, "last", None)
        graphed = getattr(getattr(entry, "plan", None), "graphed", None)
        node = getattr(graphed, "node", None)
        if entry is None or graphed is None or node is None or graphed.fallback_reason:
            raise NotDirect("its update is not a recorded CUDA graph")
        plan = entry.plan.plan
        alone = getattr(plan, "replays_alone", None)
        ahead = getattr(plan, "replays_with_ahead", None)
        if alone is not None and alone():
            needs_pending = False
        elif ahead is not None and ahead():
            needs_pending = True  # (its host values sent at each backward's first hook)
        else:
            raise NotDirect(
                "its plan does more than the graph's replay and host values sent ahead "
                "each call (ops beside the graph, 0-dim CPU tensors read on the device)"
            )
        if not all(_no_effect(e) for e in entry.replay.effects):
            raise NotDirect("its step has side effects to replay after the graph")
        exec_ = _torch_compat.graph_exec(node.graph)
        if exec_ is None:
            raise NotDirect("this torch does not expose a CUDA graph's executable")
        hooks = getattr(trigger, "_post_accumulate_grad_hooks", None)
        if not isinstance(hooks, dict) or len(hooks) != 1:  # (an OrderedDict)
            raise NotDirect("its last parameter has other post-accumulate-grad hooks")
        opt = inb.ref()
        if opt is None:
            raise NotDirect("the optimizer is gone")
        dicts, lists, tensors = _reached(entry, bucket.L)
        live_groups, live_state = opt.param_groups, opt.state
        dicts += [live_groups[s.index] for s in bucket.groups]
        dicts.append(live_state)
        lists.append(live_groups)
        attrs = [
            (bucket.step, "last", entry),
            (graphed, "node", node),
            (graphed, "fallback_reason", None),
            (opt, "param_groups", live_groups),
            (opt, "state", live_state),
        ]
        stream = torch.cuda.current_stream(device)
        held = module.held(tensors, [t.data_ptr() for t in tensors])
        if bucket.direct is None:
            if self.gate is None:
                self.gate = module.direct_gate()
            bucket.direct = module.direct_new(self.gate)
        armed = module.direct_arm(
            bucket.direct,
            dicts,
            lists,
            attrs,
            hooks,
            held,
            list(bucket.params),
            exec_,
            device.index,
            stream.stream_id,
            stream.cuda_stream,
            needs_pending,
        )
        if not armed:
            raise NotDirect("a gradient of the bucket is missing or not a plain tensor's")
        if not module.direct_install(bucket.direct, trigger):
            raise NotDirect("its last parameter's hooks could not be wrapped")
        bucket.direct_on = trigger
        if bucket.direct_numbers is None or bucket.direct_numbers.entry is not entry:
            bucket.direct_numbers = _numbers(entry)

    def refresh(self, inb: InBackward, version: Callable[[Any], object], task: int) -> None:
        """The backward ``task``'s first hook, finding no gradient held: an armed bucket
        whose param groups changed since (an LR scheduler's new lr, momentum) is synced,
        the guards on its groups are tested again, and where they hold its plan's scalars
        are sent anew and the groups' new tags armed, so that its hook still replays.
        Anything else changed (a guard fails, the plan's buffers moved) leaves the update
        to Python. A bucket whose plan computes host values from its CPU step counts gets
        them computed and sent now, for every such bucket in one copy
        (``optkernels.ahead``), and its hook the step counts' new values to write."""
        opt = inb.ref()
        module = _module()
        if opt is None or module is None:
            return
        live_groups = opt.param_groups
        calls: list[tuple[Any, list[Any]]] = []
        staged: list[Bucket] = []
        for bucket in inb.buckets:
            numbers = bucket.direct_numbers
            if bucket.direct is None or bucket.direct_reason is not None or numbers is None:
                continue
            synced = [
                (i, s)
                for i, s in enumerate(bucket.groups)
                if version(live_groups[s.index]) != s.live_tag
            ]
            if numbers.ahead_fetch is not None:
                staged.append(bucket)
            if not synced:
                if numbers.ahead_fetch is not None:
                    calls.append((numbers.plan, numbers.inputs(bucket.L, ahead=True)))
                continue
            try:
                checks = []
                for i, s in synced:
                    live, own = live_groups[s.index], s.own
                    if live.keys() != own.keys():
                        checks += [c for (j, _), c in numbers.checks.items() if j == i]
                    else:  # (the entries set anew: a schedule's lr, betas)
                        found = numbers.checks
                        changed = [k for k, v in live.items() if k != "params" and own[k] is not v]
                        checks += [found[i, k] for k in changed if (i, k) in found]
                    s.pull(live)
                L = bucket.L
                if not all(check(L) for check in checks):
                    raise NotDirect("a guard on its param group fails (the update retraces)")
                plan = numbers.plan
                moved = plan.buffers_version
                plan.restage_scalars(numbers.inputs(L))
                if plan.buffers_version != moved:
                    raise NotDirect("its plan's buffers moved")
                if numbers.ahead_fetch is not None:
                    calls.append((plan, numbers.inputs(L, ahead=True)))
            except NotDirect as exc:
                bucket.direct_reason = str(exc)
                module.direct_disarm(bucket.direct)
                continue
            except Exception as exc:  # (the Python update raises it, if it still does)
                bucket.direct_reason = f"its param group's numbers failed: {exc}"
                module.direct_disarm(bucket.direct)
                continue
            synced_dicts = [live_groups[s.index] for _, s in synced] + [s.own for _, s in synced]
            module.direct_retag(bucket.direct, synced_dicts)
        if not calls:
            return
        try:
            inb.ahead.stage(calls)
        except Exception:  # (each update computes its own: it raises what it still raises)
            return
        for bucket in staged:
            if bucket.direct_reason is not None:
                continue
            columns = bucket.direct_numbers.plan.ahead_columns()
            if columns is not None:
                bucket.direct_columns = [c for c, _, _ in columns]  # (alive while pending)
                pending = [(c.data_ptr(), old, new) for c, old, new in columns]
                module.direct_pending(bucket.direct, task, pending)

    def uninstall(self, buckets: Sequence[Bucket]) -> None:
        """Unwrap every armed bucket's trigger hooks (the hooks change, compiled autograd)."""
        self.fold(buckets)
        module = _module()
        for bucket in buckets:
            if bucket.direct is not None and module is not None:
                module.direct_disarm(bucket.direct)
                if bucket.direct_on is not None:
                    module.direct_uninstall(bucket.direct, bucket.direct_on)
            bucket.direct_on = None

    def fold(self, buckets: Sequence[Bucket]) -> None:
        """Add the replays the native hooks made since the last fold to the graphs' counts
        (what explain() and the graph's status show; folded when asked, not per backward).
        A host-mode plan keeps the values it was sent ahead: its next ``prepare`` takes them
        only if the step-count columns still hold what they were computed from, which a
        replay advanced."""
        module = _module()
        if module is None:
            return
        for bucket in buckets:
            if bucket.direct is None:
                continue
            replays = module.direct_stats(bucket.direct)[0]
            new = replays - bucket.direct_folded
            if new:
                bucket.direct_folded = replays
                entry = getattr(bucket.step, "last", None)
                graphed = getattr(getattr(entry, "plan", None), "graphed", None)
                if graphed is not None:
                    graphed.replays += new
                    graphed.manager.replays += new
                    if graphed.node is not None:
                        graphed.node.replays += new

    @staticmethod
    def stats(bucket: Bucket) -> tuple[int, dict[str, int], float]:
        """The bucket's native replays, fallbacks by reason and microseconds its hook spent
        in C++ (none: (0, {}, 0.0))."""
        module = _module()
        if module is None or bucket.direct is None:
            return 0, {}, 0.0
        replays, fallbacks, nanos = module.direct_stats(bucket.direct)
        return replays, {FALLBACKS[i]: n for i, n in enumerate(fallbacks) if n}, nanos / 1e3


@dataclasses.dataclass
class Numbers:
    """What a bucket's first hook needs to send its changed param-group numbers (see
    ``Directs.refresh``): the entry, its plan, the guards on the view's param groups and
    their entries but 'params' (one generated check per group index and entry key; None:
    on the group itself), the plan's scalar inputs' positions and their fetch."""

    entry: Any
    plan: Any
    checks: dict[tuple[int, str | None], Any]  # (CompiledCheck: check(L) -> bool)
    positions: list[int]
    fetch: Callable[[dict[str, Any]], list[Any]]
    # A plan with host values (step counts on the CPU): the inputs its stage_ahead reads
    ahead_positions: list[int] = dataclasses.field(default_factory=list)
    ahead_fetch: Callable[[dict[str, Any]], list[Any]] | None = None

    def inputs(self, L: dict[str, Any], ahead: bool = False) -> list[Any]:
        positions = self.ahead_positions if ahead else self.positions
        fetch = self.ahead_fetch if ahead else self.fetch
        assert fetch is not None
        inputs: list[Any] = [None] * (max(positions, default=-1) + 1)
        for position, value in zip(positions, fetch(L), strict=True):
            inputs[position] = value
        return inputs


def _numbers(entry: Any) -> Numbers:
    plan = entry.plan.plan
    guards = entry.traced.guards.guards
    by_key: dict[tuple[int, str | None], list[Any]] = {}
    for guard, sources in zip(guards, guard_sources(guards), strict=True):
        for key in {_group_key(s) for s in sources} - {None}:
            assert key is not None
            by_key.setdefault(key, []).append(guard)
    checks = {key: compile_check(GuardSet(tuple(found))) for key, found in by_key.items()}
    positions = plan.scalar_positions()
    scalars = [entry.traced.input_sources[i] for i in positions]
    fetch = compile_fetch(scalars, "direct")[0] if scalars else _nothing
    numbers = Numbers(entry, plan, checks, positions, fetch)
    ahead = plan.ahead_inputs() if plan.replays_with_ahead() else None
    if ahead is not None:
        numbers.ahead_positions = ahead
        read = [entry.traced.input_sources[i] for i in ahead]
        numbers.ahead_fetch = compile_fetch(read, "direct_ahead")[0] if read else _nothing
    return numbers


def _nothing(L: dict[str, Any]) -> list[Any]:
    return []


def _group_key(source: Any) -> tuple[int, str | None] | None:
    """(i, key) for a source under entry ``key`` of the view's param group i (but
    'params'), (i, None) for the group itself (``L['opt'].param_groups[i]``), else None."""
    key: Any = None
    while isinstance(source, AttrSource | ItemSource):
        base = source.base
        if (
            isinstance(source, ItemSource)
            and isinstance(base, AttrSource)
            and base.attr == "param_groups"
            and isinstance(base.base, LocalSource)
            and isinstance(source.key, int)
        ):
            return None if key == "params" else (source.key, key)
        key = source.key if isinstance(source, ItemSource) else None
        source = base
    return None


def _no_effect(effect: Any) -> bool:
    """Whether a ledger effect is done by the graph itself (an in-place write of an input)
    or is the step's ``return None``."""
    if isinstance(effect, TensorWrite):
        return True
    value = effect.value if isinstance(effect, Return) else None
    return isinstance(value, Const) and value.value is None


def _reached(entry: Any, L: dict[str, Any]) -> tuple[list[Any], list[Any], list[torch.Tensor]]:
    """The dicts, lists and tensors (not grads) on the paths of the entry's guards and
    inputs from ``L``; an object of another type contributes its ``__dict__``."""
    sources = list(entry.traced.input_sources)
    for on_guard in guard_sources(entry.traced.guards.guards):
        sources.extend(on_guard)
    seen: set[int] = set()
    dicts: list[Any] = []
    lists: list[Any] = []
    tensors: list[torch.Tensor] = []
    visited: set[Any] = set()
    stack = list(sources)
    while stack:
        source = stack.pop()
        if source in visited:
            continue
        visited.add(source)
        if isinstance(source, AutocastSource):
            continue  # (the native hook compares the autocast state)
        if isinstance(source, AttrSource):
            stack.append(source.base)
            if source.attr == "grad":
                continue  # gradients are checked apart
            owner = source.base.fetch(L)
            own = getattr(owner, "__dict__", None)
            if isinstance(owner, torch.Tensor) and isinstance(own, dict):
                dicts.append(own)  # (an attribute set on a param: ``p.lr_scale``)
            elif not isinstance(own, dict) or source.attr not in own:
                raise NotDirect(
                    f"its step reads {source.name()} from a class, whose dict has no version tag"
                )
        elif isinstance(source, ItemSource):
            stack.append(source.base)
        elif isinstance(source, KeyedSource):
            stack.extend((source.base, source.key))
        elif not isinstance(source, LocalSource):
            raise NotDirect(f"its step reads {source.name()}, outside the optimizer")
        value = source.fetch(L)
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):  # (the optimizer's state is a defaultdict)
            dicts.append(value)
        elif isinstance(value, list):
            lists.append(value)
        elif isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_sparse:
                raise NotDirect(f"{source.name()} is a {type(value).__name__}")
            tensors.append(value)
        elif isinstance(value, (*_IMMUTABLE, types.FunctionType)):
            continue
        else:
            found = getattr(value, "__dict__", None)
            if type(found) is not dict:
                raise NotDirect(f"{source.name()} ({type(value).__name__}) has no __dict__")
            dicts.append(found)
    return dicts, lists, tensors
