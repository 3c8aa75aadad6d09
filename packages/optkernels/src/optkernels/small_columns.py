"""The lanes' 0-dim inputs as one buffer per column, for the host to read and write.

Where the host computes a lane program's values (step counts on the CPU), each column of
0-dim inputs (one tensor per lane: ``small_slots``) is made to alias one buffer, slot ``j``
for lane ``j`` (``set_``: the same tensor objects, values, dtype and shape): the host then
reads and writes every lane through a numpy view of it instead of stacking and copying the
tensors each call.

A tensor that is an input of several lanes (a group's tensor lr, read by each of its params;
one tensor given for two columns) can point at one slot only: it is aliased at the first
slot it takes, and every other slot it fills copies that slot on each call (``refresh``), so
a change in place (an LR scheduler's ``fill_``) reaches every lane. Such a tensor in a column
the program writes is refused (``refuse_shared_writes``): eager would write it once per lane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from optkernels.lane_program import LaneProgram, NotLanes


def refuse_shared_writes(program: LaneProgram, small_slots: dict[int, list[int]]) -> None:
    """Raise NotLanes where a 0-dim tensor the program writes is an input of several lanes
    (a step count shared by params: eager advances it once per param, the lanes would
    write it once in all) or of another column too (its slot there would be a copy: the
    write must land in the tensor)."""
    written = {k for _, k in program.writes if program.input_small[k]}
    for k in written & small_slots.keys():
        slots = set(small_slots[k])
        elsewhere = any(slots & set(s) for m, s in small_slots.items() if m != k)
        if len(slots) < len(small_slots[k]) or elsewhere:
            raise NotLanes(
                "one 0-dim tensor the step writes is an input of several lanes (a state "
                "tensor shared by parameters): each lane would write it once"
            )


@dataclass
class Columns:
    """Each column's buffer (``buffers``), numpy views of those on the CPU (``views``) and
    the slots that copy another one each call (``shared``: (column, slots, source column,
    source slots))."""

    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    views: dict[int, np.ndarray] = field(default_factory=dict)
    shared: list[tuple[int, np.ndarray, int, np.ndarray]] = field(default_factory=list)

    def refresh(self, views: dict[int, np.ndarray] | None = None) -> None:
        """Copy each shared tensor's slot into the other slots it fills, in ``views`` (the
        buffers' numpy views; copies of device buffers where the host reads those)."""
        views = self.views if views is None else views
        for k, slots, source, source_slots in self.shared:
            if k in views and source in views:
                views[k][slots] = views[source][source_slots]


def alias(small_slots: dict[int, list[int]], inputs: Sequence[Any]) -> Columns:
    """Alias each column's tensors (``inputs`` at ``small_slots``) into one buffer (see the
    module), and refresh the shared slots."""
    columns = Columns()
    first: dict[int, tuple[int, int]] = {}  # id(tensor) -> (column, slot) it points at
    pairs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    with torch.no_grad():
        for k, slots in small_slots.items():
            tensors = [inputs[i] for i in slots]
            if len({t.dtype for t in tensors}) > 1:  # (stack would convert: set_ misreads)
                raise ValueError(f"0-dim inputs of several dtypes in one column: {tensors}")
            buffer = columns.buffers[k] = torch.stack(tensors).contiguous()
            storage = buffer.untyped_storage()
            for j, t in enumerate(tensors):
                seen = first.get(id(t))
                if seen is None:
                    first[id(t)] = (k, j)
                    t.set_(storage, j, (), ())
                else:
                    to, source = pairs.setdefault((k, seen[0]), ([], []))
                    to.append(j)
                    source.append(seen[1])
    columns.views = {k: b.numpy() for k, b in columns.buffers.items() if b.device.type == "cpu"}
    columns.shared = [
        (k, np.array(to), source, np.array(from_)) for (k, source), (to, from_) in pairs.items()
    ]
    columns.refresh()
    return columns
