"""A plan's prelude (the ops the torch backend runs before the kernels: Muon's matmuls, LAMB's
norms) as part of the plan's CUDA graph.

A recorded graph bakes in every address its ops read and every Python number they take. So:

- the step's tensors the prelude reads whose addresses the entry's guards fix (params,
  state) are read in place; the others (grads, a new tensor every step after
  ``zero_grad(set_to_none=True)``) are copied each call, before the replay, into buffers of
  the plan's own (one ``_foreach_copy_``), which the graph reads;
- the Python numbers the prelude reads (Muon's momentum and Newton-Schulz coefficients, a
  max norm) are compared each call with those recorded: a change re-records the graph
  (``stale``), with the reason;
- its results and temporaries are allocated while recording, in the graph's memory pool;
  the plan keeps the results alive (the kernels read them through their address tables, the
  deferred writes after the replay copy them into the inputs).

A prelude that reads a value with ``.item()`` (a host sync), a CPU tensor (a copy from host
memory the graph would bake in), runs a collective (DTensor's all-reduce of a norm: NCCL
inside a captured graph is not something this package has shown safe) or a random op is not
recorded: ``reason`` says which op, and the plan runs without a graph.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import fx

from optkernels.layouts import Layouts, with_prelude

# Namespaces of collective ops (functional collectives, what DTensor's rules record).
_COLLECTIVES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")


def capture_reason(prelude: fx.GraphModule, device: torch.device) -> str | None:
    """Why ``prelude``'s ops cannot be recorded in a CUDA graph of ``device``'s work, or
    None."""
    elsewhere = device.type != "cpu"  # (a CPU tensor read beside device tensors)
    for node in prelude.graph.nodes:
        if node.op == "get_attr":
            value = getattr(prelude, str(node.target), None)
            if (
                elsewhere
                and isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and node.users
            ):
                return f"its torch-backend ops read the CPU tensor constant {node.name}"
        if node.op == "placeholder" and node.users:
            val = node.meta.get("val")
            if elsewhere and isinstance(val, torch.Tensor) and val.device.type == "cpu":
                return (
                    f"its torch-backend ops read the CPU tensor {node.name} (a graph would "
                    "bake in its host copy; keep such values on the device, e.g. "
                    "capturable=True)"
                )
        if node.op != "call_function":
            continue
        target = node.target
        if target is torch.ops.aten._local_scalar_dense.default:
            return f"its torch-backend ops read a tensor's value on the host (.item(): {node.name})"
        namespace = getattr(target, "namespace", None)
        if namespace in _COLLECTIVES:
            return (
                f"its torch-backend ops run the collective {node.name} (collectives are kept "
                "out of CUDA graphs)"
            )
        tags = getattr(target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            return f"its torch-backend ops draw random numbers ({node.name})"
    return None


class PreludeCapture:
    """The graph-side state of one plan's prelude (see module)."""

    def __init__(self, prelude: Any, layouts: Layouts, num_inputs: int) -> None:
        self.prelude = prelude  # a TorchPlan of the prelude graph
        self.layouts = layouts
        self.num_inputs = num_inputs
        placeholders = [n for n in prelude.gm.graph.nodes if n.op == "placeholder"]
        read = [(i, n) for i, n in enumerate(placeholders) if n.users]
        self.tensor_reads = [i for i, n in read if isinstance(n.meta.get("val"), torch.Tensor)]
        self.scalar_reads = [i for i, n in read if i not in set(self.tensor_reads)]
        self.copied: list[int] = list(self.tensor_reads)  # refined by ``guard``
        self.statics: list[torch.Tensor] = []  # the copies the graph reads, by ``copied``
        self.scalars: tuple[Any, ...] | None = None  # the numbers recorded
        self.inputs: list[Any] = []  # what the prelude runs on (this call's)
        self.results: list[torch.Tensor] = []  # the kernels' extra inputs (laid out)
        self.raw: tuple[torch.Tensor, ...] = ()  # the prelude's results (for write_back)

    def guard(self, guarded: Collection[int]) -> None:
        """Inputs whose addresses the caller's guards fix are read in place."""
        self.copied = [i for i in self.tensor_reads if i not in guarded]
        self.statics = []

    def prepare(self, inputs: Sequence[Any]) -> None:
        """Before a replay: the copies of the unguarded tensors the prelude reads."""
        if not self.statics and self.copied:
            self.statics = [_empty_like_strided(inputs[i]) for i in self.copied]
        launch = list(inputs)
        if self.copied:
            sources = [inputs[i] for i in self.copied]
            with torch.no_grad():
                torch._foreach_copy_(self.statics, sources)
            for i, static in zip(self.copied, self.statics, strict=True):
                launch[i] = static
        self.inputs = launch

    def stale(self, inputs: Sequence[Any]) -> str | None:
        """Why the recorded graph took other numbers than this call's, or None (the numbers
        are remembered: the caller re-records)."""
        scalars = tuple(inputs[i] for i in self.scalar_reads)
        recorded, self.scalars = self.scalars, scalars
        if recorded is None or recorded == scalars:
            return None
        changed = [
            f"input {i}: {a!r} -> {b!r}"
            for i, a, b in zip(self.scalar_reads, recorded, scalars, strict=True)
            if a != b
        ]
        return "the Python numbers its torch-backend ops take changed (" + ", ".join(changed) + ")"

    def run(self) -> list[torch.Tensor]:
        """The prelude on the prepared inputs: the kernels' extra inputs (kept: recorded,
        they live in the graph's pool and every replay rewrites them)."""
        full, self.raw = with_prelude(self.prelude, self.layouts, self.inputs)
        self.results = full[self.num_inputs :]
        return self.results


def _empty_like_strided(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
