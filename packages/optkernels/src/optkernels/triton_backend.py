"""The Triton backend: a foreach graph runs as one generated kernel launch per dtype group.

Graphs that are not per-lane programs (``lanes.analyze`` says why) run on the torch
reference backend inside the same plan, and ``describe()`` says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from optkernels.errors import BackendError
from optkernels.foreach_kernel import (
    BLOCK,
    KernelError,
    eval_host,
    eval_scalars,
    host_vars,
    kernel_source,
    load_kernel,
)
from optkernels.lanes import LaneProgram, NotLanes, analyze
from optkernels.reference import TorchPlan


def triton_usable() -> str | None:
    """Why Triton kernels cannot run here, or None when they can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"


class _Group:
    """The lanes sharing one dtype signature: one kernel, its tables and buffers."""

    def __init__(
        self,
        program: LaneProgram,
        lanes: list[int],
        dtypes: tuple[torch.dtype, ...],
        host: dict[int, int] | None = None,
    ):
        self.lanes = lanes
        self.dtypes = dtypes
        self.name = "foreach_" + "_".join(str(d).replace("torch.", "") for d in dtypes)
        if host:
            self.name += "_host"
        self.source = kernel_source(program, dtypes, self.name, host)
        self.kernel = load_kernel(self.source, self.name)
        self.ptrs: torch.Tensor | None = None
        self.last_ptrs: list[int] = []


class TritonPlan:
    """A graph lowered to generated Triton kernels (or run by the torch backend)."""

    backend = "triton"

    def __init__(self, gm: fx.GraphModule, host_small: bool | None = None) -> None:
        """``host_small``: compute what depends only on 0-dim inputs on the host (None:
        exactly when those inputs live on the CPU and the rest on a device)."""
        self.gm = gm
        self.host_small = host_small
        self.reference = TorchPlan(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.index = {n: i for i, n in enumerate(placeholders)}
        self.program: LaneProgram | None = None
        self.reason: str | None = None
        self.groups: list[_Group] = []
        self.launches = 0
        self._checked_devices = False
        self.host = False
        self.host_order: list[int] = []
        self.host_cols: dict[int, int] = {}
        try:
            self.program = analyze(gm.graph)
            self._build(self.program)
        except (NotLanes, KernelError) as exc:
            self.program, self.reason = None, str(exc)

    def _build(self, program: LaneProgram, host: bool = False) -> None:
        by_dtypes: dict[tuple[torch.dtype, ...], list[int]] = {}
        for lane in range(program.lanes):
            dtypes = tuple(nodes[lane].meta["val"].dtype for nodes in program.inputs)
            by_dtypes.setdefault(dtypes, []).append(lane)
        self.host_order = host_vars(program) if host else []
        self.host_cols = {v: j for j, v in enumerate(self.host_order)}
        self.groups = [_Group(program, lanes, d, self.host_cols) for d, lanes in by_dtypes.items()]
        small_writes = sum(1 for _, k in program.writes if program.input_small[k])
        self.launches = len(self.groups) + (1 if small_writes and not host else 0)
        self._tables: dict[int, tuple[torch.Tensor, ...]] = {}
        self._small_writes = [(v, k) for v, k in program.writes if program.input_small[k]]

    @property
    def kernel_launches_per_step(self) -> int:
        if self.program is None:
            return self.reference.kernel_launches_per_step
        return self.launches

    def __call__(self, inputs: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        program = self.program
        if program is None:
            return self.reference(inputs)
        if len(inputs) != len(self.index):
            raise ValueError(f"graph takes {len(self.index)} inputs, got {len(inputs)}")
        tensors = [[inputs[self.index[n]] for n in nodes] for nodes in program.inputs]
        big_inputs = [k for k, small in enumerate(program.input_small) if not small] or [0]
        device = tensors[big_inputs[0]][0].device  # where the kernel runs
        if not self._checked_devices:
            self._checked_devices = True
            big = {
                t.device
                for k, lane in enumerate(tensors)
                for t in lane
                if not program.input_small[k]
            }
            small = {
                t.device for k, lane in enumerate(tensors) for t in lane if program.input_small[k]
            }
            if len(big) > 1 or (small and small != {device} and small != {torch.device("cpu")}):
                self.program = None
                self.reason = (
                    f"its tensors live on several devices ({', '.join(map(str, big | small))})"
                )
                return self.reference(inputs)
            on_host = small == {torch.device("cpu")} and device.type != "cpu"
            if self.host_small if self.host_small is not None else on_host:
                # Step counts of capturable=False optimizers stay on the CPU: what depends
                # only on them is computed there, for all lanes at once, each call.
                self._build(program, host=True)
                self.host = True
        scalars = torch.tensor(
            eval_scalars(program, inputs, self.index) or [0.0], dtype=torch.float32
        ).to(device, non_blocking=True)
        small_targets: list[torch.Tensor] = []
        small_values: list[torch.Tensor] = []
        scalar_values = eval_scalars(program, inputs, self.index) if self.host else []
        for g, group in enumerate(self.groups):
            host_vals = scalars
            if self.host:
                host_vals = self._host_values(program, group, tensors, scalar_values, device)
            numels, blk_lane, blk_start = self._group_tables(g, group, tensors, device)
            ptrs = [
                tensors[k][lane].data_ptr() for lane in group.lanes for k in range(len(tensors))
            ]
            if ptrs != group.last_ptrs or group.ptrs is None:
                group.ptrs = torch.tensor(ptrs, dtype=torch.int64).to(device, non_blocking=True)
                group.last_ptrs = ptrs
            small_out = torch.empty(
                (len(group.lanes), max(len(self._small_writes), 1)),
                dtype=torch.float32,
                device=device,
            )
            group.kernel[(blk_lane.numel(),)](
                group.ptrs, numels, blk_lane, blk_start, scalars, small_out, host_vals, BLOCK=BLOCK
            )
            if self.host:
                continue  # small results were written on the host
            for j, (_, k) in enumerate(self._small_writes):
                for row, lane in enumerate(group.lanes):
                    small_targets.append(tensors[k][lane])
                    small_values.append(small_out[row, j])
        if small_targets:
            with torch.no_grad():
                torch._foreach_copy_(small_targets, small_values)
        return ()

    def _host_values(
        self,
        program: LaneProgram,
        group: _Group,
        tensors: list[list[torch.Tensor]],
        scalar_values: list[float],
        device: torch.device,
    ) -> torch.Tensor:
        """Compute the host vars for the group's lanes on the CPU, write the 0-dim results
        back there, and return the values the kernel reads, on the device."""
        small_inputs = {
            k: torch.stack([tensors[k][lane] for lane in group.lanes])
            for k, small in enumerate(program.input_small)
            if small
        }
        with torch.no_grad():
            values = eval_host(program, self.host_order, small_inputs, scalar_values)
            for var, k in program.writes:
                if program.input_small[k]:
                    targets = [tensors[k][lane] for lane in group.lanes]
                    torch._foreach_copy_(targets, list(values[var].unbind(0)))
        columns = [values[v].to(torch.float32) for v in self.host_order] or [
            torch.zeros(len(group.lanes))
        ]
        return torch.stack(columns, dim=1).to(device, non_blocking=True)

    def _group_tables(
        self, g: int, group: _Group, tensors: list[list[torch.Tensor]], device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """Per-lane sizes and the block -> (lane, offset) table: they depend only on shapes,
        which the entry's guards fix, so they are built once."""
        tables = self._tables.get(g)
        if tables is None:
            assert self.program is not None
            big = [k for k, small in enumerate(self.program.input_small) if not small]
            numels = [tensors[big[0]][lane].numel() if big else 1 for lane in group.lanes]
            blk_lane, blk_start = [], []
            for row, n in enumerate(numels):
                for start in range(0, max(n, 1), BLOCK):
                    blk_lane.append(row)
                    blk_start.append(start)
            tables = self._tables[g] = (
                torch.tensor(numels, dtype=torch.int64, device=device),
                torch.tensor(blk_lane, dtype=torch.int32, device=device),
                torch.tensor(blk_start, dtype=torch.int64, device=device),
            )
        return tables

    def describe(self) -> str:
        if self.program is None:
            return (
                f"# not fused ({self.reason}); the torch backend runs this graph\n"
                + self.reference.describe()
            )
        header = f"# {self.launches} kernel launch(es) per step over {self.program.lanes} lanes"
        return "\n\n".join([header, *(g.source for g in self.groups)])


class TritonBackend:
    """Backend that fuses foreach graphs into generated Triton kernels."""

    name = "triton"
    wants_capturable = True

    def __init__(self) -> None:
        reason = triton_usable()
        if reason is not None:
            raise BackendError(f"backend='triton' cannot run here: {reason}")

    def compile(self, gm: fx.GraphModule) -> TritonPlan:
        return TritonPlan(gm)
