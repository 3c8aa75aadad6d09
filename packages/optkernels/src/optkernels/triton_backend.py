"""The Triton backend: a foreach graph runs as one generated kernel launch per dtype group.

Ops the kernel generator does not know (a norm) run on the torch backend before the kernels,
with what they depend on (``split.split_unfused``); graphs that are not per-lane programs
for another reason (``lanes.analyze`` says why) run wholly on the torch reference backend
inside the same plan. ``describe()`` says which.

A plan's parts (``triton_part``: one lane program each, and the host side of its calls) hold
its dtype groups (``triton_group``: a kernel and its address tables); ``double_scalars`` makes
the graph the torch backend runs when the kernels do not.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from optkernels._torch_compat import capturing
from optkernels._triton_compat import prefetch_runtime, prefetch_triton_key
from optkernels.double_scalars import _python_floats_in_double
from optkernels.errors import BackendError
from optkernels.foreach_kernel import KernelError, source_dir
from optkernels.lanes import LaneProgram, NotLanes, analyze_parts
from optkernels.layouts import layouts, relaid, with_prelude, write_back
from optkernels.prelude_capture import PreludeCapture
from optkernels.prelude_capture import capture_reason as prelude_capture_reason
from optkernels.reference import TorchPlan
from optkernels.small_columns import refuse_shared_writes
from optkernels.split import Split, split_unfused
from optkernels.staging import Staging
from optkernels.triton_group import BufferChanges, _Group
from optkernels.triton_part import _Part

log = logging.getLogger("optcompile.kernels")


# The argument types of ``_Part.kernel_calls``, as Triton's JIT specializes them: the kernel's,
# then the small kernel's over more than one lane. Triton 3.6 compiles a C launcher per
# signature on a cold cache; a compiled optimizer's backend has it built in the background
# before its first call needs it (_triton_compat.prefetch_runtime).
LAUNCH_SIGNATURES = (
    ("*i64", "*i64", "*i64", "*i32", "*i64", "*fp64", "*fp64", "*fp64", "constexpr"),
    ("*i64", "*i64", "*fp64", "i32", "constexpr"),
)


def triton_usable() -> str | None:
    """Why Triton kernels cannot run here, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"


class TritonPlan:
    """A graph lowered to generated Triton kernels (or run by the torch backend)."""

    backend = "triton"

    def __init__(self, gm: fx.GraphModule, host_small: bool | None = None) -> None:
        """``host_small``: compute what depends only on 0-dim inputs on the host (None:
        exactly when those inputs live on the CPU and the rest on a device)."""
        self.gm = gm
        # (found through the graph's node index: a large step has tens of nodes per input)
        self.num_inputs = len(gm.graph.find_nodes(op="placeholder"))
        self.parts: list[_Part] = []
        self.staging = Staging()  # host -> device copies of every part's buffers
        self.reason: str | None = None
        self.split: Split | None = None  # ops run by the torch backend around the kernels
        self.prelude: TorchPlan | None = None
        # The prelude's side of a CUDA graph (prepare / launch / finish with a prelude).
        self.capture: PreludeCapture | None = None
        self._call_inputs: Sequence[Any] = ()
        self._parts_prepared = False  # this call's ``prepare`` reached the parts
        self._checked_devices = False
        # (its parts, ahead_inputs' answer for them): found once
        self._ahead_inputs: tuple[list[_Part], list[int] | None] | None = None
        self._changes = BufferChanges()  # shared by its parts and their groups
        # Values the prelude computes that the kernels need in a given layout: input index ->
        # (shape, stride) (see ``layouts.layouts``).
        self.layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        try:
            self.parts = self._lower(gm, host_small)
        except (NotLanes, KernelError) as exc:
            self.parts, self.reason = [], str(exc)
            split = split_unfused(gm)
            if split is not None:
                try:
                    self.parts = self._lower(split.main, host_small)
                except (NotLanes, KernelError):
                    self.parts = []  # the whole graph stays on the torch backend
                else:
                    prelude = _python_floats_in_double(split.prelude, outputs_as_recorded=True)
                    self.split, self.prelude = split, TorchPlan(prelude)
                    self.capture = PreludeCapture(self.prelude, self.layouts, self.num_inputs)
            if not self.parts and _reads_numbers(gm):
                self.reason = (
                    "the step computes with tensor values read as Python numbers (.item())"
                    f": {self.reason}"
                )

    @functools.cached_property
    def reference(self) -> TorchPlan:
        """The torch backend's plan of the whole graph: what runs when the kernels do not
        (made on first use: a plan whose kernels run never needs it, and preparing it
        walks every node)."""
        return TorchPlan(_python_floats_in_double(self.gm))

    def _lower(self, gm: fx.GraphModule, host_small: bool | None) -> list[_Part]:
        self.index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
        programs = analyze_parts(gm.graph)
        self.layouts = layouts(programs, self.index, self.num_inputs)
        parts = [_Part(p, self.index, host_small, self.staging, self._changes) for p in programs]
        for part in parts:
            for group in part.groups:
                refuse_shared_writes(part.program, group.small_slots)
        return parts

    @property
    def program(self) -> LaneProgram | None:
        """The first part's program (None when the graph runs on the torch backend)."""
        return self.parts[0].program if self.parts else None

    @property
    def host(self) -> bool:
        return any(part.host for part in self.parts)

    @property
    def groups(self) -> list[_Group]:
        return [g for part in self.parts for g in part.groups]

    @property
    def _tables(self) -> dict[Any, Any]:
        return {(i, g): t for i, part in enumerate(self.parts) for g, t in part._tables.items()}

    @property
    def kernel_launches_per_step(self) -> int:
        if not self.parts:
            return self.reference.kernel_launches_per_step
        launches = sum(part.launches for part in self.parts)
        if self.prelude is not None and self.split is not None:
            launches += self.prelude.kernel_launches_per_step + (1 if self.split.writes else 0)
            launches += relaid(self.layouts, self.split.main)
        return launches

    def __call__(self, inputs: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        if not self.parts:
            return self.reference(inputs)
        if len(inputs) != self.num_inputs:
            raise ValueError(f"graph takes {self.num_inputs} inputs, got {len(inputs)}")
        inputs, results = with_prelude(self.prelude, self.layouts, inputs)
        if not self._checked_devices:
            self._checked_devices = True
            for part in self.parts:
                reason = part.check_devices(inputs)
                if reason is not None:
                    self.parts, self.reason = [], reason
                    self.split = self.prelude = self.capture = None
                    return self.reference(inputs[: self.num_inputs])
        with self.staged():
            for part in self.parts:
                part.prepare(inputs)
        for part in self.parts:
            part.launch()
        if self.split is not None:
            write_back(self.split.writes, inputs, results)
        return ()

    def capture_reason(self) -> str | None:
        """Why this plan's device work cannot be recorded as one CUDA graph (after its
        first call), or None when ``prepare`` + ``launch`` can be split that way."""
        if not any(n.op == "call_function" for n in self.gm.graph.nodes):
            return "the step has no tensor work"
        if not self.parts:
            return (
                f"the torch backend runs this graph ({self.reason}); its ops read the "
                "gradients by address, which a graph would bake in"
            )
        reason = self.prelude_capture_reason()
        if reason is not None:
            return f"ops the kernels cannot take run on the torch backend before them: {reason}"
        devices = {part.device for part in self.parts}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return f"its kernels run on {', '.join(sorted(map(str, devices)))}, not one CUDA device"
        return None

    def prelude_capture_reason(self) -> str | None:
        """Why the prelude (if any) cannot be recorded with the kernels, or None."""
        if self.split is None:
            return None
        reason = prelude_capture_reason(self.split.prelude, self.device)
        if reason is not None:
            return reason
        for part in self.parts:
            if part.host and any(
                small and any(self.index[n] >= self.num_inputs for n in column)
                for column, small in zip(part.program.inputs, part.program.input_small, strict=True)
            ):
                # (prepare runs before the replay: it would read the previous call's values)
                return "the host computes with its 0-dim results (a host read of device values)"
        return None

    @property
    def device(self) -> torch.device:
        return self.parts[0].device if self.parts else torch.device("cpu")

    def prepare(self, inputs: Sequence[Any]) -> None:
        """Host side of a call of a capturable plan: fill the buffers ``launch`` reads (with
        a prelude: copy the unguarded tensors it reads into the plan's buffers; the kernels'
        tables take the prelude's results of the recording, see ``recorded``)."""
        capture = self.capture
        if capture is not None:
            capture.prepare(inputs)
            self._call_inputs = inputs
            self._parts_prepared = bool(capture.results)
            if not self._parts_prepared:
                return  # not recorded yet: ``recorded`` or ``launch`` prepares the kernels
            inputs = [*inputs, *capture.results]
        # (``staged()`` spelled out: a generator context manager costs ~1 us per call)
        staging = self.staging
        staging.begin()
        try:
            for part in self.parts:
                part.prepare(inputs)
        finally:
            staging.end()

    def ahead_inputs(self) -> list[int] | None:
        """The input positions ``stage_ahead`` reads (the scalars of the parts whose values
        the host computes), or None where nothing can be sent ahead (no such part, a
        prelude, not called yet)."""
        if not self._checked_devices or self.capture is not None:
            return None
        if self._ahead_inputs is None or self._ahead_inputs[0] is not self.parts:
            hosted = [part for part in self.parts if part.host]
            found = {self.index[n] for part in hosted for n in part.program.scalar_inputs}
            self._ahead_inputs = (self.parts, sorted(found) if hosted else None)
        return self._ahead_inputs[1]

    def stage_ahead(self, inputs: Sequence[Any]) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The host-computed values of the next call (scalars from ``inputs``, at the
        positions ``ahead_inputs`` names; the others may be None), each with the device
        buffer to copy it into before that call (``optkernels.ahead``): that call's
        ``prepare`` then neither computes nor sends them, as long as what they came from
        holds (see ``_Part.stage_ahead``)."""
        if self.ahead_inputs() is None:
            return []
        staged = (part.stage_ahead(inputs) for part in self.parts if part.host)
        return [found for found in staged if found is not None]

    def forget_ahead(self) -> None:
        """The next call computes its own values (those ``stage_ahead`` made were not sent)."""
        for part in self.parts:
            part._ahead = None

    @property
    def ahead_counts(self) -> tuple[int, int]:
        """Calls whose values were sent ahead, and those that took them."""
        return (
            sum(part.ahead_staged for part in self.parts),
            sum(part.ahead_taken for part in self.parts),
        )

    @contextlib.contextmanager
    def staged(self) -> Iterator[None]:
        """One staging round for every part's copies (one slot check, at most one event;
        a part's ``prepare`` or ``refresh_tables`` runs inside one)."""
        self.staging.begin()
        try:
            yield
        finally:
            self.staging.end()

    def _point_tables(self, results: Sequence[torch.Tensor]) -> None:
        """The kernels read the prelude's new ``results``: the parts' tables take their
        addresses (the rest of ``prepare`` ran once this call, or runs now)."""
        inputs = [*self._call_inputs, *results]
        with self.staged():
            for part in self.parts:
                if self._parts_prepared:
                    part.refresh_tables(inputs)
                else:
                    part.prepare(inputs)
        self._parts_prepared = True

    @property
    def launches_beside_graph(self) -> int:
        """Launches a recorded call makes besides the graph's: the copy of the grads its
        prelude reads, the prelude's deferred writes (one ``_foreach_copy_`` each)."""
        capture, split = self.capture, self.split
        if capture is None or split is None:
            return 0
        return (1 if capture.copied else 0) + (1 if split.writes else 0)

    def stale(self, inputs: Sequence[Any]) -> str | None:
        """Why the recorded graph no longer does this call's work (the Python numbers its
        prelude takes changed), or None."""
        return self.capture.stale(inputs) if self.capture is not None else None

    def recorded(self) -> None:
        """After a recording, before its replay: the kernels' tables take the addresses of
        the prelude's results the recording allocated (in the graph's pool)."""
        if self.capture is not None:
            self._point_tables(self.capture.results)

    def finish(self, inputs: Sequence[Any]) -> None:
        """After the device work of ``prepare`` + ``launch`` (or its replay): the prelude's
        deferred writes into the inputs; no reference to this call's tensors is kept."""
        capture = self.capture
        if capture is not None:
            if self.split is not None:
                write_back(self.split.writes, inputs, capture.raw)
            capture.inputs = []
            self._call_inputs = ()

    def replays_alone(self) -> bool:
        """Whether, once called, a call with the same input objects (Python numbers
        unchanged, tensors at the same addresses with the same metadata, their values free
        to change on the device) needs nothing but ``launch``'s device work: no prelude, no
        value the host computes or reads from a CPU tensor, every scalar and table already
        in its buffer (a recorded graph's replay alone then does the call)."""
        return (
            self._checked_devices
            and bool(self.parts)
            and self.capture is None
            and self.split is None
            and all(not part.host and not part.small_on_cpu for part in self.parts)
        )

    def replays_with_ahead(self) -> bool:
        """Whether a call (as for ``replays_alone``) needs besides ``launch`` only what the
        host computes from its CPU step counts and scalars, all of it sent ahead by
        ``stage_ahead`` (its parts' 0-dim CPU inputs aliased into CPU columns: the step
        counts' new values are ``ahead_columns``)."""
        if not self._checked_devices or not self.parts or self.capture is not None:
            return False
        if self.split is not None or not any(part.host for part in self.parts):
            return False
        return all(
            all(g.small_buffers and len(g.small_views) == len(g.small_buffers) for g in part.groups)
            if part.host
            else not part.small_on_cpu
            for part in self.parts
        )

    def ahead_columns(self) -> list[tuple[torch.Tensor, bytes, bytes]] | None:
        """After ``stage_ahead``: each CPU column of its host parts, the bytes the values
        sent were computed from and the bytes the call writes back (its step counts
        advanced), for a replay without ``prepare``; None where a part sent nothing."""
        found: list[tuple[torch.Tensor, bytes, bytes]] = []
        for part in self.parts:
            if part.host:
                columns = part.ahead_columns()
                if columns is None:
                    return None
                found += columns
        return found

    def scalar_positions(self) -> list[int]:
        """The input positions of the Python numbers the parts read (``restage_scalars``)."""
        return sorted({self.index[n] for part in self.parts for n in part.program.scalar_inputs})

    def restage_scalars(self, inputs: Sequence[Any]) -> None:
        """Send the scalars of the parts without host values computed from ``inputs``
        (``scalar_positions``; the other positions may be None) into their buffers now, as
        the next ``prepare`` would, for a replay without ``prepare`` (the buffers stay; the
        host parts' values go with ``stage_ahead``)."""
        with self.staged():
            for part in self.parts:
                if not part.host:
                    part.restage_scalars(inputs)

    def address_only_inputs(self) -> frozenset[int]:
        """The inputs this plan reads only for their data pointers, in its address tables
        (grads): after its first call, a caller may leave them None and hand their pointers
        over natively instead (``link_addresses``). None of them with a prelude (it runs
        torch ops on the inputs) or before the first call (the devices are not settled)."""
        if not self._checked_devices or not self.parts or self.split is not None:
            return frozenset()
        tabled: set[int] = set()
        read: set[int] = set()  # read otherwise: sizes, 0-dim values, static tables
        for part in self.parts:
            for group in part.groups:
                tabled.update(group.dynamic_slots)
                read.update(group.static_slots, group.numel_slots)
                for slots in group.small_slots.values():
                    read.update(slots)
        return frozenset(i for i in tabled - read if 0 <= i < self.num_inputs)

    def link_addresses(self, links: Mapping[int, tuple[Any, int]]) -> None:
        """Where the address tables find the data pointer of an input left None (input
        position -> what optguard's native check read: ``AddressCheck.link``)."""
        for part in self.parts:
            for group in part.groups:
                group.dynamic.link(links)

    def guarded_addresses(self, indices: Collection[int]) -> None:
        """The caller checks, before every call, that the inputs at ``indices`` keep the
        addresses they had on the first (optcompile: their entry's data-pointer guards): the
        static address tables stop comparing them (the rest still are)."""
        guarded = frozenset(indices)
        if self.capture is not None:
            self.capture.guard(guarded)
        for part in self.parts:
            part.guarded = guarded  # for groups built later (check_devices)
            for group in part.groups:
                group.guard(guarded)

    def launch(self) -> None:
        """Device side of a call of a capturable plan: the prelude and the kernels (what a
        graph records). Run without a recording, the prelude's new results go into the
        kernels' tables first."""
        capture = self.capture
        if capture is not None:
            results = capture.run()
            if not capturing():
                self._point_tables(results)
        for part in self.parts:
            part.launch()

    @property
    def buffers_version(self) -> int | None:
        """A number that changes whenever ``buffers()`` would hold another tensor: while it
        stands, the last ``buffers()`` are still the buffers, at the same addresses (they
        are the plan's own and never move in place). None with a prelude whose captured
        tensors (``capture.statics``) it does not count: compare ``buffers()`` then."""
        return self._changes.count if self.capture is None else None

    def buffers(self) -> list[torch.Tensor]:
        """The tensors ``launch`` reads or writes directly: a graph's static inputs."""
        out = [t for part in self.parts for t in part.buffers()]
        if self.capture is not None:
            out.extend(self.capture.statics)
        return out

    def describe(self) -> str:
        if not any(n.op == "call_function" for n in self.gm.graph.nodes):
            return "# no tensor work in this step (no parameter has a gradient): nothing runs"
        if not self.parts:
            return (
                f"# not fused ({self.reason}); the torch backend runs this graph\n"
                + self.reference.describe()
            )
        lanes = " + ".join(str(part.program.lanes) for part in self.parts)
        header = f"# {self.kernel_launches_per_step} kernel launch(es) per step over {lanes} lanes"
        sections = [header]
        if self.split is not None and self.prelude is not None:
            ops = sorted({str(n.target) for n in self.split.unfused})
            sections.append(
                f"# partly fused: {', '.join(ops)} not an op the kernel generator knows "
                f"({len(self.split.unfused)} node(s)); the torch backend runs them and what "
                f"they depend on first ({self.prelude.kernel_launches_per_step} launch(es))"
                + (
                    f", lays out {copies} of their results like their params ({copies} launch(es))"
                    if (copies := relaid(self.layouts, self.split.main))
                    else ""
                )
                + (
                    f", and copies {len(self.split.writes)} of their results into the "
                    "inputs after the kernels (1 launch)"
                    if self.split.writes
                    else ""
                )
                + ":\n"
                + self.prelude.describe()
            )
        return "\n\n".join([*sections, *(g.source for g in self.groups)])


def _reads_numbers(gm: fx.GraphModule) -> bool:
    """Whether Python arithmetic in ``gm`` uses a tensor's value (``.item()``)."""
    return any(
        node.target is torch.ops.aten._local_scalar_dense.default
        and any(getattr(user.target, "__module__", None) == "_operator" for user in node.users)
        for node in gm.graph.nodes
    )


def kernels_recorded() -> bool:
    """Whether the kernel cache (``source_dir()``) holds a launched kernel's record: if not,
    the first call of this process compiles (see _triton_compat)."""
    try:
        return any(name.endswith(".json") for name in os.listdir(source_dir()))
    except OSError:
        return False


class TritonBackend:
    """Backend that fuses foreach graphs into generated Triton kernels."""

    name = "triton"
    wants_capturable = True

    def __init__(self) -> None:
        reason = triton_usable()
        if reason is not None:
            raise BackendError(f"backend='triton' cannot run here: {reason}")
        cold = not kernels_recorded()  # a cold cache: the first call will compile
        if cold:
            prefetch_triton_key()
        if torch.cuda.is_available():  # (on a warm cache: loads, and no compiler import)
            prefetch_runtime(LAUNCH_SIGNATURES, compiler=cold)

    def compile(self, gm: fx.GraphModule) -> TritonPlan:
        plan = TritonPlan(gm)
        if log.isEnabledFor(logging.INFO):
            text = plan.describe()
            notes = [line[2:] for line in text.splitlines() if line.startswith("# ")]
            log.info("triton backend: %s", "; ".join(notes[:3]) or text.splitlines()[0])
            log.debug("%s", text)
        return plan
