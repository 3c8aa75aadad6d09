"""CUDA graphs for compiled steps (``compile(..., cudagraphs="auto")``).

A plan's first call runs as usual (Triton compiles its kernels there, the plan settles where
each value lives). If the plan can be split into host preparation and device launches on one
CUDA device, its launches are then recorded once, by optcudagraph, and every later call is
``prepare`` (scalars, host-computed values and address tables written into the plan's
device buffers) + one graph replay. A plan with a prelude (ops the kernels cannot take, run
by the torch backend first: Muon's matmuls, LAMB's norms) records those ops too when they
are capturable (no ``.item()``, no CPU tensor, no collective, no random op: see
optkernels.prelude_capture): the Python numbers they take are compared each call and a change
re-records; the unguarded tensors they read (grads) are copied into the plan's buffers
before the replay; their deferred writes into the inputs run after it. Gradients and every
other tensor the kernels read through address tables are indirect: a new address rewrites a
table entry, nothing is re-recorded. The graph's static inputs are the plan's own buffers;
if one is reallocated the graph is re-recorded, with the reason, up to optcudagraph's limit
(a plan that counts its reallocations, ``buffers_version``, has them compared only when
that count moved).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from optcudagraph import Graphed, tree_manager
from optkernels import Backend, Plan
from torch import fx

from optcompile import logs
from optcompile.errors import CompileError


class GraphedPlan:
    """A plan whose device work is replayed as a CUDA graph once it can be (see module)."""

    def __init__(self, plan: Plan, mode: str | bool) -> None:
        self.plan = plan
        self.backend = plan.backend
        self.mode = mode
        self.graphed: Graphed | None = None
        self.reason: str | None = None  # why the plan runs without a graph
        self._decided = False
        # The plan's buffers as last listed, and its buffers_version then (see __call__)
        self._buffers: list[torch.Tensor] = []
        self._buffers_version: int | None = None

    @property
    def kernel_launches_per_step(self) -> int:
        """What a call launches: once a graph is recorded, its one launch (and a recorded
        prelude's grad copy and deferred writes beside it); else (not recorded yet, no graph,
        or dropped) the plan's own launches."""
        graphed = self.graphed
        if graphed is not None and graphed.recordings and graphed.fallback_reason is None:
            return 1 + int(getattr(self.plan, "launches_beside_graph", 0))
        return self.plan.kernel_launches_per_step

    @property
    def recordings(self) -> int:
        return self.graphed.recordings if self.graphed is not None else 0

    @property
    def replays(self) -> int:
        return self.graphed.replays if self.graphed is not None else 0

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        graphed = self.graphed
        if graphed is None:
            out = self.plan(inputs)
            if not self._decided:
                self._decide()
            return out
        if graphed.fallback_reason is not None:  # dropped: the plan runs as before
            return self.plan(inputs)
        plan: Any = self.plan
        plan.prepare(inputs)
        stale = getattr(plan, "stale", None)
        # The plan's buffers, listed and compared anew only when it replaced one (listing
        # and comparing them cost ~1.8 µs of host time per call on the CPU dev machine)
        version = getattr(plan, "buffers_version", None)
        same = version is not None and version == self._buffers_version
        if not same:
            self._buffers, self._buffers_version = plan.buffers(), version
        graphed(self._buffers, stale=stale(inputs) if stale is not None else None, same=same)
        finish = getattr(plan, "finish", None)
        if finish is not None:
            finish(inputs)  # the prelude's deferred writes (after the kernels)
        return ()

    def guarded_addresses(self, indices: Collection[int]) -> None:
        self.plan.guarded_addresses(indices)

    def address_only_inputs(self) -> frozenset[int]:
        """The plan's (a replay reads only its buffers)."""
        found = getattr(self.plan, "address_only_inputs", None)
        return found() if found is not None else frozenset()

    def link_addresses(self, links: Mapping[int, tuple[Any, int]]) -> None:
        self.plan.link_addresses(links)  # type: ignore[attr-defined]

    def _decide(self) -> None:
        self._decided = True
        self.reason = capture_reason(self.plan)
        if self.reason is None:
            plan: Any = self.plan
            manager = tree_manager(plan.device)
            self.graphed = manager.graphed(
                plan.launch,
                "optimizer step",
                warmup=0,
                on_record=getattr(plan, "recorded", None),
            )
        else:
            logs.cudagraphs.info("optimizer step runs without a CUDA graph: %s", self.reason)
        if self.reason is not None and self.mode is True:
            raise CompileError(
                f"cudagraphs=True, but this step cannot be recorded as a CUDA graph: "
                f"{self.reason}. Use cudagraphs='auto' to run it without one"
            )

    def status(self) -> str:
        """One line for explain(): what the graph did, or why there is none."""
        graphed = self.graphed
        if graphed is None:
            if not self._decided:
                return "not decided yet (decided after the first call)"
            return f"not used: {self.reason}"
        if graphed.fallback_reason is not None:
            return f"dropped: {graphed.fallback_reason}"
        line = (
            f"graph #{graphed.graph_id} on {graphed.manager.device}: "
            f"{graphed.recordings} recording(s), {graphed.replays} replay(s)"
        )
        prelude = getattr(self.plan, "prelude", None)
        if prelude is not None:
            line += (
                f" (with the {prelude.kernel_launches_per_step} torch-backend op(s) before its "
                "kernels; the grads they read copied in before each replay)"
            )
        if graphed.rerecord_reasons:
            line += "; re-recorded because: " + "; ".join(graphed.rerecord_reasons)
        return line

    def describe(self) -> str:
        return self.plan.describe()  # the graph's status is explain()'s ``cudagraphs``


def capture_reason(plan: Plan) -> str | None:
    """Why ``plan`` cannot be recorded as a CUDA graph, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    reason = getattr(plan, "capture_reason", None)
    if reason is None:
        return (
            f"the {plan.backend} backend runs each op from Python and reads every tensor by "
            "address (CUDA graphs record the Triton backend's kernels)"
        )
    result: str | None = reason()
    return result


class GraphedBackend:
    """A backend whose plans are GraphedPlans."""

    def __init__(self, inner: Backend, mode: str | bool) -> None:
        if not (mode is True or mode is False or mode == "auto"):
            raise CompileError(f"cudagraphs must be one of 'auto', True, False; got {mode!r}")
        self.inner = inner
        self.mode = mode
        self.name = inner.name
        self.wants_capturable = inner.wants_capturable

    def compile(self, gm: fx.GraphModule) -> GraphedPlan:
        return GraphedPlan(self.inner.compile(gm), self.mode)
