"""``--parts`` of benchmarks/in_backward_host.py: each part of the bucket updates inside
real backwards, marked on the host (perf_counter) and on the device (CUDA events), with
the host values sent ahead and without; and its table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from in_backward_probes import phases, sync
from optcompile import backward

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
    backward.send_ahead(opt, False)  # (the default)
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
