"""The measurements of benchmarks/in_backward_host.py (see its docstring): one iteration's
phases, the iterations alternated, the hooks and bucket updates timed inside backward,
Python's own speed there, a hook and each bucket update timed alone, and on CUDA which
parts wait for the device.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from optcompile import backward

SLEEP_S = 0.02  # device work queued before each probe
PHASES = ("forward", "backward", "step")


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
            schedule = getattr(opt, "bench_schedule", None)  # (in_backward_host --schedule)
            if schedule is not None:
                schedule.step()
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
        # Each iteration's wall time less the first variant's of the same round (run just
        # before it): the host drifts by more than the variants differ, a pair hardly does
        first = rows[next(iter(rows))]
        diffs = sorted(s[-1] - f[-1] for s, f in zip(samples, first, strict=True))
        quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
        out[name]["paired_wall_us"] = {
            "median": statistics.median(diffs) * 1e6,
            "q1": quartiles[0] * 1e6,
            "q3": quartiles[2] * 1e6,
            "faster_share": sum(d < 0 for d in diffs) / len(diffs),
        }
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
