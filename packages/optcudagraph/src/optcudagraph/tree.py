"""CUDA graph trees: recorded graphs of device work, replayed with one launch.

One ``TreeManager`` per CUDA device owns a private memory pool shared by every graph
recorded on that device, and counts generations: each new recording starts one. A
``Graphed`` function runs eagerly for its warm-up calls (Triton compiles, buffers get
allocated), is recorded on the next call and replayed after that.

The function takes no arguments: what it reads are tensors whose addresses the graph bakes
in. The caller names them on each call (``static``): their addresses are compared with the
recorded ones in one batch; a change re-records (the reason is kept), up to
``max_rerecords``, after which the function runs eagerly and says why. Inputs whose
addresses change every call (gradients after ``zero_grad(set_to_none=True)``) must not be
static: the caller keeps them *indirect*, in a device table of addresses (a static input
itself) whose contents it updates before the replay, so that nothing is re-recorded or
copied. Scalars reach the graph the same way, through a device buffer the caller refreshes.

Outputs: a replay rewrites the memory of the graph's outputs. Each call hands out new tensor
objects over that memory, and the ones handed out before are invalidated when their memory
is rewritten (the next replay of the same graph, or its re-recording: a new generation): any
use of them raises an error naming the graph, instead of returning the newer data.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optcudagraph import _torch_compat as compat
from optcudagraph.errors import CUDAGraphError

DEFAULT_MAX_RERECORDS = 4

log = logging.getLogger("optcompile.cudagraphs")


@dataclass
class Recording:
    """One recording of a graph, for introspection."""

    graph_id: int
    function: str
    generation: int
    reason: str


@dataclass
class TreeManager:
    """The graphs of one CUDA device: their shared pool, generations and counters."""

    device: torch.device
    pool: Any = None
    generation: int = 0
    recordings: list[Recording] = field(default_factory=list)
    replays: int = 0
    # Held weakly: a graphed function (and the graph, plan and buffers it holds) goes with
    # whoever made it (a compiled optimizer), not with the manager.
    functions: weakref.WeakSet[Graphed] = field(default_factory=weakref.WeakSet)
    _next_id: int = 0
    _keeper: Any = None

    def graphed(
        self,
        fn: Callable[[], Any],
        name: str,
        warmup: int = 1,
        max_rerecords: int = DEFAULT_MAX_RERECORDS,
        on_record: Callable[[], None] | None = None,
    ) -> Graphed:
        """``fn`` (device work only, no host side effects) as a graphed function;
        ``on_record`` runs after each recording, before its first replay (to point the
        caller's tables at what the recording allocated)."""
        graphed = Graphed(self, fn, name, warmup, max_rerecords, on_record)
        self.functions.add(graphed)
        return graphed

    def ensure_pool(self) -> None:
        """Create the private pool, held by an empty graph of the manager's own: the pool
        lives while a graph uses it, and the graphs of functions come and go."""
        if self.pool is None:
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.graph_pool_handle()
                self._keeper = torch.cuda.CUDAGraph()
                with warnings.catch_warnings():  # "The CUDA Graph is empty": it is meant to be
                    warnings.simplefilter("ignore", UserWarning)
                    with torch.cuda.graph(self._keeper, pool=self.pool):
                        pass

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def describe(self) -> list[str]:
        """One line per recording and per function: ids, generations, replays, reasons."""
        lines = [
            f"{self.device}: {len(self.recordings)} recording(s), {self.replays} replay(s), "
            f"generation {self.generation}"
        ]
        for r in self.recordings:
            lines.append(
                f"  graph #{r.graph_id} {r.function} generation {r.generation}: {r.reason}"
            )
        for f in sorted(self.functions, key=lambda f: f.name):
            if f.fallback_reason is not None:
                lines.append(f"  {f.name} runs without CUDA graphs: {f.fallback_reason}")
        return lines


_MANAGERS: dict[int, TreeManager] = {}


def tree_manager(device: torch.device | str | int) -> TreeManager:
    """The tree manager of a CUDA device (created on first use)."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        raise CUDAGraphError(f"CUDA graphs need a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    manager = _MANAGERS.get(index)
    if manager is None:
        manager = _MANAGERS[index] = TreeManager(torch.device("cuda", index))
    return manager


def reset_managers() -> None:
    """Forget every manager (their graphs stay usable by whoever holds them)."""
    _MANAGERS.clear()


class _Node:
    """One recorded graph: the CUDA graph, the static addresses it baked in, its outputs."""

    def __init__(
        self, graph: torch.cuda.CUDAGraph, graph_id: int, generation: int, static_ptrs: list[int]
    ):
        self.graph = graph
        self.graph_id = graph_id
        self.generation = generation
        self.static_ptrs = static_ptrs
        self.static_indices = list(range(len(static_ptrs)))
        self.outputs: Any = None  # what the function returned while being recorded
        self.handed: list[torch.Tensor] = []  # aliases of the outputs given to the caller
        self.replays = 0

    def moved(self, static: Sequence[torch.Tensor]) -> str | None:
        """Why ``static`` is not what the graph baked in, or None."""
        tensors = list(static)
        if len(tensors) != len(self.static_ptrs):
            return f"{len(tensors)} static inputs, {len(self.static_ptrs)} when recorded"
        if compat.data_ptrs_equal(tensors, self.static_ptrs, self.static_indices):
            return None
        for i, (t, ptr) in enumerate(zip(tensors, self.static_ptrs, strict=True)):
            if t.data_ptr() != ptr:
                return (
                    f"static input {i} ({tuple(t.shape)} {str(t.dtype).replace('torch.', '')}) "
                    f"moved ({ptr:#x} -> {t.data_ptr():#x})"
                )
        return None  # pragma: no cover - the batch compare and the loop agree

    def hand_out(self) -> Any:
        """Fresh aliases of the outputs; the ones handed out before are invalidated (by
        this replay)."""
        if self.outputs is None:  # a function run for its effects: nothing to alias
            return None
        self.invalidate(f"replay {self.replays} of the graph rewrote it")
        handed: list[torch.Tensor] = []

        def fresh(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                out = compat.alias(value)
                handed.append(out)
                return out
            if isinstance(value, list | tuple):
                return type(value)(fresh(v) for v in value)
            return value

        result = fresh(self.outputs)
        self.handed = handed
        return result

    def invalidate(self, why: str) -> None:
        if not self.handed:
            return
        message = (
            f"optcudagraph: this tensor is an output of CUDA graph #{self.graph_id} "
            f"(generation {self.generation}) and its memory was overwritten: {why}. "
            "Clone outputs you keep across calls of a CUDA-graphed function."
        )
        for t in self.handed:
            compat.invalidate(t, message)
        self.handed = []


class Graphed:
    """A no-argument function of device work, run as a recorded CUDA graph (see module)."""

    def __init__(
        self,
        manager: TreeManager,
        fn: Callable[[], Any],
        name: str,
        warmup: int,
        max_rerecords: int,
        on_record: Callable[[], None] | None = None,
    ) -> None:
        self.manager = manager
        self.on_record = on_record
        self.fn = fn
        self.name = name
        self.warmup = warmup
        self.max_rerecords = max_rerecords
        self.node: _Node | None = None
        self.calls = 0
        self.recordings = 0
        self.replays = 0
        self.rerecord_reasons: list[str] = []
        self.fallback_reason: str | None = None

    @property
    def graph_id(self) -> int | None:
        return self.node.graph_id if self.node is not None else None

    def __call__(
        self, static: Sequence[torch.Tensor] = (), stale: str | None = None, same: bool = False
    ) -> Any:
        """Run, record or replay; ``stale``: why the recorded graph no longer does this
        call's work though its static inputs stayed (numbers it baked in changed): it is
        re-recorded, as for a moved static input. ``same``: the caller vouches that
        ``static`` holds the very tensors of its last call, none moved since (its own
        buffers, which only it replaces): their addresses are not compared again."""
        self.calls += 1
        if self.fallback_reason is not None or self.calls <= self.warmup:
            return self.fn()
        node = self.node
        if node is None:
            return self._record(static, "first recording")
        moved = stale if stale is not None or same else node.moved(static)
        if moved is not None:
            if len(self.rerecord_reasons) >= self.max_rerecords:
                self._fall_back(
                    f"re-recorded {len(self.rerecord_reasons)} times (max_rerecords="
                    f"{self.max_rerecords}); the last change: {moved}"
                )
                return self.fn()
            self.rerecord_reasons.append(moved)
            return self._record(static, f"re-recorded: {moved}")
        node.graph.replay()
        node.replays += 1
        self.replays += 1
        self.manager.replays += 1
        return node.hand_out()

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.info("%s runs without CUDA graphs from now on: %s", self.name, reason)
        self._drop("it was dropped (the function now runs without CUDA graphs)")

    def _drop(self, why: str) -> None:
        if self.node is not None:
            self.node.invalidate(why)
            self.node.graph.reset()
            self.node = None

    def _record(self, static: Sequence[torch.Tensor], reason: str) -> Any:
        manager = self.manager
        manager.ensure_pool()
        self._drop(f"the graph was re-recorded (generation {manager.generation + 1})")
        manager.generation += 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(manager.device), torch.cuda.graph(graph, pool=manager.pool):
            outputs = self.fn()
        node = _Node(graph, manager._new_id(), manager.generation, [t.data_ptr() for t in static])
        node.outputs = outputs
        self.node = node
        self.recordings += 1
        manager.recordings.append(Recording(node.graph_id, self.name, node.generation, reason))
        log.info("%s: graph #%d on %s: %s", self.name, node.graph_id, manager.device, reason)
        if self.on_record is not None:
            self.on_record()
        # Recording does not run the work: this call's replay does.
        graph.replay()
        node.replays += 1
        self.replays += 1
        manager.replays += 1
        return node.hand_out()
