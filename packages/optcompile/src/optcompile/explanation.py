"""``explain()``'s report: a summary a person can act on, and every detail in its fields."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from optguard import GuardGroup

# Readable names for the sources of a compiled optimizer (others print as their pattern).
LABELS = {
    "L['opt']": "optimizer",
    "L['opt'].param_groups": "param_groups",
    "L['opt'].param_groups[*]": "param groups",
    "L['opt'].param_groups[*][key]": "param group entries",
    "L['opt'].param_groups[*]['params']": "params lists",
    "L['opt'].param_groups[*]['params'][*]": "params",
    "L['opt'].param_groups[*]['params'][*].grad": "grads",
    "L['opt'].state": "state",
    "L['opt'].state[*]": "state dicts",
    "L['opt'].state[*][key]": "state values",
}
MAX_REASONS = 5
MAX_GROUPS = 15
MAX_KEYS = 6
MAX_BUCKETS = 5


@dataclass(frozen=True)
class Explanation:
    """What optcompile did with one compiled object.

    ``str()`` is a summary of at most 40 lines whatever the model's size (guards grouped by
    where they look and what they check); with ``verbose=True`` (``explain(obj,
    verbose=True)``) it is the full text: every guard, the generated check, graph and
    replay code. The fields hold the full text either way."""

    traces: int
    retrace_reasons: list[str]
    guards: list[str]
    graph_code: str
    check_code: str
    gather_code: str
    replay_code: str
    backend: str
    entries: int
    fallback_reason: str | None
    entry_guards: list[list[str]] = field(default_factory=list)  # per entry, newest first
    kernel_launches_per_step: int = 0  # a call of the newest entry (its graph, once recorded)
    cudagraphs: str = "off"  # the newest entry's graph, or why it has none
    cudagraph_recordings: int = 0  # over every entry
    cudagraph_replays: int = 0
    native_checks: str = ""  # optguard's C++ per-tensor checks: loaded, building, failed, off
    name: str = ""  # "AdamW.step", a function's qualified name
    recompile_limit: int = 0
    eager: bool = False  # runs eagerly for good (recompile limit reached, or not traceable)
    guard_groups: list[GuardGroup] = field(default_factory=list)  # the newest entry's
    graph_ops: int = 0  # ATen ops in the newest entry's graph
    graph_inputs: int = 0
    side_effects: int = 0  # effects the newest entry replays after its graph
    collectives: list[str] = field(default_factory=list)  # the newest graph's (DTensor's)
    # compile(state_dtype=...): the format ("bf16", "int8") and the optimizer's state bytes
    # (at full precision, as stored); None without state_dtype
    state_format: str | None = None
    state_bytes: tuple[int, int] | None = None
    verbose: bool = False
    buckets: list[str] = field(default_factory=list)  # in_backward: one line per bucket
    backend_reason: str = ""  # why this backend: "asked for", or what backend="auto" saw

    def __str__(self) -> str:
        return "\n".join(self.full_lines() if self.verbose else self.summary_lines())

    def summary_lines(self) -> list[str]:
        """The summary: status, retrace reasons, the newest entry's graph and grouped guards."""
        lines = [self._headline(), *self._backend_line(), *self._bucket_lines(MAX_BUCKETS)]
        lines.append(
            f"kernel launches per step: {self.kernel_launches_per_step}   "
            f"native per-tensor checks: {self.native_checks}"
        )
        lines.append(f"CUDA graphs: {self.cudagraphs}")
        lines += self._state_lines()
        lines.append(f"fallback: {self.fallback_reason or 'none'}")
        reasons = self.retrace_reasons
        lines.append(f"retrace reasons ({len(reasons)}):" if reasons else "retrace reasons: none")
        if len(reasons) > MAX_REASONS:
            lines.append(f"  ({len(reasons) - MAX_REASONS} earlier; the latest follow)")
        lines += [f"  - {_clip(r)}" for r in reasons[-MAX_REASONS:]]
        if self.entries:
            lines.append(
                f"graph of the newest entry: {self.graph_ops} ops over {self.graph_inputs} "
                f"inputs; side effects replayed after it: {self.side_effects}"
            )
            if self.collectives:
                kinds = Counter(c.split("(")[0].split(" ")[0] for c in self.collectives)
                counts = ", ".join(f"{k} x{n}" for k, n in kinds.items())
                lines.append(f"collectives per step: {len(self.collectives)} ({counts})")
            notes = [ln[2:] for ln in self.graph_code.splitlines()[:4] if ln.startswith("# ")]
            lines += [f"  {_clip(n)}" for n in notes[:2]]
            lines.append(f"guards of the newest entry: {len(self.guards)}, by source")
            lines += _group_lines(self.guard_groups)
        lines.append(
            "full text (every guard, the generated check, graph and replay code): "
            "explain(obj, verbose=True)"
        )
        return lines

    def full_lines(self) -> list[str]:
        """Everything: the summary's status lines, every guard of every entry, the code."""
        older = [
            line
            for i, guards in enumerate(self.entry_guards[1:], start=2)
            for line in (f"guards of entry {i} (older):", *(f"  - {g}" for g in guards))
        ]
        return [
            self._headline(),
            *self._backend_line(),
            *self._bucket_lines(len(self.buckets)),
            f"kernel launches per step: {self.kernel_launches_per_step}",
            f"fallback: {self.fallback_reason or 'none'}",
            f"CUDA graphs: {self.cudagraphs}",
            f"native per-tensor checks: {self.native_checks}",
            f"collectives per step: {', '.join(self.collectives) or 'none'}",
            *self._state_lines(),
            "retrace reasons:",
            *(f"  - {r}" for r in self.retrace_reasons or ["(none)"]),
            f"guards of the newest entry ({len(self.guards)}):",
            *(f"  - {g}" for g in self.guards),
            *older,
            "check code:",
            self.check_code,
            "gather code:",
            self.gather_code,
            "graph code:",
            self.graph_code,
            "replay code:",
            self.replay_code,
        ]

    def _bucket_lines(self, most: int) -> list[str]:
        """in_backward: the buckets (the rest of the report is about the newest bucket's
        entry; traces and entries count every bucket's)."""
        if not self.buckets:
            return []
        lines = [
            f"in backward: {len(self.buckets)} buckets, each one compiled update; below, "
            "the latest bucket's entry"
        ]
        lines += [f"  {_clip(b)}" for b in self.buckets[:most]]
        if len(self.buckets) > most:
            lines.append(f"  (+{len(self.buckets) - most} more in explain(opt).buckets)")
        return lines

    def _state_lines(self) -> list[str]:
        if self.state_bytes is None:
            return []
        full, stored = self.state_bytes
        ratio = f" ({full / stored:.2f}x less)" if stored else ""
        return [
            f"state ({self.state_format}): {_mb(stored)} stored, {_mb(full)} at full "
            f"precision{ratio}"
        ]

    def _backend_line(self) -> list[str]:
        return [f"backend {self.backend}: {self.backend_reason}"] if self.backend_reason else []

    def _headline(self) -> str:
        if self.eager:
            state = "runs eagerly"
        elif self.entries:
            state = "compiled"
        else:
            state = "not traced yet"
        limit = f" of recompile_limit {self.recompile_limit}" if self.recompile_limit else ""
        return (
            f"{self.name or 'compiled object'}: {state}   backend: {self.backend}   "
            f"traces: {self.traces}   entries: {self.entries}{limit}"
        )


def _group_lines(groups: list[GuardGroup]) -> list[str]:
    lines = []
    for group in groups[:MAX_GROUPS]:
        label = LABELS.get(group.pattern, group.pattern)
        kinds = ", ".join(
            kind if count == group.sources else f"{kind} ({count})" for kind, count in group.kinds
        )
        keys = ""
        if group.keys:
            shown = ", ".join(group.keys[:MAX_KEYS])
            more = f", +{len(group.keys) - MAX_KEYS}" if len(group.keys) > MAX_KEYS else ""
            keys = f" [{shown}{more}]"
        lines.append(_clip(f"  {group.sources:>6} {label}{keys}: {kinds}"))
    rest = groups[MAX_GROUPS:]
    if rest:
        lines.append(
            f"  {sum(g.sources for g in rest):>6} in {len(rest)} more groups "
            f"({sum(g.guards for g in rest)} guards)"
        )
    return lines


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n:,} bytes"


def _clip(line: str, width: int = 160) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."
