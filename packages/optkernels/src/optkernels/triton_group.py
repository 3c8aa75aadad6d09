"""A dtype group of a lowered plan's part: the lanes sharing one dtype signature, their
generated kernel and its address tables (rebuilt in place when an input moves).

``BufferChanges`` counts how often a plan's buffers became other tensors (shared by a plan,
its parts and their groups: ``TritonPlan.buffers_version``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from optkernels.addresses import AddressCheck
from optkernels.compressed import BLOCK as INT8_BLOCK
from optkernels.foreach_kernel import (
    KernelError,
    kernel_source,
    launch_config,
    load_kernel,
    register_limit,
)
from optkernels.host import HostFunction
from optkernels.lanes import LaneProgram
from optkernels.small_columns import Columns
from optkernels.staging import Staging


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
        self.small_columns = Columns()  # (their slots shared by lanes, refreshed each call)
        self.small = AddressCheck([i for slots in self.small_slots.values() for i in slots])

    @property
    def small_buffers(self) -> dict[int, torch.Tensor]:
        return self.small_columns.buffers

    @property
    def small_views(self) -> dict[int, np.ndarray]:
        """Numpy views of ``small_buffers`` (those on the CPU)."""
        return self.small_columns.views

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
