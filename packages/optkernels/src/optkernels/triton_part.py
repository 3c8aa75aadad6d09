"""A lowered plan's part: one independent lane program, its dtype groups' kernels, and the
host side of its calls (scalars and host-computed 0-dim values staged into device buffers,
the lanes' 0-dim CPU tensors aliased to one buffer per column, values of the next call sent
ahead: ``stage_ahead`` / ``_take_ahead``).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from optkernels._torch_compat import current_stream
from optkernels._triton_compat import Kernel
from optkernels.dtypes import lanes_by_dtypes
from optkernels.foreach_kernel import KernelError
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
from optkernels.host_rows import Write, fill_rows, write_results
from optkernels.lanes import LaneProgram, NotLanes
from optkernels.numbers import HOST_ONLY, PICK
from optkernels.small_columns import alias
from optkernels.staging import Staging
from optkernels.triton_group import BufferChanges, _Group


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(count: int) -> int:
    """``count`` float64 values rounded up to 16 bytes (what Triton assumes of pointers)."""
    return -(-count // 2) * 2


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
        self.small_on_cpu = False  # some 0-dim input lives on the CPU (set by check_devices)
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
        if not tensors or not tensors[big_inputs[0]]:
            return "its lane program reads no tensor"
        device = tensors[big_inputs[0]][0].device
        big = {
            t.device for k, lane in enumerate(tensors) for t in lane if not program.input_small[k]
        }
        small = {t.device for k, lane in enumerate(tensors) for t in lane if program.input_small[k]}
        self.small_on_cpu = torch.device("cpu") in small
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

    def restage_scalars(self, inputs: Sequence[Any]) -> None:
        """The scalars alone, sent where they changed (a part without host values; inside a
        staging round of the plan)."""
        scalar_values = self._scalars(inputs)
        if scalar_values != self._scalar_values:
            self._scalar_values = scalar_values
            self._stage_values(inputs, scalar_values)

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
        group.small_columns.refresh(views)  # (a tensor lr several lanes read: each its copy)
        writes = self._host_rows(group, views, scalar_values, block, on_cpu)
        self._write_small(group, views, writes)

    def _host_rows(
        self,
        group: _Group,
        views: dict[int, np.ndarray],
        scalar_values: list[float],
        block: np.ndarray,
        uniform_allowed: bool = True,
    ) -> list[Write]:
        """Put the values the group's kernel reads into ``block`` and return the 0-dim
        results to write back (column, value, whether one number stands for every lane),
        in program order, without writing them: computed from ``views`` (the lanes' 0-dim
        values) and the scalars alone."""
        program = self.program
        assert group.host_fns is not None, "host values of a group built without host mode"
        every, one = group.host_fns
        small = [(var, k) for var, k in program.writes if program.input_small[k]]
        lanes = len(group.lanes)
        one = one if uniform_allowed else None
        return fill_rows(one, every, views, scalar_values, lanes, self.host_read, small, block)

    @staticmethod
    def _write_small(group: _Group, views: dict[int, np.ndarray], writes: list[Write]) -> None:
        """Write the 0-dim results (``_host_rows``) into the lanes' tensors."""
        if views is group.small_views:  # (on the CPU)
            write_results(views, writes)
            return
        for k, value, uniform in writes:
            if uniform:
                views[k].fill(value)
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
                group.small_columns.refresh()
                seen.append(_column_bytes(views))
                block = host[start : start + length]
                writes.append(self._host_rows(group, views, scalar_values, block))
        except Exception:  # (Python's arithmetic errors: the call raises them itself)
            return None
        stream = current_stream(self.device) if self.device.type == "cuda" else None
        self._ahead = _Ahead(values, _bits(scalar_values), stream, seen, writes)
        self.ahead_staged += 1
        return values, host

    def ahead_columns(self) -> list[tuple[torch.Tensor, bytes, bytes]] | None:
        """The values sent ahead (``stage_ahead``) as CPU columns: each column buffer, the
        bytes they were computed from, the bytes the call writes into it; None if none."""
        ahead, layout = self._ahead, self._layout
        if ahead is None or layout is None:
            return None
        found = []
        for (group, _, _), seen, writes in zip(layout[2], ahead.seen, ahead.writes, strict=True):
            views = group.small_views
            after = {k: v.copy() for k, v in views.items()}
            write_results(after, writes)
            for k, old in zip(sorted(views), seen, strict=True):
                found.append((group.small_buffers[k], old, after[k].tobytes()))
        return found

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
            group.small_columns.refresh()
            if _column_bytes(views) != seen:
                return False
        for group, writes in zip(groups, ahead.writes, strict=True):
            self._write_small(group, group.small_views, writes)
        self.ahead_taken += 1
        return True

    @staticmethod
    def _alias_small(group: _Group, inputs: Sequence[Any]) -> None:
        group.small_columns = alias(group.small_slots, inputs)
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


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A part's next call's values, sent ahead (``_Part.stage_ahead``): into which buffer,
    from which scalars (their bits), on which stream, the lanes' 0-dim values they were
    computed from (bytes per column, per group) and the results to write back."""

    values: torch.Tensor
    scalars: bytes
    stream: Any
    seen: list[list[bytes]]
    writes: list[list[Write]]


def _column_bytes(views: dict[int, np.ndarray]) -> list[bytes]:
    """The lanes' 0-dim values of a group, column by column, as bytes (what values sent
    ahead were computed from)."""
    return [views[k].tobytes() for k in sorted(views)]


def _bits(values: list[float]) -> bytes:
    """The scalars' bits (``==`` would take -0.0 for 0.0, and no NaN for itself)."""
    return struct.pack(f"{len(values)}d", *values)
