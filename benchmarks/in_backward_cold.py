"""Each part of a bucket update's host time inside backward, against the same update alone.

    python benchmarks/in_backward_cold.py [--capturable] [--iters 40] [--reps 40]
                                          [--device cuda] [--config gpt2] [--json PATH]

The model and optimizers of benchmarks/in_backward_host.py (GPT-2 124M, bf16 autocast,
AdamW in two param groups, 4 buckets at the default 128 MiB on CUDA). Every part of a bucket
update is marked with ``perf_counter_ns`` where it runs (no CUDA event, no synchronization):
the update, the compiled step inside it, the prologue's lookup and in it the fast tier's C++
guard tree, its generated Python check (the residual) and its gather, the plan and in it the
host preparation and the CUDA graph's launch, the side effects' replay, the gradients set to
None; and the first param's hook (the backward's cleanliness check). Reported, medians per
update (all buckets, then each):

- inside backward: the in-backward iterations (each after an iteration of the
  after-backward copy, as in training);
- alone: the same update run again and again on the main thread between iterations, its
  gradients given back each time (the very tensors: nothing is freed when they are set to
  None, and every object the update reads stays in the caches);

and their ratio; then the backward's host time three ways, alternated: the after-backward
copy's plain backward, the same with a no-op post-accumulate-grad hook on each param the
in-backward optimizer keeps a hook on (what autograd's calls into Python cost), and the
in-backward backward, with the time spent in its hooks' bodies (updates included) and in its
end-of-backward callback. Where the ratio is alike for every part, Python glue and native code
alike, the update is slower inside backward for what it reads (its objects and code evicted
by autograd's work between hooks), not for any one part. GPU (repository root):

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
        python benchmarks/in_backward_cold.py --capturable
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from optcompile import backward, backward_hooks

sys.path.insert(0, str(Path(__file__).parent))
import in_backward_host
from in_backward_probes import _giver, phases, sync

PARTS = (
    "update", "compiled", "find", "tree", "resid", "gather", "plan", "prepare", "graph",
    "sidefx", "clear",
)  # fmt: skip
NAMES = {
    "update": "whole update",
    "compiled": "compiled step (Compiled.__call__)",
    "find": "prologue (cache lookup)",
    "tree": "  C++ guard tree",
    "resid": "  generated Python check",
    "gather": "  fast gather",
    "plan": "plan",
    "prepare": "  host preparation",
    "graph": "  CUDA graph launch",
    "sidefx": "side effects replayed",
    "clear": "gradients set to None",
    "update own": "update's own (groups, state synced)",
    "driver glue": "driver between its parts",
    "find glue": "prologue between its parts",
    "plan glue": "plan between its parts",
}


class _Marks:
    """(name, ns) marks; ``wrap`` makes a callable mark its start and end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int]] = []

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        rows, clock = self.rows, time.perf_counter_ns

        def marked(*args: Any, **kwargs: Any) -> Any:
            rows.append((name, clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                rows.append(("/" + name, clock()))

        return marked

    def updates(self) -> tuple[list[dict[str, float]], list[float]]:
        """Each update's parts (µs, summed where one ran twice) and the time of each hook
        that ran no update (the first param's)."""
        updates: list[dict[str, float]] = []
        hooks: list[float] = []
        opened: dict[str, int] = {}
        current: dict[str, float] | None = None
        updated = False
        for name, ns in self.rows:
            if not name.startswith("/"):
                opened[name] = ns
                if name == "update":
                    current = dict.fromkeys(PARTS, 0.0)
                elif name == "hook":
                    updated = False
                continue
            name = name[1:]
            elapsed = (ns - opened.pop(name)) / 1e3
            if current is not None and name in current:
                current[name] += elapsed
            if name == "update" and current is not None:
                updates.append(_derived(current))
                current, updated = None, True
            elif name == "hook" and not updated:
                hooks.append(elapsed)
        return updates, hooks


class _Proxy:
    """An object whose calls are marked; its other attributes are the object's."""

    def __init__(self, inner: Any, marks: _Marks, name: str) -> None:
        self._inner, self._call = inner, marks.wrap(inner, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _derived(parts: dict[str, float]) -> dict[str, float]:
    """The parts and what lies between them (glue)."""
    out = dict(parts)
    out["update own"] = parts["update"] - parts["compiled"] - parts["clear"]
    out["driver glue"] = parts["compiled"] - parts["find"] - parts["plan"] - parts["sidefx"]
    out["find glue"] = parts["find"] - parts["tree"] - parts["resid"] - parts["gather"]
    out["plan glue"] = parts["plan"] - parts["prepare"] - parts["graph"]
    return out


@contextmanager
def marked(state: backward.InBackward, marks: _Marks) -> Iterator[None]:
    """Inside the block, every part of the bucket updates and the hooks marks itself."""
    undo: list[Callable[[], None]] = []

    def put(owner: Any, name: str, value: Any) -> None:
        had, old = name in vars(owner), vars(owner).get(name)
        setattr(owner, name, value)
        undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    cls = backward_hooks.InBackward
    put(state, "update", marks.wrap(cls.update.__get__(state), "update"))
    put(state, "arrived_thin", marks.wrap(cls.arrived_thin.__get__(state), "hook"))
    for bucket in state.buckets:
        compiled: Any = bucket.step
        put(bucket, "step", marks.wrap(compiled, "compiled"))
        put(compiled.cache, "find", marks.wrap(compiled.cache.find, "find"))
        for entry in [e.value for e in compiled.cache.entries]:
            fast = entry.prologue.fast
            if fast is not None:
                tree, residual = fast._checks
                put(fast, "_checks", (marks.wrap(tree, "tree"), marks.wrap(residual, "resid")))
                if fast.gather is not None:
                    put(fast, "gather", _Proxy(fast.gather, marks, "gather"))
            put(entry, "replay", marks.wrap(entry.replay, "sidefx"))
            graphed = entry.plan
            put(entry, "plan", _Proxy(graphed, marks, "plan"))
            inner = getattr(graphed, "plan", None)
            if getattr(inner, "prepare", None) is not None:
                put(inner, "prepare", marks.wrap(inner.prepare, "prepare"))
            if getattr(graphed, "graphed", None) is not None:
                put(graphed, "graphed", _Proxy(graphed.graphed, marks, "graph"))
    clear = backward_hooks._clear_grads
    backward_hooks._clear_grads = marks.wrap(clear, "clear")
    try:
        yield
    finally:
        backward_hooks._clear_grads = clear
        for step in reversed(undo):
            step()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    setup = in_backward_host.build(args)
    model, opt = setup["variants"]["in-backward"]
    after_model, after = setup["variants"]["after"]
    state = backward._STATES[opt]
    tokens, device = setup["tokens"], args.device
    for _ in range(args.warmup):
        phases(model, opt, tokens, device)
        phases(after_model, after, tokens, device)
    sync(device)
    marks = _Marks()
    inside: list[tuple[int, dict[str, float]]] = []
    hooks: list[float] = []
    with marked(state, marks):
        for _ in range(args.iters):
            phases(after_model, after, tokens, device)
            marks.rows.clear()
            phases(model, opt, tokens, device)
            sync(device)
            updates, first = marks.updates()
            inside += [(n % len(state.buckets), u) for n, u in enumerate(updates)]
            hooks += first
        alone: list[tuple[int, dict[str, float]]] = []
        for number, bucket in enumerate(state.buckets):
            give = _giver(bucket, device)
            for rep in range(args.reps):
                give()
                marks.rows.clear()
                state.update(bucket)
                if rep >= 3:
                    alone += [(number, u) for u in marks.updates()[0]]
    return {
        "backwards": backwards(setup, state, args),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "torch": torch.__version__,
        "buckets": [len(b.params) for b in state.buckets],
        "inside": inside,
        "alone": alone,
        "first_hooks": hooks,
    }


def backwards(
    setup: dict[str, Any], state: backward.InBackward, args: argparse.Namespace
) -> dict[str, float]:
    """Medians (µs) of the backward's host time: plain, with no-op hooks where the
    in-backward optimizer keeps its hooks, in backward (and the time in its hook bodies and
    end-of-backward callback); iterations alternated."""
    model, opt = setup["variants"]["in-backward"]
    after_model, after = setup["variants"]["after"]
    tokens, device = setup["tokens"], args.device
    names = {id(p): name for name, p in model.named_parameters()}
    twins = dict(after_model.named_parameters())
    hooked = [twins[names[key]] for key in state.handles]
    spent: list[float] = []

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent.append(time.perf_counter() - start)

        return run

    cls = backward_hooks.InBackward
    state.arrived = timed(cls.arrived.__get__(state))  # type: ignore[method-assign]
    state.end_of_backward = timed(cls.end_of_backward.__get__(state))  # type: ignore[method-assign]

    def one(m: torch.nn.Module, o: Any) -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = m(tokens[:, :-1], tokens[:, 1:])
        sync(device)
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        o.step()
        o.zero_grad(set_to_none=True)
        sync(device)
        return elapsed * 1e6

    rows: dict[str, list[float]] = {"plain": [], "no-op hooks": [], "in backward": [], "ours": []}
    try:
        for _ in range(args.iters):
            rows["plain"].append(one(after_model, after))
            handles = [p.register_post_accumulate_grad_hook(lambda p: None) for p in hooked]
            rows["no-op hooks"].append(one(after_model, after))
            for handle in handles:
                handle.remove()
            spent.clear()
            rows["in backward"].append(one(model, opt))
            rows["ours"].append(sum(spent) * 1e6)
    finally:
        del state.arrived, state.end_of_backward
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["hooks"] = len(hooked)
    return out


def report(result: dict[str, Any]) -> str:
    def median(rows: list[tuple[int, dict[str, float]]], key: str, bucket: int = -1) -> float:
        values = [u[key] for n, u in rows if bucket < 0 or n == bucket]
        return statistics.median(values) if values else float("nan")

    inside, alone = result["inside"], result["alone"]
    lines = [
        f"{result['args']['device']}; torch {result['torch']}; AdamW "
        f"(capturable={result['args']['capturable']}); buckets of "
        f"{', '.join(map(str, result['buckets']))} params; medians per update (µs)",
        "",
        "| part | inside backward | alone | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key in NAMES:
        a, b = median(inside, key), median(alone, key)
        ratio = f"{a / b:.1f}x" if b > 0.05 else "-"
        lines.append(f"| {NAMES[key]} | {a:.1f} | {b:.1f} | {ratio} |")
    lines.append("")
    for number, params in enumerate(result["buckets"]):
        parts = ", ".join(
            f"{k} {median(inside, k, number):.0f}/{median(alone, k, number):.0f}"
            for k in ("update", "tree", "prepare", "graph", "clear")
        )
        lines.append(f"bucket {number} ({params} params), inside/alone µs: {parts}")
    hooks = result["first_hooks"]
    if hooks:
        lines.append(f"first param's hook (no update): {statistics.median(hooks):.1f} µs")
    b = result["backwards"]
    rest = b["in backward"] - b["plain"] - b["ours"]
    lines += [
        "",
        f"backward (host, medians): plain {b['plain']:,.0f} µs; with {b['hooks']} no-op hooks "
        f"{b['no-op hooks']:,.0f} µs (+{b['no-op hooks'] - b['plain']:,.0f}); in backward "
        f"{b['in backward']:,.0f} µs (+{b['in backward'] - b['plain']:,.0f}): in its hooks' "
        f"bodies and callback {b['ours']:,.0f} µs, the rest +{rest:,.0f} µs",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=sorted(in_backward_host.CONFIGS))
    parser.add_argument("--capturable", action="store_true")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--reps", type=int, default=40, help="calls per bucket, alone")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.capturable and args.device != "cuda":
        parser.error("--capturable needs a CUDA device (torch's AdamW refuses it on the CPU)")
    args.config = args.config or ("gpt2" if args.device == "cuda" else "gpt2-narrow")
    args.buckets = None if args.device == "cuda" else 4
    args.context, args.batch, args.backend, args.sweep = 128, 1, "auto", []
    from optguard import native

    native.start(wait=True)
    result = measure(args)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
