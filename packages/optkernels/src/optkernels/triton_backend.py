"""The Triton backend: a foreach graph runs as one generated kernel launch per dtype group.

Ops the kernel generator does not know (a norm) run on the torch backend before the kernels,
with what they depend on (``split.split_unfused``); graphs that are not per-lane programs
for another reason (``lanes.analyze`` says why) run wholly on the torch reference backend
inside the same plan. ``describe()`` says which.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from optkernels._torch_compat import capturing, current_stream
from optkernels._triton_compat import Kernel, prefetch_runtime, prefetch_triton_key
from optkernels.addresses import AddressCheck
from optkernels.compressed import BLOCK as INT8_BLOCK
from optkernels.dtypes import lanes_by_dtypes
from optkernels.errors import BackendError
from optkernels.foreach_kernel import (
    KernelError,
    kernel_source,
    launch_config,
    load_kernel,
    register_limit,
    source_dir,
)
from optkernels.host import (
    HOST_ROWS,
    HostFunction,
    host_dtypes,
    host_function,
    host_reads,
    host_vars,
    needs_host,
    picks_differ,
    python_floats,
    scalar_function,
)
from optkernels.lanes import LaneProgram, NotLanes, analyze_parts
from optkernels.layouts import layouts, relaid, with_prelude, write_back
from optkernels.numbers import HOST_ONLY, PICK
from optkernels.prelude_capture import PreludeCapture
from optkernels.prelude_capture import capture_reason as prelude_capture_reason
from optkernels.reference import TorchPlan
from optkernels.split import Split, split_unfused
from optkernels.staging import Staging

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


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(count: int) -> int:
    """``count`` float64 values rounded up to 16 bytes (what Triton assumes of pointers)."""
    return -(-count // 2) * 2


class BufferChanges:
    """How many times one of a plan's buffers (``buffers()``: a CUDA graph's static inputs)
    became another tensor. The buffers are the plan's own, made by it and never moved in
    place: while this count stands, ``buffers()`` holds the same tensors at the same
    addresses, and a caller may skip comparing them (``TritonPlan.buffers_version``)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class _Group:
    """The lanes sharing one dtype signature: one kernel, its address tables and buffers.

    Addresses the entry's guards fix (params, state: ``meta["static_address"]``) live in a
    static table, rebuilt only if one moved: checked each call in one batch, except those
    whose caller's guards check them on every call (``TritonPlan.guarded_addresses``); the
    others (grads, new tensors every step) live in a small dynamic table, re-read each call
    and re-uploaded when they change."""

    def __init__(
        self,
        program: LaneProgram,
        lanes: list[int],
        dtypes: tuple[torch.dtype, ...],
        index: dict[Any, int],
        dynamic: list[bool],
        host: dict[int, int | None] | None = None,
        guarded: frozenset[int] = frozenset(),
        changes: BufferChanges | None = None,
    ):
        self.changes = changes if changes is not None else BufferChanges()
        self.lanes = lanes
        self.dtypes = dtypes
        self.name = "foreach_" + "_".join(str(d).replace("torch.", "") for d in dtypes)
        if host:
            self.name += "_host"
        rounding = {}
        payload_dtypes = {"bf16": torch.bfloat16, "int8": torch.uint8}
        for k, (fmt, counter, salt, rounded) in program.rounding.items():
            if dtypes[k] is payload_dtypes[fmt] and rounded.issuperset(lanes):
                rounding[k] = (fmt, counter, salt)
            elif rounded.intersection(lanes):
                raise KernelError(f"input column {k} mixes compressed and plain lanes")
        self.source = kernel_source(program, dtypes, self.name, host, dynamic, lanes[0], rounding)
        # (the launch shape follows the full-size tensors: 0-dim counts are read once a lane)
        full = [d for k, d in enumerate(dtypes) if not program.input_small[k]]
        self.block, self.num_warps = launch_config(full)
        self.maxnreg = register_limit(full)
        if torch.uint8 in full and self.block % INT8_BLOCK:
            raise KernelError(f"int8 state needs blocks of a multiple of {INT8_BLOCK} elements")
        self.kernel = load_kernel(self.source, self.name)
        has_small = any(program.input_small[k] for _, k in program.writes)
        self.small_kernel = (
            load_kernel(self.source, self.name + "_small") if has_small and not host else None
        )

        def slots(columns: list[int], unread: set[int] | None = None) -> list[int]:
            return [
                -1 if unread and k in unread else index[program.inputs[k][lane]]
                for lane in lanes
                for k in columns
            ]

        # Table entries by input slot; -1 where the kernel never dereferences the entry (in
        # host mode, 0-dim inputs are read from ``host_vals``): written as 0, not checked.
        unread = {k for k, small in enumerate(program.input_small) if small and host}
        self.static_slots = slots([k for k, d in enumerate(dynamic) if not d], unread)
        self.guard(guarded)
        self.dynamic_slots = slots([k for k, d in enumerate(dynamic) if d])
        self.dynamic = AddressCheck(self.dynamic_slots)
        self.small_slots = {k: slots([k]) for k, small in enumerate(program.input_small) if small}
        big = [k for k, small in enumerate(program.input_small) if not small]
        big = [k for k in big if dtypes[k] is not torch.uint8] or big  # (not a packed payload)
        self.numel_slots = slots(big[:1])  # one full-size input per lane gives its size
        self.ptrs: torch.Tensor | None = None
        self.dptrs: torch.Tensor | None = None
        self.small_out: torch.Tensor | None = None
        self.host_vals: torch.Tensor | None = None  # host-computed values (host mode)
        # Host mode: its host functions (_Part._build: every lane's, and one for all)
        self.host_fns: tuple[HostFunction, HostFunction | None] | None = None
        self.table_uploads = 0  # times an address table was (re)built
        # Host mode: per 0-dim input column, one CPU buffer the lanes' tensors alias (see
        # _Part._host_values), and the addresses that aliasing gives them.
        self.small_buffers: dict[int, torch.Tensor] = {}
        self.small_views: dict[int, np.ndarray] = {}  # numpy views of small_buffers
        self.small = AddressCheck([i for slots in self.small_slots.values() for i in slots])

    def guard(self, guarded: frozenset[int]) -> None:
        """Stop comparing the addresses of the inputs at ``guarded`` (their caller does)."""
        checked = {i for i in self.static_slots if i >= 0 and i not in guarded}
        self.static = AddressCheck(self.static_slots, checked)  # unrecorded: rewrites once

    def refresh(self, inputs: Sequence[Any], device: torch.device, staging: Staging) -> None:
        """Bring both address tables up to date with this call's tensors (in place: the
        tables keep their own addresses, which a recorded CUDA graph reads)."""
        static = self.static
        if self.ptrs is None or (static.compared and not static.equal(inputs)):
            ptrs = self._write(static, inputs, self.ptrs, device, staging)
            if ptrs is not self.ptrs:
                self.ptrs = ptrs
                self.changes.count += 1
        if self.dptrs is None or not self.dynamic.equal(inputs):
            dptrs = self._write(self.dynamic, inputs, self.dptrs, device, staging)
            if dptrs is not self.dptrs:
                self.dptrs = dptrs
                self.changes.count += 1

    def _write(
        self,
        check: AddressCheck,
        inputs: Sequence[Any],
        table: torch.Tensor | None,
        device: torch.device,
        staging: Staging,
    ) -> torch.Tensor:
        self.table_uploads += 1
        return staging.upload(table, check.record(inputs), torch.int64, device)


class _Part:
    """One independent lane program of a plan (one param group's foreach ops): its kernels,
    tables and the host-side state of its 0-dim values."""

    def __init__(
        self,
        program: LaneProgram,
        index: dict[Any, int],
        host_small: bool | None,
        staging: Staging,
        changes: BufferChanges | None = None,
    ) -> None:
        self.program = program
        self.index = index
        self.changes = changes if changes is not None else BufferChanges()
        self._scalars = scalar_function(program, index)
        self.host_small = host_small
        self.guarded: frozenset[int] = frozenset()  # see TritonPlan.guarded_addresses
        self.groups: list[_Group] = []
        self.staging = staging  # the plan's: one round per call for all its parts
        self.launches = 0
        self.device = torch.device("cpu")  # where the kernels run; set by check_devices
        # (Python arithmetic on .item() values is computed on the host only: numbers.py)
        self.host = needs_host(program)
        self.host_order: list[int] = []  # the vars computed on the host (host mode)
        self.host_read: list[int] = []  # those the kernels read: the host_vals columns
        # One kernel per dtype signature: the inputs' dtypes and what each op computes in
        # and returns (they differ between lanes of one input dtype where a 0-dim float16
        # parameter's ops promote to float32: dtypes.op_dtypes). (Found once: a part is
        # built again in host mode by check_devices.)
        self._by_dtypes = lanes_by_dtypes(program)
        self._build(self.host)

    def _build(self, host: bool = False) -> None:
        program = self.program
        self.host_order = host_vars(program) if host else []
        self.host_read = host_reads(program, self.host_order)
        columns = {v: j for j, v in enumerate(self.host_read)}
        host_cols = {v: columns.get(v) for v in self.host_order}
        # Host mode: per group (its lanes), the host function for every lane and the one
        # for lanes holding the same values (None where their PICKs differ: picks_differ).
        self._host_fns: dict[tuple[int, ...], tuple[HostFunction, HostFunction | None]] = {}
        if host:
            rounding = host_dtypes(program, self.host_order)
            for lanes in self._by_dtypes.values():
                every = host_function(program, self.host_order, False, rounding, lanes)
                one = (
                    None
                    if picks_differ(program, lanes)
                    else host_function(program, self.host_order, True, rounding, lanes)
                )
                self._host_fns[tuple(lanes)] = (every, one)
        # An input column is static when the guards fix every lane's address (params, state).
        dynamic = [
            not all([n.meta.get("static_address", False) for n in column])
            for column in program.inputs
        ]
        self.groups = [
            _Group(program, lanes, d, self.index, dynamic, host_cols, self.guarded, self.changes)
            for (d, _), lanes in self._by_dtypes.items()
        ]
        for group in self.groups:  # (looked up once: a key of 200 lanes hashes in ~1.6 µs)
            group.host_fns = self._host_fns.get(tuple(group.lanes))
        small_writes = sum(1 for _, k in program.writes if program.input_small[k])
        # (each group's kernel, and its copy of the 0-dim results where the kernel makes them)
        self.launches = len(self.groups) * (2 if small_writes and not host else 1)
        self._tables: dict[int, tuple[torch.Tensor, ...]] = {}
        self._small_writes = [(v, k) for v, k in program.writes if program.input_small[k]]
        # One device buffer for the scalar inputs and, in host mode, each group's host vals
        # (one copy per call); ``scalars`` and the groups' ``host_vals`` are views of it.
        self.values: torch.Tensor | None = None
        self.scalars: torch.Tensor | None = None
        self._scalar_values: list[float] = []
        # (scalar count, values' size, each group's block: start and length), by _stage_values
        self._layout: tuple[int, int, list[tuple[_Group, int, int]]] | None = None
        # The next call's values, sent ahead (stage_ahead) until that call takes them
        self._ahead: _Ahead | None = None
        self.ahead_staged = 0
        self.ahead_taken = 0

    def check_devices(self, inputs: Sequence[Any]) -> str | None:
        """Decide where 0-dim values are computed; the reason if the kernels cannot run."""
        program = self.program
        tensors = [[inputs[self.index[n]] for n in nodes] for nodes in program.inputs]
        big_inputs = [k for k, small in enumerate(program.input_small) if not small] or [0]
        device = tensors[big_inputs[0]][0].device
        big = {
            t.device for k, lane in enumerate(tensors) for t in lane if not program.input_small[k]
        }
        small = {t.device for k, lane in enumerate(tensors) for t in lane if program.input_small[k]}
        if len(big) > 1 or (small and small != {device} and small != {torch.device("cpu")}):
            return f"its tensors live on several devices ({', '.join(map(str, big | small))})"
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return f"its tensors live on {device} (the kernels run on CUDA devices)"
        self.device = device
        # (numpy, which computes them, has no bfloat16: a Tensor beta cast to a bfloat16
        # param's dtype by a prelude stays on the device side)
        numpy_dtypes = all(
            t.dtype is not torch.bfloat16
            for k, lane in enumerate(tensors)
            if program.input_small[k]
            for t in lane
        )
        needed = needs_host(program)
        on_cpu = small == {torch.device("cpu")} and numpy_dtypes
        on_host = on_cpu and (device.type != "cpu" or python_floats(program) or needed)
        # (numbers the host makes from the scalars alone: Muon's lr scaled per shape)
        on_host = on_host or (needed and not small)
        if self.host_small if self.host_small is not None else on_host:
            # Step counts of capturable=False optimizers stay on the CPU: what depends
            # only on them is computed there, for all lanes at once, each call.
            if not self.host:
                try:
                    self._build(host=True)
                except (NotLanes, KernelError) as exc:
                    return str(exc)
            self.host = True
        elif needed:
            devices = ", ".join(sorted(map(str, small)))
            if all(op.op == PICK for op in program.ops if op.op in HOST_ONLY):
                return (
                    "the step reads Python numbers that differ between parameters (per group "
                    f"or per shape) beside 0-dim tensors on {devices}; the host computes the "
                    "lanes' values only where those tensors are on the CPU"
                )
            return (
                f"the step computes with values read with .item() from 0-dim tensors on "
                f"{devices}; the host computes such values from CPU tensors only"
            )
        return None

    def prepare(self, inputs: Sequence[Any]) -> None:
        """The host side of a call: scalars, host-computed values and address tables go
        into device buffers that keep their addresses from call to call (inside a staging
        round of the plan: ``TritonPlan.staged``)."""
        device = self.device
        staging = self.staging
        scalar_values = self._scalars(inputs)
        if self._ahead is not None and self._take_ahead(inputs, scalar_values):
            self._scalar_values = scalar_values
        elif self.host or self.values is None or scalar_values != self._scalar_values:
            self._scalar_values = scalar_values
            self._stage_values(inputs, scalar_values)
        for g, group in enumerate(self.groups):
            self._group_tables(g, group, inputs, device)
            group.refresh(inputs, device, staging)
            if group.small_out is None:  # its shape is fixed: one buffer for every call
                group.small_out = torch.empty(
                    (len(group.lanes), max(len(self._small_writes), 1)),
                    dtype=torch.float64,
                    device=device,
                )
                self.changes.count += 1

    def refresh_tables(self, inputs: Sequence[Any]) -> None:
        """The address tables only (``prepare`` ran this call: its host values, which may
        write back step counts, are not computed twice): new addresses of dynamic inputs
        (inside a staging round of the plan)."""
        for group in self.groups:
            group.refresh(inputs, self.device, self.staging)

    def _stage_values(self, inputs: Sequence[Any], scalar_values: list[float]) -> None:
        """Write the scalars and (host mode) the groups' host vals into this round's staging
        array of ``values`` and send it: one copy. Each block starts 16-byte aligned."""
        count = len(scalar_values)
        layout = self._layout
        if layout is None or layout[0] != count:
            width = len(self.host_read)
            size = _aligned(max(count, 1))
            starts: list[tuple[_Group, int, int]] = []
            if self.host:
                for group in self.groups:
                    length = HOST_ROWS + len(group.lanes) * width
                    starts.append((group, size, length))
                    size += _aligned(length)
            layout = self._layout = (count, size, starts)
        _, size, starts = layout
        # float64: a float64 op reads lr, betas and the host's bias corrections at full
        # precision (ops of narrower dtypes convert them as ATen converts a Python scalar)
        values, host = self.staging.stage(self.values, (size,), torch.float64, self.device)
        if values is not self.values:  # new: views of it for the kernels
            self.values = values
            self.changes.count += 1
            self.scalars = values[: max(len(scalar_values), 1)]
            for group, start, length in starts:
                group.host_vals = values[start : start + length]
        host[:count] = scalar_values
        for group, start, length in starts:
            block = host[start : start + length]
            self._host_values(self.program, group, inputs, scalar_values, block)
        self.staging.send(values)

    def launch(self) -> None:
        """The device side of a call: the kernels, reading only the prepared buffers."""
        for kernel, grid, args, options in self.kernel_calls():
            kernel[grid](*args, **options)

    def kernel_calls(self) -> Iterator[tuple[Kernel, tuple[int], tuple[Any, ...], dict[str, int]]]:
        """Each kernel launch of a call: the kernel, its grid, its positional arguments (of
        ``LAUNCH_SIGNATURES``' types) and its keyword ones (constexprs, launch options)."""
        for g, group in enumerate(self.groups):
            numels, blk_lane, blk_start = self._tables[g]
            values = group.host_vals if self.host else self.scalars
            args = (group.ptrs, group.dptrs, numels, blk_lane, blk_start, self.scalars)
            options = {"BLOCK": group.block, "num_warps": group.num_warps}
            if group.maxnreg is not None:
                options["maxnreg"] = group.maxnreg
            yield group.kernel, (blk_lane.numel(),), (*args, group.small_out, values), options
            if group.small_kernel is not None:
                n = len(group.lanes)
                small = (group.ptrs, group.dptrs, group.small_out, n)
                yield group.small_kernel, (triton_cdiv(n, 256),), small, {"BLOCK": 256}

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the kernels read or write directly (the rest they reach through
        the address tables)."""
        out = [] if self.values is None else [self.values]
        for g, group in enumerate(self.groups):
            out.extend(self._tables[g])
            for t in (group.ptrs, group.dptrs, group.small_out):
                if t is not None:
                    out.append(t)
        return out

    def _host_values(
        self,
        program: LaneProgram,
        group: _Group,
        inputs: Sequence[Any],
        scalar_values: list[float],
        block: np.ndarray,
    ) -> None:
        """Compute the host vars for the group's lanes on the CPU, write the 0-dim results
        back there, and put the values the kernel reads into ``block`` (its ``host_vals``:
        see host.host_reads).

        The lanes' 0-dim CPU tensors (step counts: state the optimizer owns) are made to
        alias one buffer per column, slot ``j`` for lane ``j`` (``set_``: same tensor objects,
        values, dtype and shape). All lanes are then read and written as that buffer, through
        a numpy view (host_function), instead of stacking and copying 200 tensors per call.
        Their addresses are checked each call in one batch; a tensor re-pointed since
        (``set_``, ``.data =``) is aliased again."""
        if not group.small_buffers or not group.small.equal(inputs):
            self._alias_small(group, inputs)
        buffers = group.small_buffers
        # On the CPU, numpy views of the buffers (written in place); forced host mode with
        # device tensors (tests): copies, written back with copy_.
        on_cpu = len(group.small_views) == len(buffers)
        views = group.small_views if on_cpu else {k: b.cpu().numpy() for k, b in buffers.items()}
        writes = self._host_rows(group, views, scalar_values, block, on_cpu)
        self._write_small(group, views, writes)

    def _host_rows(
        self,
        group: _Group,
        views: dict[int, np.ndarray],
        scalar_values: list[float],
        block: np.ndarray,
        uniform_allowed: bool = True,
    ) -> list[tuple[int, Any, bool]]:
        """Put the values the group's kernel reads into ``block`` and return the 0-dim
        results to write back (column, value, whether one number stands for every lane),
        in program order, without writing them: computed from ``views`` (the lanes' 0-dim
        values) and the scalars alone."""
        program = self.program
        assert group.host_fns is not None, "host values of a group built without host mode"
        every, one = group.host_fns
        values = self._uniform_host_values(one, views, scalar_values) if uniform_allowed else None
        small = [(var, k) for var, k in program.writes if program.input_small[k]]
        if values is not None:  # one number per var: every lane's row is the same
            # a row stride of 0: one row for every lane (one write with the unused values)
            block[: HOST_ROWS + len(self.host_read)] = [
                *_UNIFORM_HEAD,
                *[values[var] for var in self.host_read],
            ]
            return [(k, values[var], True) for var, k in small]
        with np.errstate(all="ignore"):
            values = every(views, scalar_values, len(group.lanes))
        width = len(self.host_read)
        block[0] = width
        rows = block[HOST_ROWS:].reshape(len(group.lanes), width)
        for j, var in enumerate(self.host_read):
            rows[:, j] = values[var]
        return [(k, values[var], False) for var, k in small]

    @staticmethod
    def _write_small(
        group: _Group, views: dict[int, np.ndarray], writes: list[tuple[int, Any, bool]]
    ) -> None:
        """Write the 0-dim results (``_host_rows``) into the lanes' tensors."""
        on_cpu = views is group.small_views
        for k, value, uniform in writes:
            if uniform:
                views[k].fill(value)
            elif on_cpu:
                np.copyto(views[k], value, casting="unsafe")
            else:
                new = np.array(np.broadcast_to(value, views[k].shape), views[k].dtype)
                group.small_buffers[k].copy_(torch.from_numpy(new))

    def stage_ahead(self, inputs: Sequence[Any]) -> tuple[torch.Tensor, np.ndarray] | None:
        """The values buffer's contents for the next call, computed now from ``inputs``'
        scalars (``ahead_inputs``: other positions may be None) and the lanes' 0-dim values
        as they are now (advanced as that call would: step counts + 1), with that buffer:
        the caller copies them in (stream-ordered before that call). The next ``prepare``
        takes them instead of computing and sending its own when its scalars, the lanes'
        0-dim values and their aliasing are what they were here (then it writes the 0-dim
        results back, as it would have); else it computes as usual. None where there is
        nothing to send ahead (no host values, not called yet, 0-dim values off the CPU)."""
        self._ahead = None
        layout, values = self._layout, self.values
        if not self.host or values is None or layout is None:
            return None
        if not all(
            g.small_buffers and len(g.small_views) == len(g.small_buffers) for g in self.groups
        ):
            return None
        try:
            scalar_values = self._scalars(inputs)
            count, size, starts = layout
            if count != len(scalar_values):
                return None
            host = np.zeros(size, dtype=np.float64)
            host[:count] = scalar_values
            seen, writes = [], []
            for group, start, length in starts:
                views = group.small_views
                seen.append(_column_bytes(views))
                block = host[start : start + length]
                writes.append(self._host_rows(group, views, scalar_values, block))
        except Exception:  # (Python's arithmetic errors: the call raises them itself)
            return None
        stream = current_stream(self.device) if self.device.type == "cuda" else None
        self._ahead = _Ahead(values, _bits(scalar_values), stream, seen, writes)
        self.ahead_staged += 1
        return values, host

    def _take_ahead(self, inputs: Sequence[Any], scalar_values: list[float]) -> bool:
        """Whether this call's values were sent ahead (``stage_ahead``) and still hold: then
        the 0-dim results are written back and nothing is computed or sent."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        if ahead.values is not self.values or ahead.scalars != _bits(scalar_values):
            return False
        if ahead.stream is not None and current_stream(self.device) is not ahead.stream:
            return False  # (the copy was queued on another stream: not ordered before us)
        layout = self._layout
        assert layout is not None
        groups = [group for group, _, _ in layout[2]]
        for group, seen in zip(groups, ahead.seen, strict=True):
            views = group.small_views
            if not group.small_buffers or not group.small.equal(inputs):
                return False
            if _column_bytes(views) != seen:
                return False
        for group, writes in zip(groups, ahead.writes, strict=True):
            self._write_small(group, group.small_views, writes)
        self.ahead_taken += 1
        return True

    @staticmethod
    def _uniform_host_values(
        one: HostFunction | None, views: dict[int, np.ndarray], scalar_values: list[float]
    ) -> dict[int, Any] | None:
        """The host vars as one Python number each, when every lane holds the same values
        (the lanes' step counts advance together unless a param joined later or a state was
        loaded), computed once with Python floats (``one``, host_function). None when the
        lanes differ (``one`` is None where they read different numbers by construction)
        or that arithmetic raised; the caller then computes every lane."""
        if one is None:
            return None
        first: dict[int, Any] = {}
        for k, view in views.items():
            head = view[:1]
            if view.tobytes() != head.tobytes() * len(view):  # bitwise: cheap, NaN-safe
                return None
            first[k] = head.item()
        try:
            return one(first, scalar_values, 1)
        except (ArithmeticError, ValueError):
            return None

    @staticmethod
    def _alias_small(group: _Group, inputs: Sequence[Any]) -> None:
        buffers: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for k, slots in group.small_slots.items():
                tensors = [inputs[i] for i in slots]
                buffer = buffers[k] = torch.stack(tensors).contiguous()
                storage = buffer.untyped_storage()
                for j, t in enumerate(tensors):
                    t.set_(storage, j, (), ())
        group.small_buffers = buffers
        group.small_views = {k: b.numpy() for k, b in buffers.items() if b.device.type == "cpu"}
        group.small.record(inputs)

    def _group_tables(
        self, g: int, group: _Group, inputs: Sequence[Any], device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """Per-lane sizes and the block -> (lane, offset) table: they depend only on shapes,
        which the entry's guards fix, so they are built once."""
        tables = self._tables.get(g)
        if tables is None:
            numels = [inputs[i].numel() for i in group.numel_slots] or [1] * len(group.lanes)
            sizes = torch.tensor(numels, dtype=torch.int64)
            block = group.block
            blocks = (sizes.clamp(min=1) + block - 1) // block  # a 0-dim lane has one block
            blk_lane = torch.repeat_interleave(torch.arange(len(numels)), blocks)
            first = torch.cumsum(blocks, 0) - blocks  # each lane's first block
            blk_start = (torch.arange(int(blocks.sum())) - first[blk_lane]) * block
            self.changes.count += 1
            tables = self._tables[g] = (
                sizes.to(device),
                blk_lane.to(device, torch.int32),
                blk_start.to(device),
            )
        return tables


_UNIFORM_HEAD = [0.0] * HOST_ROWS  # host_vals' head when every lane has the same row


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A part's next call's values, sent ahead (``_Part.stage_ahead``): into which buffer,
    from which scalars (their bits), on which stream, the lanes' 0-dim values they were
    computed from (bytes per column, per group) and the results to write back."""

    values: torch.Tensor
    scalars: bytes
    stream: Any
    seen: list[list[bytes]]
    writes: list[list[tuple[int, Any, bool]]]


def _column_bytes(views: dict[int, np.ndarray]) -> list[bytes]:
    """The lanes' 0-dim values of a group, column by column, as bytes (what values sent
    ahead were computed from)."""
    return [views[k].tobytes() for k in sorted(views)]


def _bits(values: list[float]) -> bytes:
    """The scalars' bits (``==`` would take -0.0 for 0.0, and no NaN for itself)."""
    return struct.pack(f"{len(values)}d", *values)


def _python_floats_in_double(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` for the torch backend when the kernels do not take it: the 0-dim inputs eager
    reads as Python floats (placeholder meta ``python_float``: step counts) read in float64,
    as the host computes them for the kernels (a copy of the graph; ``gm`` where there are
    none). Written back in their dtype by the graph's copy_, as before. The ops computing
    from them run once on meta tensors first: ``gm`` where one refuses the wider dtype (a
    ``lerp`` whose weight is computed from a step count)."""
    marked = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and n.meta.get("python_float") is True
        and getattr(n.meta.get("val"), "dtype", torch.float64) is not torch.float64
    ]
    if not marked:
        return gm
    graph = copy.deepcopy(gm.graph)
    names = {n.name for n in marked}
    copy_ = torch.ops.aten.copy_.default
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        with graph.inserting_after(node):
            wide = graph.call_function(
                torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float64}
            )
        wide.meta["val"] = node.meta["val"]  # (its device and dim: see reference._on_device)
        for user in list(node.users):
            if user is not wide and user.target is not copy_:
                user.replace_input_with(node, wide)
    if not _takes_double(gm, graph, names):
        return gm
    return fx.GraphModule(gm, graph)


def _takes_double(gm: fx.GraphModule, graph: fx.Graph, names: Collection[str]) -> bool:
    """Whether every op computing from the placeholders ``names`` of ``graph`` (a copy of
    ``gm``'s) takes their widened values. Those ops alone run, on meta tensors; the values
    they read from the others are as traced (``meta["val"]``, which ran them), or run too
    where a node has none. Every tensor is a meta one: an op that makes a tensor on a
    device (``torch.where``'s scalar, ``scalar_tensor(..., device='cuda:0')``) makes it on
    the meta device, and a constant is read as a meta tensor (a real CUDA tensor beside
    meta ones made the check fail on a GPU, and the torch backend then computed eager's
    Python floats from float32 step counts: RAdam's for-loop 1e-6 relative off eager on an
    H100). An ``.item()`` gives 1.0 (its value does not matter here, but Python arithmetic
    on it must not divide by zero), and so does the arithmetic computing from it."""
    cone = {n for n in graph.nodes if n.op == "placeholder" and n.name in names}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in cone for a in node.all_input_nodes):
            cone.add(node)
    computed: dict[fx.Node, Any] = {}

    def value(node: fx.Node) -> Any:
        if node not in computed:
            val: Any = node.meta.get("val")
            listed = isinstance(val, list | tuple)
            vals = val if listed else (val,)
            if node not in cone and all(isinstance(v, torch.Tensor) for v in vals):
                metas = [_meta_like(v) for v in vals]
                computed[node] = metas if listed else metas[0]
            else:  # (a Python number's node has its type's 0 as its value: run it)
                computed[node] = run(node)
        return computed[node]

    def run(node: fx.Node) -> Any:
        if node.op == "placeholder":
            return _meta_like(node.meta.get("val"))
        if node.op == "get_attr":
            return _meta_like(getattr(gm, str(node.target)))
        if node.target is torch.ops.aten._local_scalar_dense.default:
            return 1.0
        args, kwargs = fx.map_arg((node.args, node.kwargs), value)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return node.target(*args, **kwargs)  # type: ignore[operator]

    try:
        with torch.no_grad():
            for node in graph.nodes:
                if node in cone:
                    value(node)
    except Exception:  # (an op refusing the wider dtype)
        return False
    return True


def _meta_like(val: Any) -> Any:
    """A meta tensor like the traced value ``val`` (a Python scalar stays as it is)."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return val


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
                    self.split, self.prelude = split, TorchPlan(split.prelude)
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
        return [_Part(p, self.index, host_small, self.staging, self._changes) for p in programs]

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
