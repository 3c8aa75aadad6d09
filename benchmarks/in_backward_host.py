"""Host time of the step inside backward, by part, and whether a part waits for the device.

    python benchmarks/in_backward_host.py [--config gpt2] [--context 128] [--batch 1]
                                          [--iters 30] [--reps 200] [--sweep 1,4,40]
                                          [--profile ROWS] [--cprofile ROWS]

The model and optimizer of benchmarks/in_backward.py (GPT-2 124M, bf16 autocast, AdamW in two
param groups) compiled with ``in_backward=True`` (4 buckets at the default 128 MiB: 3 of the
matrices, 1 of the vectors; 13 mixed ones at 25 MiB before buckets held one group), and
a copy compiled to step after backward. Reported, host microseconds (medians):

- iterations: forward, backward and ``opt.step()`` of both, alternated iteration by
  iteration in one process (a drifting host hits both alike): each phase's host time (no
  synchronization inside) and the whole iteration's wall time (device synchronized); the
  cyclic garbage collector's pauses during them. ``--sweep`` adds in-backward copies with
  other bucket counts: the iteration's time against the count is what one bucket costs;
- inside backward: the in-backward iterations again, each hook timed where autograd calls
  it: the backward's host time, the time spent in hooks (updates included) and in bucket
  updates. Backward minus hooks, against the backward of the after-backward copy, is what
  the hooks cost the engine beyond their own time (thread switches, the GIL);
- Python's own speed inside backward: a fixed piece of pure Python timed in a hook during
  backward and on the main thread between iterations (the hooks and updates ran ~3x
  slower inside backward than alone on the H100 host: is it Python there, or our code?);
- per hook: one call of a bucket's last param's post-accumulate-grad hook that leaves its
  bucket alone, and of its body alone (once the buckets are learned only the first param
  and each bucket's last one keep a hook: 5 of GPT-2's 148 params at 4 buckets);
- per bucket update: the whole update (what the hook of a bucket's last gradient runs), the
  compiled step inside it (prologue, plan, replay) and the plan alone (on CUDA: the host
  preparation, also shown alone, and the graph launch); the rest is the update's own
  bookkeeping;
- on CUDA, which parts wait for the device: each probe queues ~20 ms of device work
  (``torch.cuda._sleep``), then times the part on the host; a part that returns only after
  that work is done synchronizes the host with the device ("WAITS"). Probed: a hook, each
  bucket update (with its parts timed in that call: compiled step, plan, its prepare; the
  plan less its prepare is the graph's launch), each phase of an iteration of both
  optimizers;
- ``--parts`` (``--only-parts``: this alone, after the warm-up): the bucket updates inside
  real backwards, each part timed where it runs, on the host (perf_counter) and on the
  device (CUDA events recorded on the current stream at the same points: the device time
  between them), with every bucket's host values sent ahead at the backward's first hook
  (the default) and without (each update computes and copies its own), iterations
  alternated; a table at the end (medians per update; the stage-ahead per backward);
- ``--profile ROWS``: the in-backward iteration under torch.profiler (CPU and CUDA
  activities): every ``cuda*Synchronize`` call with its count per iteration and the rows with
  the most self CPU time; ``--cprofile ROWS``: cProfile of in-backward iterations.

GPU (from the repository root; under 3 minutes on an H100):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
      python benchmarks/in_backward_host.py --sweep 1,4,40 --profile 25
Only the parts inside backward (about a minute on an H100):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
      python benchmarks/in_backward_host.py --only-parts --iters 30
A CPU run (``--device cpu``: a narrow GPT-2 with the same 148 tensors, buckets of
1/``--buckets`` of its gradient bytes, 4 by default) times the same host-side parts, CPU
kernels in the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optcompile
import torch
from optcompile import backward

sys.path.insert(0, str(Path(__file__).parent))
import in_backward

# GPT-2's 148 tensors at a width the CPU trains in milliseconds (layers, heads, width, vocab,
# context): the same hooks and buckets, smaller kernels.
CONFIGS = {**in_backward.CONFIGS, "gpt2-narrow": (12, 2, 64, 1024, 128)}
SLEEP_S = 0.02  # device work queued before each probe
PHASES = ("forward", "backward", "step")


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The in-backward optimizer and an after-backward copy, each with its own model (and
    one more in-backward copy per ``--sweep`` bucket count)."""
    layers, heads, width, vocab, context = CONFIGS[args.config]
    torch.manual_seed(0)
    model = in_backward.GPT(layers, heads, width, vocab, context).to(args.device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kwargs: dict[str, Any] = {"lr": 6e-4, "betas": (0.9, 0.95)}

    def compiled(m: torch.nn.Module, buckets: int | None, in_backward_: bool) -> Any:
        options: dict[str, Any] = {"backend": args.backend, "in_backward": in_backward_}
        if buckets:
            options["bucket_bytes"] = -(-grad_bytes // buckets)
        opt = torch.optim.AdamW(in_backward.optimizer_groups(m), **kwargs)
        return optcompile.compile(opt, **options)

    after_model = copy.deepcopy(model)
    variants = {"after": (after_model, compiled(after_model, None, False))}
    variants["in-backward"] = (model, compiled(model, args.buckets, True))
    for count in args.sweep:
        copied = copy.deepcopy(after_model)
        variants[f"in-backward, {count} bucket(s) asked"] = (copied, compiled(copied, count, True))
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, min(args.context, context) + 1), generator=gen)
    return {"variants": variants, "tokens": tokens.to(args.device)}


def phases(
    model: torch.nn.Module,
    opt: Any,
    tokens: torch.Tensor,
    device: str,
    before: Callable[[int], None] | None = None,
) -> list[float]:
    """One iteration's host seconds: forward, backward, step (no sync inside); ``before(i)``
    runs untimed before phase ``i``."""
    times = []
    for i in range(len(PHASES)):
        if before is not None:
            before(i)
        start = time.perf_counter()
        if i == 0:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
        elif i == 1:
            loss.backward()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def gc_pauses(into: dict[str, list[float]], current: list[str]) -> Iterator[None]:
    """Record each cyclic-GC pause (seconds) under the name in ``current[0]``."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            into.setdefault(current[0], []).append(time.perf_counter() - started[0])

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def iterations(setup: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Both optimizers' iterations, alternated; medians of each phase and of the wall time."""
    rows: dict[str, list[list[float]]] = {name: [] for name in setup["variants"]}
    pauses: dict[str, list[float]] = {}
    current = [""]
    with gc_pauses(pauses, current):
        for i in range(args.warmup + args.iters):
            for name in rows:
                model, opt = setup["variants"][name]
                sync(args.device)
                current[0] = name if i >= args.warmup else "warm-up"
                start = time.perf_counter()
                host = phases(model, opt, setup["tokens"], args.device)
                sync(args.device)
                if i >= args.warmup:
                    rows[name].append([*host, time.perf_counter() - start])
    out: dict[str, Any] = {}
    for name, samples in rows.items():
        columns = list(zip(*samples, strict=True))
        keys = (*PHASES, "wall")
        out[name] = {k: statistics.median(c) * 1e6 for k, c in zip(keys, columns, strict=True)}
        gcs = pauses.get(name, [])
        out[name]["gc"] = {"collections": len(gcs), "total_us": sum(gcs) * 1e6}
        opt = setup["variants"][name][1]
        out[name]["buckets"] = len(backward.buckets(opt))
    return out


@contextlib.contextmanager
def timed_hooks(
    model: torch.nn.Module, state: backward.InBackward
) -> Iterator[dict[str, list[float]]]:
    """Inside the block, each call of the model's hooks and of the bucket updates is timed
    where autograd makes it: ``{"hooks": [...], "updates": [...]}`` (seconds, appended)."""
    spent: dict[str, list[float]] = {"hooks": [], "updates": []}

    def timer(fn: Callable[..., Any], key: str) -> Callable[..., None]:
        def timed(*a: Any) -> None:
            start = time.perf_counter()
            try:
                fn(*a)
            finally:
                spent[key].append(time.perf_counter() - start)

        return timed

    params = [p for p in model.parameters() if p.requires_grad]
    originals = []
    for p in params:
        hooks = p._post_accumulate_grad_hooks  # type: ignore[attr-defined]
        originals.append(dict(hooks))
        for key, hook in hooks.items():
            hooks[key] = timer(hook, "hooks")
    update = backward.InBackward.update.__get__(state)
    state.update = timer(update, "updates")  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        del state.update
        for p, hooks in zip(params, originals, strict=True):
            p._post_accumulate_grad_hooks.update(hooks)  # type: ignore[attr-defined]


def inside_backward(
    setup: dict[str, Any], state: backward.InBackward, args: argparse.Namespace
) -> dict[str, float]:
    """In-backward iterations with each hook and bucket update timed where it runs."""
    model, opt = setup["variants"]["in-backward"]
    samples = []
    for _ in range(args.iters):
        with timed_hooks(model, state) as spent:
            sync(args.device)
            host = phases(model, opt, setup["tokens"], args.device)
            sync(args.device)
        hooks, updates = spent["hooks"], spent["updates"]
        samples.append((host[1], sum(hooks), sum(updates), len(hooks), len(updates)))
    columns = list(zip(*samples, strict=True))
    return {
        "backward_us": statistics.median(columns[0]) * 1e6,
        "hooks_us": statistics.median(columns[1]) * 1e6,
        "updates_us": statistics.median(columns[2]) * 1e6,
        "hooks": statistics.median(columns[3]),
        "updates": statistics.median(columns[4]),
    }


def _median_us(fn: Callable[[], Any], reps: int, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _hook_of(p: torch.Tensor) -> Callable[[torch.Tensor], None]:
    hooks = p._post_accumulate_grad_hooks  # type: ignore[attr-defined]
    return next(iter(hooks.values()))  # type: ignore[no-any-return]


@contextlib.contextmanager
def mid_backward(state: backward.InBackward, bucket: backward.Bucket) -> Iterator[None]:
    """As after a backward's first hook (which queued the end-of-backward callback)."""
    state.callback_queued = True
    try:
        yield
    finally:
        state.callback_queued = False
        bucket.arrived = 0


def _python_work() -> int:
    """A fixed piece of pure Python (no tensors, no allocation to speak of)."""
    total = 0
    for i in range(400):
        total += i * i
    return total


def python_speed(setup: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """The same pure-Python work timed inside a post-accumulate-grad hook during the
    in-backward iterations' backwards (on autograd's thread, between its ops and bucket
    updates) and on the main thread between iterations: whether Python itself runs slower
    inside backward (caches, the thread), or only optcompile's code does."""
    model, opt = setup["variants"]["in-backward"]
    params = [p for p in model.parameters() if p.requires_grad]
    inside: list[float] = []
    outside: list[float] = []

    def hook(_: torch.Tensor) -> None:
        start = time.perf_counter()
        _python_work()
        inside.append(time.perf_counter() - start)

    handle = params[len(params) // 2].register_post_accumulate_grad_hook(hook)
    try:
        for _ in range(args.iters):
            phases(model, opt, setup["tokens"], args.device)
            sync(args.device)
            start = time.perf_counter()
            _python_work()
            outside.append(time.perf_counter() - start)
    finally:
        handle.remove()
    return {
        "inside_us": statistics.median(inside) * 1e6,
        "outside_us": statistics.median(outside) * 1e6,
    }


def _hooked(state: backward.InBackward) -> tuple[backward.Bucket, torch.Tensor]:
    """The largest bucket and its param whose hook is timed: its last one, which keeps its
    hook once the buckets are learned (``thin_out``); outside a backward (no graph task)
    that hook checks its bucket and leaves it alone."""
    bucket = max(state.buckets, key=lambda b: len(b.params))
    return bucket, bucket.params[-1]


def per_hook(state: backward.InBackward, reps: int) -> dict[str, float]:
    """A hook for a gradient whose bucket is not updated, and its body alone."""
    bucket, p = _hooked(state)
    hook, ref = _hook_of(p), weakref.ref(state)

    def reset() -> None:
        bucket.arrived = 0

    with mid_backward(state, bucket):
        return {
            "hook": _median_us(lambda: hook(p), reps, reset),
            "hook body": _median_us(lambda: backward._arrived(ref, p), reps, reset),
        }


def _giver(bucket: backward.Bucket, device: str) -> Callable[[], None]:
    """A function that gives the bucket's params gradients (the update frees them)."""
    grads = [torch.zeros_like(p) for p in bucket.params]

    def give() -> None:
        for p, g in zip(bucket.params, grads, strict=True):
            p.grad = g
        sync(device)

    return give


@contextlib.contextmanager
def timed_parts(bucket: backward.Bucket, into: dict[str, list[float]]) -> Iterator[None]:
    """Time the bucket's compiled step and its entries' plans while inside the block."""
    step = bucket.step
    assert step is not None
    entries = [e.value for e in step.cache.entries]  # type: ignore[attr-defined]
    plans = [e.plan for e in entries]

    def timer(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                into[key].append(time.perf_counter() - start)

        return timed

    bucket.step = timer(step, "compiled step")
    # A CUDA-graphed plan: its host preparation (the rest of it is the graph's launch).
    graphed = [p.plan for p in plans if getattr(p, "graphed", None) is not None]
    for entry, plan in zip(entries, plans, strict=True):
        entry.plan = timer(plan, "plan")
    for inner in graphed:
        inner.prepare = timer(inner.prepare, "prepare")
    try:
        yield
    finally:
        bucket.step = step
        for entry, plan in zip(entries, plans, strict=True):
            entry.plan = plan
        for inner in graphed:
            del inner.prepare


def per_bucket(state: backward.InBackward, reps: int, device: str) -> list[dict[str, Any]]:
    """Each bucket's update, its compiled step and its plan (host µs, medians)."""
    rows = []
    for number, bucket in enumerate(state.buckets):
        parts: dict[str, list[float]] = {"compiled step": [], "plan": [], "prepare": []}
        with timed_parts(bucket, parts):
            whole = _median_us(lambda b=bucket: state.update(b), reps, _giver(bucket, device))
        row: dict[str, Any] = {"bucket": number, "params": len(bucket.params), "update": whole}
        row.update({k: statistics.median(v) * 1e6 for k, v in parts.items() if v})
        compiled: Any = bucket.step
        entries = [e.value for e in compiled.cache.entries]
        # (a bucket retraced, or its prologue off its fast tier, would show in its times)
        row["traces"] = compiled.stats.traces
        row["fast_hits"] = sum(e.prologue.fast_hits for e in entries)
        plan = getattr(entries[0].plan, "plan", entries[0].plan)
        staging = getattr(plan, "staging", None)
        if staging is not None:  # (rounds, events queried, pool doublings: never a wait)
            row["staging"] = [staging.round, staging.queries, staging.grown]
        rows.append(row)
    return rows


def sleep_cycles(seconds: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the device busy for about ``seconds``."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # (warm-up)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


def waits(fn: Callable[[], Any], cycles: int, before: Callable[[], Any] | None = None) -> Any:
    """``fn``'s host seconds (and result) right after ~SLEEP_S of device work was queued."""
    if before is not None:
        before()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed, result


def probe(setup: dict[str, Any], state: backward.InBackward) -> list[dict[str, Any]]:
    """Which parts wait for queued device work (see the module)."""
    cycles = sleep_cycles(SLEEP_S)
    rows = []

    def row(name: str, seconds: float, parts: dict[str, list[float]] | None = None) -> None:
        rows.append({"part": name, "host_us": seconds * 1e6, "waits": seconds > SLEEP_S / 2})
        if parts:  # the update's parts, timed in that very call
            rows[-1]["parts_us"] = {k: v[0] * 1e6 for k, v in parts.items() if v}

    bucket, p = _hooked(state)
    hook = _hook_of(p)
    with mid_backward(state, bucket):
        row("hook", waits(lambda: hook(p), cycles)[0])
    for number, b in enumerate(state.buckets):
        parts: dict[str, list[float]] = {"compiled step": [], "plan": [], "prepare": []}
        with timed_parts(b, parts):
            seconds = waits(lambda b=b: state.update(b), cycles, _giver(b, "cuda"))[0]
        row(f"bucket {number} update", seconds, parts)
    for name in ("in-backward", "after"):
        model, opt = setup["variants"][name]
        for k, phase in enumerate(PHASES):

            def busy(i: int, k: int = k) -> None:
                if i == k:
                    torch.cuda.synchronize()
                    torch.cuda._sleep(cycles)

            with timed_hooks(model, state) if name == "in-backward" else _nothing() as spent:
                host = phases(model, opt, setup["tokens"], "cuda", busy)
                torch.cuda.synchronize()
            row(f"{name}: {phase}", host[k])
            if spent is not None and phase == "backward":
                longest = max(spent["updates"], default=0.0)
                row(f"{name}: the longest bucket update in that backward", longest)
    return rows


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None


# The marks a bucket update passes, in order, and the parts between them (--parts).
PARTS = (
    ("before its step (groups, state synced)", "update", "find"),
    ("prologue (guards, inputs gathered)", "find", "found"),
    ("prepare (host values, staged copies)", "prepare", "prepared"),
    ("  of which its part's (host values, their copy)", "part", "parted"),
    ("  of which staging rounds begun (slot checks)", "begin", "begun"),
    ("  of which host -> device copies queued", "send", "sent"),
    ("replay (the graph's launch)", "replay", "replayed"),
    ("after it (side effects, state synced, grads freed)", "planned", "updated"),
    ("whole update", "update", "updated"),
)


class _Marks:
    """Host times (perf_counter) and, on CUDA, events recorded on the current stream at
    named points of the bucket updates inside one backward (events from a pool reused each
    backward)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.pool: list[Any] = []
        self.rows: list[tuple[str, int, float, Any]] = []
        self.bucket = -1

    def __call__(self, name: str) -> None:
        event = None
        if self.cuda:
            if len(self.rows) >= len(self.pool):
                self.pool.append(torch.cuda.Event(enable_timing=True))
            event = self.pool[len(self.rows)]
            event.record()
        self.rows.append((name, self.bucket, time.perf_counter(), event))

    def parts(self) -> tuple[list[dict[str, Any]], list[tuple[float, float | None]]]:
        """Each update's parts (name -> (host µs, device µs), summed where a part ran more
        than once, absent where it did not run) and each stage-ahead's times, once the
        device is done (synchronized)."""
        updates: list[dict[str, Any]] = []
        staged: list[tuple[float, float | None]] = []
        segment: list[tuple[str, float, Any]] = []
        for name, _, seconds, event in self.rows:
            segment.append((name, seconds, event))
            if name == "staged":
                at = {n: (t, e) for n, t, e in segment}
                staged.append(self._between(at["stage"], at["staged"]))
            if name == "updated":
                updates.append({part: self._sum(segment, a, b) for part, a, b in PARTS})
                updates[-1] = {k: v for k, v in updates[-1].items() if v is not None}
                segment = []
        return updates, staged

    def _sum(
        self, segment: list[tuple[str, float, Any]], start: str, end: str
    ) -> tuple[float, float | None] | None:
        """The times from each ``start`` mark to the next ``end`` mark, summed."""
        host, device, opened, found = 0.0, 0.0, None, False
        for name, seconds, event in segment:
            if name == start and opened is None:
                opened = (seconds, event)
            elif name == end and opened is not None:
                h, d = self._between(opened, (seconds, event))
                host, device, opened, found = host + h, device + (d or 0.0), None, True
        return (host, device if self.cuda else None) if found else None

    @staticmethod
    def _between(start: tuple[float, Any], end: tuple[float, Any]) -> tuple[float, float | None]:
        device = start[1].elapsed_time(end[1]) * 1e3 if start[1] is not None else None
        return (end[0] - start[0]) * 1e6, device


class _MarkedGraph:
    """A GraphedPlan's graph that marks its replay."""

    def __init__(self, inner: Any, mark: _Marks) -> None:
        self._inner, self._mark = inner, mark

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._mark("replay")
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._mark("replayed")


def _marked(
    fn: Callable[..., Any], mark: _Marks, before: str, after: str | None
) -> Callable[..., Any]:
    def marked(*args: Any) -> Any:
        mark(before)
        try:
            return fn(*args)
        finally:
            if after is not None:
                mark(after)

    return marked


@contextlib.contextmanager
def marked_updates(state: backward.InBackward, mark: _Marks) -> Iterator[None]:
    """Inside the block, the stage-ahead and each bucket update mark their parts (_Marks).
    Instance attributes wrap what runs (the buckets' Compiled stay as they are: sending
    ahead finds each one's latest entry through it)."""
    undo: list[Callable[[], None]] = []

    def wrap(owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        old = vars(owner).get(name)
        setattr(owner, name, value)
        undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    update = backward.InBackward.update.__get__(state)

    def update_marked(bucket: backward.Bucket) -> None:
        mark.bucket = state.buckets.index(bucket)
        _marked(update, mark, "update", "updated")(bucket)

    wrap(state, "update", update_marked)
    wrap(state, "stage_ahead", _marked(state.stage_ahead, mark, "stage", "staged"))
    for bucket in state.buckets:
        compiled: Any = bucket.step
        wrap(compiled.cache, "find", _marked(compiled.cache.find, mark, "find", "found"))
        for entry in [e.value for e in compiled.cache.entries]:
            plan = entry.plan  # (left as it is: sending ahead reads the entry's plan)
            wrap(entry, "replay", _marked(entry.replay, mark, "planned", None))
            inner = getattr(plan, "plan", None)
            if getattr(inner, "prepare", None) is not None:  # (CPU plans have none)
                wrap(inner, "prepare", _marked(inner.prepare, mark, "prepare", "prepared"))
            for part in getattr(inner if inner is not None else plan, "parts", []):
                if getattr(part, "prepare", None) is not None:
                    wrap(part, "prepare", _marked(part.prepare, mark, "part", "parted"))
            staging = getattr(inner if inner is not None else plan, "staging", None)
            if staging is not None:
                wrap(staging, "begin", _marked(staging.begin, mark, "begin", "begun"))
                wrap(staging, "send", _marked(staging.send, mark, "send", "sent"))
            if getattr(plan, "graphed", None) is not None:
                wrap(plan, "graphed", _MarkedGraph(plan.graphed, mark))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def parts_inside_backward(
    setup: dict[str, Any], state: backward.InBackward, args: argparse.Namespace
) -> dict[str, Any]:
    """Each part of the bucket updates inside real backwards, host (perf_counter) and
    device (CUDA events between the same points) µs, with every bucket's host values sent
    ahead at the first hook and without (each update computes and sends its own),
    iterations alternated; and each mode's backward host time and iteration wall time."""
    model, opt = setup["variants"]["in-backward"]
    modes = {"values sent ahead": True, "each update its own": False}
    found: dict[str, Any] = {
        name: {"updates": [], "staged": [], "backward": [], "wall": []} for name in modes
    }
    for i in range(args.warmup + args.iters):
        for name, ahead in modes.items():
            backward.send_ahead(opt, ahead)
            mark = _Marks(args.device)
            sync(args.device)
            start = time.perf_counter()
            with marked_updates(state, mark):
                host = phases(model, opt, setup["tokens"], args.device)
            sync(args.device)
            wall = time.perf_counter() - start
            if i < args.warmup:
                continue
            updates, staged = mark.parts()
            found[name]["updates"] += updates
            found[name]["staged"] += staged
            found[name]["backward"].append(host[1] * 1e6)
            found[name]["wall"].append(wall * 1e6)
    backward.send_ahead(opt, True)
    out: dict[str, Any] = {}
    for name, rows in found.items():
        parts: dict[str, Any] = {}
        for part, _, _ in PARTS:
            samples = [u[part] for u in rows["updates"] if part in u]
            parts[part] = _medians(samples, len(rows["updates"]))
        parts["stage ahead (first hook, every bucket)"] = _medians(
            rows["staged"], len(rows["backward"])
        )
        out[name] = {
            "parts": parts,
            "updates_per_backward": len(rows["updates"]) / max(args.iters, 1),
            "backward_us": statistics.median(rows["backward"]),
            "wall_us": statistics.median(rows["wall"]),
        }
    return out


def _medians(
    samples: list[tuple[float, float | None]], out_of: int
) -> tuple[float, float | None, str] | None:
    """Medians of host and device µs where the part ran, and in how many of ``out_of``."""
    if not samples:
        return None
    devices = [d for _, d in samples if d is not None]
    return (
        statistics.median(h for h, _ in samples),
        statistics.median(devices) if devices else None,
        f"{len(samples)}/{out_of}",
    )


def parts_report(found: dict[str, Any]) -> str:
    """The --parts table: medians per bucket update (the stage-ahead: per backward)."""
    names = list(found)
    head = " | ".join(f"{n}: host | device | ran" for n in names)
    lines = [
        "",
        "Bucket updates inside backward, by part (medians per update; host perf_counter, "
        "device: CUDA events at the same points):",
        "",
        f"| part | {head} |",
        "| --- |" + " ---: | ---: | ---: |" * len(names),
    ]

    def cell(value: tuple[float, float | None, str] | None) -> str:
        if value is None:
            return "- | - | 0"
        device = f"{value[1]:,.1f} µs" if value[1] is not None else "-"
        return f"{value[0]:,.1f} µs | {device} | {value[2]}"

    for part in found[names[0]]["parts"]:
        cells = " | ".join(cell(found[n]["parts"][part]) for n in names)
        lines.append(f"| {part} | {cells} |")
    for key, label in (("backward_us", "backward (host)"), ("wall_us", "iteration (wall)")):
        cells = " | ".join(f"{found[n][key]:,.0f} µs | | " for n in names)
        lines.append(f"| {label} | {cells}")
    counts = ", ".join(f"{n}: {found[n]['updates_per_backward']:.1f}" for n in names)
    lines.append(f"\nBucket updates per backward: {counts}")
    return "\n".join(lines)


OUR_PACKAGES = ("optcompile/", "optguard/", "optkernels/", "optcudagraph/", "optsidefx/")


def torch_profile(setup: dict[str, Any], args: argparse.Namespace) -> str:
    """torch.profiler over in-backward iterations, with Python stacks: its tracer also sees
    the autograd device thread (it exists by now), where the hooks and updates run."""
    from torch.profiler import ProfilerActivity, profile

    model, opt = setup["variants"]["in-backward"]
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    iters = 5
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(iters):
            phases(model, opt, setup["tokens"], args.device)
        sync(args.device)
    events = prof.key_averages()
    syncs = [e for e in events if "Synchronize" in e.key]
    lines = [f"torch.profiler, {iters} in-backward iterations (Python stacks on):"]
    lines += [f"  {e.key}: {e.count / iters:.1f} per iteration" for e in syncs] or [
        "  no cuda*Synchronize call"
    ]
    ours = [e for e in events if any(name in e.key for name in OUR_PACKAGES)]
    ours.sort(key=lambda e: e.cpu_time_total, reverse=True)
    lines.append("optcompile's Python functions, per iteration (total, self, calls):")
    for e in ours[: args.profile]:
        lines.append(
            f"  {e.cpu_time_total / iters:10,.0f} µs {e.self_cpu_time_total / iters:10,.0f} µs "
            f"{e.count / iters:6.1f}  {e.key}"
        )
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=args.profile))
    return "\n".join(lines)


def c_profile(setup: dict[str, Any], args: argparse.Namespace) -> str:
    model, opt = setup["variants"]["in-backward"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.iters):
        phases(model, opt, setup["tokens"], args.device)
    sync(args.device)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.cprofile)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--context", type=int, default=128, help="(at most the config's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--buckets", type=int, help="split the grads into about this many")
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[],
        help="more in-backward copies with about these many buckets each (e.g. 1,4,40): "
        "the iteration's time against the bucket count is the cost of one bucket",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--reps", type=int, default=200, help="calls per bucket timing")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS")
    parser.add_argument("--cprofile", type=int, default=0, metavar="ROWS")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time each part of the bucket updates inside real backwards (CUDA events and "
        "perf_counter), values sent ahead and not; a table at the end",
    )
    parser.add_argument(
        "--only-parts", action="store_true", help="--parts, and skip the other measurements"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.config is None:
        args.config = "gpt2" if args.device == "cuda" else "gpt2-narrow"
    if args.buckets is None and args.device != "cuda":
        args.buckets = 4  # about GPT-2's bytes per bucket on the GPU at the default 128 MiB
    from optguard import native

    native.start(wait=True)  # the steady state (it builds in the background otherwise)
    setup = build(args)
    result: dict[str, Any] = {"args": vars(args), "torch": torch.__version__}
    result["tokens"] = setup["tokens"].shape[1] - 1
    if args.only_parts:
        _, opt = setup["variants"]["in-backward"]
        state = backward._STATES[opt]
        for _ in range(args.warmup):  # (the buckets learned, their entries traced)
            for model, variant in setup["variants"].values():
                phases(model, variant, setup["tokens"], args.device)
        sync(args.device)
        result["parts"] = parts_inside_backward(setup, state, args)
        print(parts_report(result["parts"]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    result["iterations"] = iterations(setup, args)
    _, opt = setup["variants"]["in-backward"]
    state = backward._STATES[opt]
    result["buckets"] = len(state.buckets)
    result["hooks"] = len(state.handles)  # kept once the buckets are learned
    result["inside_backward"] = inside_backward(setup, state, args)
    result["python_speed"] = python_speed(setup, args)
    result["per_hook"] = per_hook(state, args.reps * 10)
    result["per_bucket"] = per_bucket(state, args.reps, args.device)
    if args.device == "cuda":
        result["probe"] = probe(setup, state)
    if args.parts:
        result["parts"] = parts_inside_backward(setup, state, args)
    print(report(result), flush=True)
    if args.parts:
        print(parts_report(result["parts"]), flush=True)
    if args.profile:
        print(torch_profile(setup, args))
    if args.cprofile:
        print(c_profile(setup, args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def report(result: dict[str, Any]) -> str:
    a = result["args"]
    device = torch.cuda.get_device_name() if a["device"] == "cuda" else "cpu"
    lines = [
        f"{device}; torch {result['torch']}; {a['config']} batch {a['batch']} x {result['tokens']}"
        f" tokens; {result['buckets']} buckets; backend {a['backend']}; medians of {a['iters']}",
        "",
        "| optimizer | buckets | forward | backward | step | iteration (wall) | GC pauses |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in result["iterations"].items():
        cells = " | ".join(f"{row[k]:,.0f} µs" for k in (*PHASES, "wall"))
        gcs = row["gc"]
        lines.append(
            f"| {name} | {row['buckets']} | {cells} "
            f"| {gcs['collections']} in {gcs['total_us']:,.0f} µs |"
        )
    inside, after = result["inside_backward"], result["iterations"]["after"]
    rest = inside["backward_us"] - inside["hooks_us"]
    lines += [
        "",
        f"Inside backward (in-backward, hooks timed): backward {inside['backward_us']:,.0f} µs, "
        f"in {inside['hooks']:.0f} hooks {inside['hooks_us']:,.0f} µs, of which "
        f"{inside['updates']:.0f} bucket updates {inside['updates_us']:,.0f} µs; backward "
        f"without the hooks {rest:,.0f} µs (the after-backward copy's backward: "
        f"{after['backward']:,.0f} µs)",
    ]
    speed = result["python_speed"]
    lines.append(
        f"The same pure Python: {speed['inside_us']:.1f} µs in a hook inside backward, "
        f"{speed['outside_us']:.1f} µs on the main thread between iterations "
        f"({speed['inside_us'] / speed['outside_us']:.2f}x)"
    )
    hook = result["per_hook"]
    lines += [
        "",
        f"Per hook: {hook['hook']:.2f} µs (its body alone: {hook['hook body']:.2f} µs)",
        "",
        "| bucket | params | update | compiled step | plan (its prepare) | update's own "
        "| traces, fast hits |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["per_bucket"]:
        own = r["update"] - r.get("compiled step", 0.0)
        prepare = f" ({r['prepare']:.1f} µs)" if "prepare" in r else ""
        lines.append(
            f"| {r['bucket']} | {r['params']} | {r['update']:.1f} µs "
            f"| {r.get('compiled step', 0.0):.1f} µs | {r.get('plan', 0.0):.1f} µs{prepare} "
            f"| {own:.1f} µs | {r['traces']}, {r['fast_hits']} |"
        )
    total = sum(r["update"] for r in result["per_bucket"])
    lines.append(f"\nAll bucket updates, each timed alone: {total:,.0f} µs per iteration")
    stagings = [r["staging"] for r in result["per_bucket"] if "staging" in r]
    if stagings:
        rounds, queries, grown = (sum(column) for column in zip(*stagings, strict=True))
        lines.append(
            f"Staging (all buckets): {rounds:,} rounds, {queries:,} events queried, "
            f"{grown} pool doublings (the device that far behind; no round waits)"
        )
    for r in result.get("probe", []):
        verdict = "WAITS for the device" if r["waits"] else "does not wait"
        parts = ", ".join(f"{k} {v:,.0f} µs" for k, v in r.get("parts_us", {}).items())
        parts = f" (of which {parts})" if parts else ""
        lines.append(f"probe: {r['part']}: {r['host_us']:,.0f} µs host, {verdict}{parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
