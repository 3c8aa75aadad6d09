"""One in-backward optimizer's hooks, buckets and views (``InBackward``): the hooks that
learn the buckets and thin out, the bucket updates over views synced with the optimizer,
the host values sent ahead, the end-of-backward flush. "The module" in the docstrings
below is the design in ``optcompile.backward``'s docstring. optguard's native functions
that the hooks and updates call (``_hook_count``, ``_clear_grads``, ``_dict_version``) are
module globals here, set once that module is loaded: a test replaces them here.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection
from operator import is_
from typing import Any

import torch
from optguard import compile_fetch, native
from optkernels.ahead import Ahead

from optcompile import _torch_compat
from optcompile.backward_buckets import _HOOK_DICTS, _NOT_SHARED, Bucket
from optcompile.backward_direct import Directs
from optcompile.backward_refusals import _OWNED
from optcompile.options import Options


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
        # Off unless ``send_ahead(opt, True)``: inside GPT-2's backward on an H200 host the
        # one stage at the first hook (~400 µs for 4 buckets) cost what the updates saved
        # (iterations alternated in one process: 0.1 and 0.8 ms slower with it).
        self.ahead_enabled = False
        self.warned_zeros = False  # (backward.zeros_not_held)
        # Buckets replayed from their trigger's hook natively (optcompile.backward_direct)
        self.directs = Directs()
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
        self.directs.uninstall(self.buckets)
        for p in self.params:
            if id(p) not in self.handles:
                self.handles[id(p)] = p.register_post_accumulate_grad_hook(self.hook)  # type: ignore[no-untyped-call]
        self.thin, self.first, self.others, self.trigger_of = False, None, [], {}

    def detach(self) -> None:
        """Remove the hooks and the ownership marks (also when the optimizer is gone)."""
        self.directs.uninstall(self.buckets)
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
            clean = task >= 0 and _hook_count(self.others) == 0
            self.clean_task = task if clean else None
            if clean:
                self.directs.refresh(self, _dict_version, task)
            self.directs.open(task if clean else -1)
            if clean and self.ahead_enabled:
                self.stage_ahead()
        bucket = self.trigger_of.get(id(p))
        if bucket is None or self.clean_task != task:
            return
        if _hook_count(bucket.params) == len(bucket.params):  # all there
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
            numbers = bucket.direct_numbers
            if bucket.direct_reason is None and numbers is not None and numbers.ahead_fetch:
                continue  # (its direct update's values: sent by directs.refresh)
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
        for synced in bucket.groups:  # what the step wrote into its group
            if version(synced.own) != synced.own_tag:
                synced.push(live_groups[synced.index])
        if self.thin and params[0].is_cuda:
            self.directs.arm(self, bucket)  # (before the grads it records are cleared)
        elif self.thin:
            bucket.direct_reason = "its params are not on a CUDA device (no CUDA graph)"
        _clear_grads(params)

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
    """Whether none of ``params`` holds a gradient: counted as the hooks count (``_hook_count``,
    one C loop once optguard's native module is loaded); attribute reads where dynamo traces
    this (an ``opt.step()`` inside a ``torch.compile``d function), which the native call
    would break."""
    count = _count_grads if torch.compiler.is_compiling() else _hook_count
    return count(params) == 0


def _count_grads(params: list[torch.Tensor]) -> int:
    return sum(p.grad is not None for p in params)


def _set_grads_to_none(params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def _no_version(d: dict[Any, Any]) -> object:
    """Where no version tag can be read: a value that equals no other (always synced)."""
    return object()


_UNKNOWN = (None, None)  # a Bucket's tags before its first update (equal to no tag)
# optguard's native functions that a hook and a bucket update call, set once that module is
# loaded: the params holding a grad counted (by a thin hook, which dynamo never traces: see
# _none_held; counted in C++, no Python object is made for a grad autograd made) and each
# param's grad set to None in one C++ loop, a dict's version tag (_no_version until then, and where
# CPython has no tags, 3.14 on: groups are then compared value by value on each update,
# the state synced by lookups).
_hook_count: Callable[[list[torch.Tensor]], int] = _count_grads
_clear_grads: Callable[[list[torch.Tensor]], None] = _set_grads_to_none
_dict_version: Callable[[dict[Any, Any]], object] = _no_version


def _use_native(module: Any) -> None:
    global _hook_count, _clear_grads, _dict_version
    _hook_count, _clear_grads = module.count_grads, module.clear_grads
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
