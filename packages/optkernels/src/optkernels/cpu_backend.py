"""The CPU backend: a foreach graph runs as generated C loop nests, one call per step.

Each lane program (``lanes.analyze_parts``: the programs the Triton backend fuses) becomes
one C function per dtype group (``c_kernel``), compiled once by the system C compiler and
cached on disk. A call computes the Python scalars and, for every lane at once, what
depends only on step counts (``host.host_function``, in float64 as eager's Python floats),
refreshes the address tables of tensors that moved, and calls the functions through ctypes:
OpenMP threads (``torch.get_num_threads()`` of them) take (lane, block) items, and each
element of a parameter, its grad and its state is read and written once. Ops the generator
does not know run on the torch backend first (``split.split_unfused``, as on Triton);
graphs that are not lane programs, or tensors off the CPU, run wholly on the torch backend
(batched), and ``describe()`` says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from optkernels.addresses import AddressCheck
from optkernels.backend import Plan
from optkernels.c_chains import fuse_chains
from optkernels.c_kernel import (
    Compiler,
    build,
    find_compiler,
    function,
    kernel_source,
    library_source,
)
from optkernels.c_norms import use_c_norms
from optkernels.double_scalars import _python_floats_in_double
from optkernels.dtypes import lanes_by_dtypes
from optkernels.errors import BackendError
from optkernels.foreach_kernel import KernelError
from optkernels.host import (
    HOST_ROWS,
    host_dtypes,
    host_function,
    host_reads,
    host_vars,
    picks_differ,
    scalar_function,
)
from optkernels.host_rows import fill_rows, write_results
from optkernels.lanes import LaneProgram, NotLanes, analyze_parts
from optkernels.layouts import layouts, relaid, with_prelude, write_back
from optkernels.reference import PAGE_VALUES, TorchBackend, TorchPlan, node_by_node, values_per_op
from optkernels.small_columns import Columns, alias, refuse_shared_writes
from optkernels.split import Split, split_unfused

log = logging.getLogger("optcompile.kernels")

# Elements per work item: large enough that an item's setup is noise, small enough that a
# few large tensors still spread over every thread. A call uses one thread per BLOCK
# elements at most (as ATen's grain size does): waking a thread costs microseconds on an
# idle machine and a scheduler time slice (milliseconds) on a loaded one.
BLOCK = 1 << 15


def cpu_usable() -> str | None:
    """Why the CPU backend cannot run here, or None when it can."""
    found = find_compiler()
    return found if isinstance(found, str) else None


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


class _Part:
    """One lane program: its C functions (one per dtype group), its address tables, its
    work items, and the host-side state of its 0-dim values (step counts)."""

    def __init__(self, program: LaneProgram, index: dict[Any, int], compiler: Compiler):
        if all(program.input_small):
            raise NotLanes("every lane input is 0-dim (the host computes such steps)")
        for column, small in zip(program.inputs, program.input_small, strict=True):
            # (the host computes 0-dim inputs with numpy: no bf16; only those columns looked at)
            if small and any([n.meta["val"].dtype == torch.bfloat16 for n in column]):
                raise NotLanes("a 0-dim bfloat16 input the host would compute with")
            if small and len({n.meta["val"].dtype for n in column}) > 1:
                raise NotLanes(  # (the Triton backend groups its lanes by these dtypes)
                    "the lanes' 0-dim inputs of one column differ in dtype (ASGD's eta of "
                    "float32 and float64 params after load_state_dict): the host reads each "
                    "column as one array"
                )
        self.program = program
        self.index = index
        self._scalars = scalar_function(program, index)
        order = host_vars(program)
        self.host_read = host_reads(program, order)
        columns = {v: j for j, v in enumerate(self.host_read)}
        host: dict[int, int | None] = {v: columns.get(v) for v in order}
        rounding = host_dtypes(program, order)
        self._host_fn = host_function(program, order, False, rounding)
        self._host_fn_uniform = (  # (None where the lanes read different numbers by design)
            None
            if picks_differ(program, range(program.lanes))
            else host_function(program, order, True, rounding)
        )
        self.dynamic = [
            not all([n.meta.get("static_address", False) for n in column])
            for column in program.inputs
        ]
        by_dtypes = lanes_by_dtypes(program)
        self.groups = [(dtypes, lanes) for (dtypes, _), lanes in by_dtypes.items()]
        self.sources = [
            kernel_source(program, dtypes, f"k{g}", host, self.dynamic, lanes[0])
            for g, (dtypes, lanes) in enumerate(self.groups)
        ]
        started = time.perf_counter()
        library = build(compiler, library_source(self.sources))
        self.build_seconds = time.perf_counter() - started
        self.functions = [function(library, f"k{g}") for g in range(len(self.groups))]

        def slots(columns: list[int]) -> list[int]:
            return [
                -1 if program.input_small[k] else index[program.inputs[k][lane]]
                for lane in range(program.lanes)
                for k in columns
            ]

        self.static = AddressCheck(slots([k for k, d in enumerate(self.dynamic) if not d]))
        self._static_written = False
        self.dynamic_check = AddressCheck(slots([k for k, d in enumerate(self.dynamic) if d]))
        self.ptrs = np.zeros(max(len(self.static.indices), 1), dtype=np.int64)
        self.dptrs = np.zeros(max(len(self.dynamic_check.indices), 1), dtype=np.int64)
        self.small_slots = {
            k: [index[n] for n in nodes]
            for k, nodes in enumerate(program.inputs)
            if program.input_small[k]
        }
        self.small = AddressCheck([i for s in self.small_slots.values() for i in s])
        self.columns = Columns()  # (their numpy views: what the host reads and writes)
        width = len(self.host_read)
        self.host_vals = np.zeros(HOST_ROWS + max(program.lanes * width, 1), dtype=np.float64)
        self.scalars = np.zeros(max(len(program.scalar_inputs) + len(program.scalar_nodes), 1))
        self.items: list[np.ndarray] = []  # per group: (lane, start, end) rows, from shapes
        self._calls: list[tuple[Any, ...]] = []

    def guard(self, guarded: frozenset[int]) -> None:
        """Stop comparing the static addresses of the inputs at ``guarded`` (the caller
        checks them before every call: ``CpuPlan.guarded_addresses``)."""
        slots = self.static.indices
        self.static = AddressCheck(slots, {i for i in slots if i >= 0 and i not in guarded})
        self._static_written = False

    def _work(self, inputs: Sequence[Any]) -> None:
        """The work items of each group, built once (the entry's guards fix the shapes)."""
        program = self.program
        big = next(k for k, small in enumerate(program.input_small) if not small)
        for g, (_, lanes) in enumerate(self.groups):
            rows = []
            total = 0
            for lane in lanes:
                numel = inputs[self.index[program.inputs[big][lane]]].numel()
                rows += [(lane, s, min(s + BLOCK, numel)) for s in range(0, numel, BLOCK)]
                total += numel
            items = np.array(rows or [(0, 0, 0)], dtype=np.int64).reshape(-1, 3)
            self.items.append(items)
            self._calls.append(
                (
                    self.functions[g],
                    _address(self.ptrs),
                    _address(self.dptrs),
                    _address(items),
                    len(rows),
                    _address(self.scalars),
                    _address(self.host_vals),
                    -(-total // BLOCK),  # the most threads worth waking
                )
            )

    def run(self, inputs: Sequence[Any]) -> None:
        if not self._calls:
            self._work(inputs)
        self.scalars[: len(self.scalars)] = self._scalars(inputs) or [0.0]
        if self.small_slots:
            self._host_values(inputs)
        elif self.host_read:
            self._uniform_or_rows({}, list(self.scalars))
        static = self.static
        if not self._static_written or (static.compared and not static.equal(inputs)):
            self.ptrs[: len(static.indices)] = static.record(inputs)
            self._static_written = True
        if not self.dynamic_check.equal(inputs):
            self.dptrs[: len(self.dynamic_check.indices)] = self.dynamic_check.record(inputs)
        threads = torch.get_num_threads()
        for fn, *args, most in self._calls:
            fn(*args, min(threads, most))

    def _host_values(self, inputs: Sequence[Any]) -> None:
        """The host vars of every lane, from the 0-dim inputs (step counts), which are made
        to alias one CPU buffer per column (small_columns: the same tensor objects, values,
        dtype and shape; a tensor re-pointed since is aliased again), read and written
        through numpy views of it; and the rows the kernels read, in ``host_vals``."""
        if not self.columns.views or not self.small.equal(inputs):
            self.columns = alias(self.small_slots, inputs)
            self.small.record(inputs)
        else:
            self.columns.refresh()
        self._uniform_or_rows(self.columns.views, list(self.scalars))

    def _uniform_or_rows(self, views: dict[int, np.ndarray], scalars: list[float]) -> None:
        program = self.program
        small = [(var, k) for var, k in program.writes if program.input_small[k]]
        one, lanes = self._host_fn_uniform, program.lanes
        rows = fill_rows(
            one, self._host_fn, views, scalars, lanes, self.host_read, small, self.host_vals
        )
        write_results(views, rows)


def _torch_plan(gm: fx.GraphModule, compiler: Compiler) -> Plan:
    """The torch backend's plan of a graph that is not a lane program (Adafactor's). Where
    its tensors are large (PAGE_VALUES values or more per op node) node by node: the results
    the step makes are written in place as eager writes them (``reinplace``), where the
    batched plan allocates each (fresh pages cost more than the op on them), and column
    norms run in C (``c_norms``); elsewhere batched, where the calls are the cost."""
    per_op = values_per_op(gm)
    if per_op < PAGE_VALUES:
        return TorchBackend().compile(gm)
    reason = (
        f"its tensors hold {per_op} values per op: ops run in place, "
        "column norms in C (optkernels.c_norms), elementwise chains in C (optkernels.c_chains)"
    )

    def rewrite(graph: fx.Graph) -> None:  # on node_by_node's copy: one copy of the graph
        use_c_norms(graph)
        fuse_chains(graph, compiler)

    return node_by_node(gm, reason, rewrite)


class CpuPlan:
    """A graph lowered to generated C loop nests (or run by the torch backend)."""

    backend = "cpu"

    def __init__(self, gm: fx.GraphModule, compiler: Compiler) -> None:
        self.gm = gm
        self.compiler = compiler
        # (found through the graph's node index: a large step has tens of nodes per input)
        placeholders = gm.graph.find_nodes(op="placeholder")
        self.num_inputs = len(placeholders)
        self.parts: list[_Part] = []
        self.reason: str | None = None
        self.split: Split | None = None
        self.prelude: TorchPlan | None = None
        self.layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.fallback: Plan | None = None
        off_cpu = sorted(
            {
                str(n.meta["val"].device)
                for n in placeholders
                if isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].device.type != "cpu"
            }
        )
        try:
            if off_cpu:
                raise NotLanes(f"its tensors live on {', '.join(off_cpu)}, not the CPU")
            self.parts = self._lower(gm.graph)
        except (NotLanes, KernelError) as exc:
            self.parts, self.reason = [], str(exc)
            split = None if off_cpu else split_unfused(gm)
            if split is not None:
                try:
                    self.parts = self._lower(split.main_graph)
                except (NotLanes, KernelError):
                    self.parts = []
                else:
                    prelude = _python_floats_in_double(split.prelude, outputs_as_recorded=True)
                    self.split, self.prelude = split, TorchPlan(prelude)
        if not self.parts:
            # (step counts read in float64, as the host computes them for the loop nests
            # and eager's Python floats are: the capturable path's float32 counts would
            # round a float64 param's bias corrections to float32)
            self.fallback = _torch_plan(_python_floats_in_double(gm), compiler)

    def _lower(self, graph: fx.Graph) -> list[_Part]:
        index = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
        programs = analyze_parts(graph)
        self.layouts = layouts(programs, index, self.num_inputs)
        parts = [_Part(p, index, self.compiler) for p in programs]
        for part in parts:
            refuse_shared_writes(part.program, part.small_slots)
        return parts

    @property
    def build_seconds(self) -> float:
        """Time spent compiling (or loading from the disk cache) this plan's C."""
        return sum(part.build_seconds for part in self.parts)

    @property
    def kernel_launches_per_step(self) -> int:
        if self.fallback is not None:
            return self.fallback.kernel_launches_per_step
        launches = sum(len(part.functions) for part in self.parts)
        if self.prelude is not None and self.split is not None:
            launches += self.prelude.kernel_launches_per_step + (1 if self.split.writes else 0)
            launches += relaid(self.layouts, self.split.main)
        return launches

    def guarded_addresses(self, indices: Collection[int]) -> None:
        """The caller checks, before every call, that the inputs at ``indices`` keep the
        addresses they had on the first (optcompile: the entry's data-pointer guards): the
        static address tables stop comparing them (grads and the rest still are)."""
        guarded = frozenset(indices)
        for part in self.parts:
            part.guard(guarded)

    def __call__(self, inputs: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        if self.fallback is not None:
            return self.fallback(inputs)
        if len(inputs) != self.num_inputs:
            raise ValueError(f"graph takes {self.num_inputs} inputs, got {len(inputs)}")
        inputs, results = with_prelude(self.prelude, self.layouts, inputs)
        for part in self.parts:
            part.run(inputs)
        if self.split is not None:
            write_back(self.split.writes, inputs, results)
        return ()

    def describe(self) -> str:
        if not any(n.op == "call_function" for n in self.gm.graph.nodes):
            return "# no tensor work in this step (no parameter has a gradient): nothing runs"
        if self.fallback is not None:
            return (
                f"# not fused ({self.reason}); the torch backend runs this graph\n"
                + self.fallback.describe()
            )
        lanes = " + ".join(str(part.program.lanes) for part in self.parts)
        nests = sum(len(part.functions) for part in self.parts)
        after = ""
        if self.prelude is not None:
            after = f", after {self.prelude.kernel_launches_per_step} torch op(s)"
        sections = [
            f"# {nests} C loop nest(s) per step over {lanes} lanes{after} "
            f"({self.compiler.version}, OpenMP; built or loaded in {self.build_seconds:.2f} s)"
        ]
        if self.split is not None and self.prelude is not None:
            ops = sorted({str(n.target) for n in self.split.unfused})
            sections.append(
                f"# partly fused: {', '.join(ops)} not an op the kernel generator knows; "
                "the torch backend runs them and what they depend on first:\n"
                + self.prelude.describe()
            )
        return "\n\n".join([*sections, *(s for part in self.parts for s in part.sources)])


class CpuBackend:
    """Backend that fuses foreach graphs into generated C (OpenMP) for CPU tensors."""

    name = "cpu"
    wants_capturable = True

    def __init__(self) -> None:
        found = find_compiler()
        if isinstance(found, str):
            raise BackendError(f"backend='cpu' cannot run here: {found}")
        self.compiler = found

    def compile(self, gm: fx.GraphModule) -> CpuPlan:
        plan = CpuPlan(gm, self.compiler)
        if log.isEnabledFor(logging.INFO):
            notes = [ln[2:] for ln in plan.describe().splitlines() if ln.startswith("# ")]
            log.info("cpu backend: %s", "; ".join(notes[:2]))
        return plan
