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

The first param's hook, finding no gradient held, also sends every bucket's host values
for its update in this backward ahead, in one copy (``stage_ahead``, ``optkernels.ahead``): lr
and the other scalars as the groups hold them, the bias corrections of the step counts each
update advances. An update then takes them (its plan checks that its scalars and step counts
are what they were) instead of computing and copying its own inside the busy backward.

The end of a backward (eager autograd: a callback queued on the engine) updates what a
bucket left: a bucket with parameters that got no gradient this time, gradients kept by
``accumulate()``, parameters added since. Under torch's compiled autograd that callback
cannot be queued from a hook, so ``opt.step()`` does it; with every parameter getting a
gradient there is nothing left. ``opt.step()`` runs the step hooks around that and refuses
a closure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection, Iterator
from itertools import repeat
from operator import is_
from typing import Any

import torch
from optguard import compile_fetch, native
from optkernels.ahead import Ahead
from opttrace import closure_reason

from optcompile import _torch_compat
from optcompile.errors import CompileError
from optcompile.options import Options

OPTIONS_ATTR = "_optcompile_options"
# What a bucket's view does not share with the optimizer: its own groups, state and no hooks
# (they run once, in opt.step()); "step" is an LR scheduler's wrapper of the instance.
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_NOT_SHARED = frozenset(("param_groups", "state", "step", OPTIONS_ATTR, *_HOOK_DICTS))

# id(param) -> (the param, the name of the in-backward optimizer that owns it), for the
# refusals below; weak, and an id reused by another tensor is told apart by identity.
_OWNED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def _owner(p: torch.Tensor) -> str | None:
    entry = _OWNED.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters whose update runs as one compiled step, and the view that runs it."""

    params: list[torch.Tensor]
    view: torch.optim.Optimizer | None = None
    step: Callable[[dict[str, Any]], Any] | None = None  # the view's Compiled
    L: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"opt": view}
    groups: list[Synced] = dataclasses.field(default_factory=list)
    entries: list[Any] = dataclasses.field(default_factory=list)  # the view's state, by param
    # CPython's version tags of the optimizer's and the view's state dicts after the last
    # update, where optguard's native module reads them (see update); _UNKNOWN: not known
    tags: tuple[Any, Any] = (None, None)
    arrived: int = 0  # gradients arrived in this backward
    # For sending its next update's host values ahead (InBackward.stage_ahead): the entry
    # it was found for, that entry's plan and the positions and fetch of the inputs it reads
    # (None: its plan sends nothing ahead)
    ahead: (
        tuple[Any, tuple[Any, list[int], Callable[[dict[str, Any]], list[Any]]] | None] | None
    ) = None


@dataclasses.dataclass(eq=False)
class Synced:
    """A view's param group (``own``: the bucket's params, the other entries those of the
    optimizer's group ``index``) and both groups as last synced: their values (compared by
    identity, in one C-level pass each) and CPython's version tags of both dicts, which an
    update compares first (the same tag: no entry set to another object, added or removed).
    Entries are copied only when one changed (an LR scheduler's new lr, a step that wrote
    into its group)."""

    index: int
    own: dict[str, Any]
    live_seen: tuple[Any, ...] = ()
    own_seen: tuple[Any, ...] = ()
    live_tag: object = None
    own_tag: object = None

    def pull(self, live: dict[str, Any]) -> None:
        """Copy what changed in the optimizer's group into the view's (all of it but the
        params: what did not change is the same objects)."""
        own = self.own
        if not _same(live.values(), self.live_seen):
            params = own["params"]
            own.update(live)
            own["params"] = params
            self.live_seen, self.own_seen = tuple(live.values()), tuple(own.values())
        self.live_tag, self.own_tag = _dict_version(live), _dict_version(own)

    def push(self, live: dict[str, Any]) -> None:
        """Copy what the step wrote into the view's group back into the optimizer's."""
        own = self.own
        if not _same(own.values(), self.own_seen):
            for key, value in own.items():
                if key != "params" and live.get(key, _MISSING) is not value:
                    live[key] = value
            self.live_seen, self.own_seen = tuple(live.values()), tuple(own.values())
        self.live_tag, self.own_tag = _dict_version(live), _dict_version(own)


class InBackward:
    """The hooks, buckets and views of one in-backward optimizer; see the module."""

    def __init__(self, opt: torch.optim.Optimizer, options: Options) -> None:
        self.ref = weakref.ref(opt)
        self.name = f"{type(opt).__name__}.step"
        self.options = dataclasses.replace(options, in_backward=False)
        self.bucket_bytes = options.bucket_bytes
        self.lock = threading.RLock()
        self.accumulating = 0
        self.callback_queued = False
        self.handles: dict[int, Any] = {}  # id(param) -> its hook's handle
        self.hook: Callable[[torch.Tensor], None] | None = None
        self.params: list[torch.Tensor] = []  # those with a hook, when all have one
        self.every: list[torch.Tensor] = []  # every param of every group
        # Thin hooks (see the module): the first param, the others, each bucket's last one.
        self.thin = False
        self.first: torch.Tensor | None = None
        self.others: list[torch.Tensor] = []
        self.trigger_of: dict[int, Bucket] = {}
        self.clean_task: int | None = None  # the backward whose first hook found no grads
        self.compiled_autograd = False  # seen: every param keeps its hook
        self.owned: list[tuple[int, tuple[weakref.ref[torch.Tensor], str]]] = []
        self.key: tuple[Any, ...] = ()
        self.group_of: dict[int, int] = {}  # id(param) -> index of its group
        self.hooked: set[int] = set()  # ids of the params with a hook (those requiring grad)
        self.bucket_of: dict[int, Bucket] = {}
        self.buckets: list[Bucket] = []  # in the order they closed (their updates' order)
        # Learning: each group's bucket being filled, its gradient bytes, the group's params
        # with a hook, those already in a closed bucket; the first param that arrived.
        self.open: dict[int, list[torch.Tensor]] = {}
        self.open_bytes: dict[int, int] = {}
        self.hooked_in: dict[int, int] = {}
        self.closed_in: dict[int, int] = {}
        self.first_arrived: torch.Tensor | None = None
        # Every bucket's next host values sent in one copy at a clean backward's first hook
        self.ahead = Ahead()
        self.ahead_enabled = True
        self.refresh(opt)

    # -- params and hooks --

    def refresh(self, opt: torch.optim.Optimizer) -> None:
        """(Re)hook the params when the param groups changed (``add_param_group``, a params
        list replaced); the buckets are learned again."""
        key = tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups)
        if key == self.key:
            return
        self.detach()
        self.key = key
        ref = weakref.ref(self)
        hook = self.hook = _torch_compat.autograd_hook(functools.partial(_arrived, ref))
        for index, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) in self.group_of:
                    continue
                self.every.append(p)
                self.group_of[id(p)] = index
                if p.requires_grad:
                    self.hooked.add(id(p))
                    self.hooked_in[index] = self.hooked_in.get(index, 0) + 1
                    self.params.append(p)
                    self.handles[id(p)] = p.register_post_accumulate_grad_hook(hook)
                    owned = _OWNED[id(p)] = (weakref.ref(p), self.name)
                    self.owned.append((id(p), owned))

    def thin_out(self) -> None:
        """Keep only the first param's hook and each bucket's last one (see the module),
        once every hooked param is in a bucket."""
        if self.thin or self.compiled_autograd or self.open or not self.buckets:
            return
        if len(self.bucket_of) != len(self.hooked) or len(self.params) != len(self.hooked):
            return
        first = self.first_arrived
        if first is None or id(first) not in self.bucket_of:
            return
        self.trigger_of = {id(b.params[-1]): b for b in self.buckets}
        keep = {id(first), *self.trigger_of}
        for key in [k for k in self.handles if k not in keep]:
            self.handles.pop(key).remove()
        self.first, self.thin = first, True
        self.others = [p for p in self.params if p is not first]

    def thicken(self) -> None:
        """Every hooked param gets its hook back (torch's compiled autograd was seen)."""
        assert self.hook is not None
        for p in self.params:
            if id(p) not in self.handles:
                self.handles[id(p)] = p.register_post_accumulate_grad_hook(self.hook)  # type: ignore[no-untyped-call]
        self.thin, self.first, self.others, self.trigger_of = False, None, [], {}

    def detach(self) -> None:
        """Remove the hooks and the ownership marks (also when the optimizer is gone)."""
        for handle in self.handles.values():
            handle.remove()
        for key, owned in self.owned:
            if _OWNED.get(key) is owned:
                del _OWNED[key]
        self.owned.clear()
        self.handles.clear()
        self.params.clear()
        self.every.clear()
        self.thin, self.first, self.others, self.trigger_of = False, None, [], {}
        self.group_of.clear()
        self.hooked.clear()
        self.bucket_of.clear()
        self.buckets.clear()
        self.open.clear()
        self.open_bytes.clear()
        self.hooked_in.clear()
        self.closed_in.clear()
        self.first_arrived = None
        self.key = ()

    # -- a gradient arrives --

    def arrived(self, p: torch.Tensor) -> None:
        if self.accumulating:
            return
        if not self.callback_queued:
            if _torch_compat.in_compiled_autograd():
                self.compiled_autograd = True  # (thin hooks: step() updates, then thickens)
            else:
                _torch_compat.queue_backward_callback(self.end_of_backward)
                self.callback_queued = True
        if self.thin:
            if not self.compiled_autograd:
                self.arrived_thin(p)
            return
        bucket = self.bucket_of.get(id(p))
        if bucket is not None:
            bucket.arrived += 1
            if bucket.arrived >= len(bucket.params):
                self.update(bucket)
            return
        index = self.group_of.get(id(p))
        if index is None:  # hooked by an older param set: step() rehooks
            return
        if self.first_arrived is None:
            self.first_arrived = p
        bucket = self.place(p, index)
        if bucket is not None:
            self.update(bucket)

    def place(self, p: torch.Tensor, index: int) -> Bucket | None:
        """Learning: ``p`` joins its group's open bucket, which closes (and is returned) once
        it holds ``bucket_bytes`` or the group's last hooked param."""
        open_ = self.open.setdefault(index, [])
        open_.append(p)
        size = self.open_bytes.get(index, 0) + p.numel() * p.element_size()
        self.open_bytes[index] = size
        placed = self.closed_in.get(index, 0) + len(open_)
        if size >= self.bucket_bytes or placed >= self.hooked_in.get(index, 0):
            return self.close(index)
        return None

    def arrived_thin(self, p: torch.Tensor) -> None:
        """A thin hook (see the module): the first param's checks that the backward started
        with no gradient held; a bucket's last param's updates the bucket when that held in
        this backward and all of its gradients are there (else the end of backward does)."""
        task = _torch_compat.graph_task_id()
        if p is self.first:
            clean = task >= 0 and all(map(is_, _hook_grads(self.others), repeat(None)))
            self.clean_task = task if clean else None
            if clean and self.ahead_enabled:
                self.stage_ahead()
        bucket = self.trigger_of.get(id(p))
        if bucket is None or self.clean_task != task:
            return
        if not any(map(is_, _hook_grads(bucket.params), repeat(None))):  # all there
            self.update(bucket)

    def stage_ahead(self) -> None:
        """Compute every bucket's host values for its update in this backward now and send
        them in one copy (``optkernels.ahead``): the updates, each in a hook while autograd
        keeps the device busy, then only replay their graphs. An update whose inputs are
        not what they were here (a bucket left to the end of the backward, its params in
        another entry) computes its own, as without this."""
        opt = self.ref()
        if opt is None:
            return
        live_groups = opt.param_groups
        calls = []
        for bucket in self.buckets:
            found = self.ahead_of(bucket)
            if found is None:
                continue
            plan, positions, fetch = found
            try:
                for synced in bucket.groups:
                    live = live_groups[synced.index]
                    if _dict_version(live) != synced.live_tag:
                        synced.pull(live)
                values = fetch(bucket.L)
            except Exception:  # (the update fetches its inputs itself, and fails or retraces)
                continue
            inputs: list[Any] = [None] * (max(positions, default=-1) + 1)
            for position, value in zip(positions, values, strict=True):
                inputs[position] = value
            calls.append((plan, inputs))
        self.ahead.stage(calls)

    def ahead_of(
        self, bucket: Bucket
    ) -> tuple[Any, list[int], Callable[[dict[str, Any]], list[Any]]] | None:
        """The plan of the entry that ran the bucket's latest update, the positions of the
        inputs its ``stage_ahead`` reads and a fetch of them (None: it sends nothing
        ahead); found once per entry."""
        entry = getattr(bucket.step, "last", None)
        if entry is None:
            return None
        if bucket.ahead is not None and bucket.ahead[0] is entry:
            return bucket.ahead[1]
        plan = getattr(entry.plan, "plan", entry.plan)
        positions = plan.ahead_inputs() if hasattr(plan, "ahead_inputs") else None
        found = None
        if positions is not None:
            sources = [entry.traced.input_sources[i] for i in positions]
            fetch = compile_fetch(sources, "ahead")[0] if sources else _nothing_to_fetch
            found = (plan, positions, fetch)
        bucket.ahead = (entry, found)
        return found

    def close(self, index: int) -> Bucket:
        """Make group ``index``'s params being learned a bucket."""
        bucket = Bucket(self.open.pop(index))
        self.open_bytes.pop(index, None)
        self.closed_in[index] = self.closed_in.get(index, 0) + len(bucket.params)
        self.buckets.append(bucket)
        for p in bucket.params:
            self.bucket_of[id(p)] = bucket
        return bucket

    def end_of_backward(self) -> None:
        with self.lock:
            self.callback_queued = False
            if not self.accumulating:
                self.flush()

    def flush(self) -> None:
        """Update every parameter that still holds a gradient (see the module)."""
        opt = self.ref()
        if opt is None:
            return
        self.clean_task = None
        if self.thin and self.compiled_autograd:
            self.thicken()
        self.refresh(opt)
        if not self.open and _none_held(self.every):  # (the usual case: nothing left)
            for bucket in self.buckets:
                bucket.arrived = 0
            self.thin_out()
            return
        for index in list(self.open):
            self.update(self.close(index))
        for bucket in self.buckets:
            if any(p.grad is not None for p in bucket.params):
                self.update(bucket)
            bucket.arrived = 0
        left = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        left = [p for p in left if id(p) not in self.bucket_of]
        if any(p.requires_grad and id(p) not in self.hooked for p in left):
            self.key = ()  # frozen when hooked, trained now: hooked now, buckets learned again
            self.refresh(opt)
        for p in left:
            if self.first_arrived is None:
                self.first_arrived = p
            self.open.setdefault(self.group_of[id(p)], []).append(p)
        for index in list(self.open):
            self.update(self.close(index))
        self.thin_out()

    # -- a bucket's update --

    def update(self, bucket: Bucket) -> None:
        """Run the bucket's step on its view: the groups and the state synced with the
        optimizer's where they changed, the gradients set to None after it.

        This runs inside backward, in a busy thread several times slower per Python
        operation than the main one: where nothing changed since the last update (the usual
        case) it reads one version tag per group and per state dict, before and after the
        step, and sets the gradients to None in one native call."""
        opt = self.ref()
        if opt is None:
            return
        bucket.arrived = 0
        view = bucket.view if bucket.view is not None else self.make_view(opt, bucket)
        assert bucket.step is not None
        live_groups, version = opt.param_groups, _dict_version
        for synced in bucket.groups:
            live = live_groups[synced.index]
            if version(live) != synced.live_tag:
                synced.pull(live)
        # The view's state holds the optimizer's own per-param entries: synced entry by
        # entry only where one differs from what the view held after its last update. While
        # neither state dict's version tag changed since then (no entry added, replaced or
        # removed: the entries are the very dicts both hold), the sync is skipped: a lookup
        # by tensor costs a Python-level Tensor.__hash__ per param.
        state, own_state, params = opt.state, view.state, bucket.params
        tags, bucket.tags = bucket.tags, _UNKNOWN  # (known again once the step returned)
        same = version(state) == tags[0]
        if not same:
            entries = list(map(state.get, params))
            if not _same(entries, bucket.entries):
                for p, entry in zip(params, entries, strict=True):
                    if entry is None:
                        own_state.pop(p, None)  # cleared (load_state_dict without it)
                    elif own_state.get(p) is not entry:
                        own_state[p] = entry
            bucket.entries = entries
        bucket.step(bucket.L)
        if same and version(own_state) == tags[1]:
            bucket.tags = tags
        else:
            held = list(map(own_state.get, params))
            if not _same(held, bucket.entries):
                for p, entry in zip(params, held, strict=True):
                    if entry is not None and state.get(p) is not entry:
                        state[p] = entry  # (state the step created)
            bucket.entries = held
            bucket.tags = (version(state), version(own_state))
        _clear_grads(params)
        for synced in bucket.groups:  # what the step wrote into its group
            if version(synced.own) != synced.own_tag:
                synced.push(live_groups[synced.index])

    def make_view(self, opt: torch.optim.Optimizer, bucket: Bucket) -> torch.optim.Optimizer:
        """An optimizer of ``opt``'s class over the bucket's params, compiled on its own."""
        from optcompile.optimizer import compile_optimizer, registered

        base: type[torch.optim.Optimizer] = type(opt).__dict__["_optcompile_base"]
        view = base.__new__(base)
        shared = {k: v for k, v in opt.__dict__.items() if k not in _NOT_SHARED}
        view.__dict__.update(shared)
        for name in _HOOK_DICTS:
            view.__dict__[name] = OrderedDict()
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in bucket.params:
            by_group.setdefault(self.group_of[id(p)], []).append(p)
        bucket.groups = [
            Synced(index, {**opt.param_groups[index], "params": params})
            for index, params in sorted(by_group.items())
        ]
        view.param_groups = [synced.own for synced in bucket.groups]
        view.state = defaultdict(dict)
        compile_optimizer(view, self.options)
        number = self.buckets.index(bucket) if bucket in self.buckets else len(self.buckets)
        compiled = registered(view)
        compiled.name = f"{self.name} (bucket {number}: {len(bucket.params)} params)"
        bucket.view, bucket.step, bucket.L = view, compiled, {"opt": view}
        return view


_MISSING = object()


def _nothing_to_fetch(L: dict[str, Any]) -> list[Any]:
    return []


def _none_held(params: list[torch.Tensor]) -> bool:
    """Whether none of ``params`` holds a gradient (compared by identity: ``==`` would call
    ``Tensor.__eq__`` on each gradient held)."""
    return all(map(is_, _grads(params), repeat(None)))


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each param's ``.grad``, read in one C loop (optguard's native ``grads``); attribute
    reads where dynamo traces this (an ``opt.step()`` inside a ``torch.compile``d function),
    which the native call would break."""
    module = None if torch.compiler.is_compiling() else native.module()
    return module.grads(params) if module is not None else [p.grad for p in params]


def _read_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


def _set_grads_to_none(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _no_version(d: dict[Any, Any]) -> object:
    """Where no version tag can be read: a value that equals no other (always synced)."""
    return object()


_UNKNOWN = (None, None)  # a Bucket's tags before its first update (equal to no tag)
# optguard's native functions that a hook and a bucket update call, set once that module is
# loaded: each param's .grad read (by a thin hook, which dynamo never traces: see _grads)
# and set to None in one C++ loop, a dict's version tag (_no_version until then, and where
# CPython has no tags, 3.14 on: groups are then compared value by value on each update,
# the state synced by lookups).
_hook_grads: Callable[[list[torch.Tensor]], list[torch.Tensor | None]] = _read_grads
_clear_grads: Callable[[list[torch.Tensor]], None] = _set_grads_to_none
_dict_version: Callable[[dict[Any, Any]], object] = _no_version


def _use_native(module: Any) -> None:
    global _hook_grads, _clear_grads, _dict_version
    _hook_grads, _clear_grads = module.grads, module.clear_grads
    _dict_version = getattr(module, "dict_version", _no_version)


native.when_loaded(_use_native)


def _same(values: Collection[Any], seen: Collection[Any]) -> bool:
    """Whether ``values`` are the very objects of ``seen``, in order (one C-level pass)."""
    return len(values) == len(seen) and all(map(is_, values, seen))


def _arrived(ref: weakref.ref[InBackward], p: torch.Tensor) -> None:
    """The post-accumulate-grad hook of every parameter of an in-backward optimizer."""
    state = ref()
    if state is not None:
        with state.lock:
            state.arrived(p)


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


@contextlib.contextmanager
def accumulate(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Backward passes inside the block accumulate gradients without updating ``opt``'s
    parameters; the first backward after it updates with the accumulated gradients::

        for micro_batch in batches[:-1]:
            with optcompile.accumulate(opt):
                model(micro_batch).sum().backward()
        model(batches[-1]).sum().backward()  # updates, frees the gradients
    """
    state = _STATES.get(opt)
    if state is None:
        raise CompileError(
            f"optcompile.accumulate takes an optimizer compiled with in_backward=True; "
            f"{type(opt).__name__} is not (optcompile.compile(opt, in_backward=True))"
        )
    with state.lock:
        state.accumulating += 1
    try:
        yield
    finally:
        with state.lock:
            state.accumulating -= 1


def send_ahead(opt: torch.optim.Optimizer, enabled: bool) -> None:
    """Whether a backward's first hook sends every bucket's host values ahead (on by
    default; off: each update computes and sends its own, as a reference in tests and
    benchmarks)."""
    state = _STATES.get(opt)
    if state is None:
        raise CompileError(
            f"send_ahead takes an optimizer compiled with in_backward=True; "
            f"{type(opt).__name__} is not"
        )
    state.ahead_enabled = enabled


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


# -- refusals: what cannot hold when no moment sees every gradient --

_INSTALLED: list[bool] = []


def _install_refusals() -> None:
    if not _INSTALLED:
        _torch_compat.guard_grad_norm_clipping(_refuse_clipping)
        _torch_compat.guard_grad_scaling(_refuse_scaling)
        _INSTALLED.append(True)


def _refuse_clipping(parameters: Any) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    for p in params:
        owner = _owner(p)
        if owner is not None:
            raise CompileError(
                f"clip_grad_norm_ over parameters of {owner}, compiled with "
                "in_backward=True: each gradient is used and freed during backward, as it "
                "arrives, so no moment sees all of them and their norm cannot be taken "
                f"(a param of shape {tuple(p.shape)} has grad {_grad_text(p)}). Clipping "
                "each bucket by its own norm is not the same update. Compile without "
                "in_backward=True to clip by the norm over all gradients"
            )


def _refuse_scaling(scaled: Any) -> None:
    if not _OWNED or not isinstance(scaled, torch.Tensor | list | tuple):
        return  # (an iterator GradScaler returns for other iterables is not consumed here)
    roots = [scaled] if isinstance(scaled, torch.Tensor) else list(scaled)
    p = _owned_leaf(roots)
    if p is not None:
        raise CompileError(
            f"GradScaler.scale: this loss backpropagates into parameters of {_owner(p)}, "
            "compiled with in_backward=True (a param of shape "
            f"{tuple(p.shape)}). Its update runs during backward, before GradScaler could "
            "unscale the gradients or skip a step with inf/NaN gradients. Train without "
            "GradScaler (bf16 autocast needs none) or compile without in_backward=True"
        )


def _owned_leaf(roots: list[Any]) -> torch.Tensor | None:
    """A parameter of an in-backward optimizer that ``roots``' autograd graph reaches."""
    seen: set[Any] = set()
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = _torch_compat.accumulate_grad_variable(node)
        if leaf is not None and _owner(leaf) is not None:
            return leaf
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return None


def _grad_text(p: torch.Tensor) -> str:
    return "None (already applied and freed)" if p.grad is None else "not yet applied"
