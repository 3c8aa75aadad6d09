"""Host -> device copies of a plan's small buffers (scalars, host-computed values, address
tables) without stalling the host.

A copy from pageable memory makes the host wait; from pinned memory it is queued on the
stream like a kernel, and the host goes on at once. The catch: the pinned source must not be
rewritten until the device has read it. Each buffer therefore has a ring of ``SLOTS`` pinned
sources; a round (one ``prepare`` of a plan) writes slot ``k`` of every buffer it refreshes
and records one event after its copies, and the round that comes back to slot ``k`` waits
for that event first (normally long past). Device buffers keep their addresses from call to
call: a recorded CUDA graph reads them.

On a CPU device (the Triton interpreter) the values are copied directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from optkernels._torch_compat import current_stream

SLOTS = 4


class Staging:
    """The pinned staging rings of one plan; ``begin()`` / ``end()`` bracket a round."""

    def __init__(self) -> None:
        self.slot = 0
        self.events: list[Any] = [None] * SLOTS
        self._rings: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[Any]]] = {}
        self._copied = False

    def begin(self) -> None:
        self.slot = (self.slot + 1) % SLOTS
        event = self.events[self.slot]
        if event is not None:
            event.synchronize()
        self._copied = False

    def end(self, device: torch.device) -> None:
        if self._copied:
            event = self.events[self.slot]
            if event is None:
                event = self.events[self.slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(current_stream(device))

    def upload(
        self, buffer: torch.Tensor | None, values: Any, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``values`` (a list of numbers, a numpy array or a CPU tensor) in a device buffer:
        ``buffer`` when it has their shape (its address stays), else a new one."""
        array = values if isinstance(values, np.ndarray) else None
        host = values if isinstance(values, torch.Tensor) else None
        if array is not None:
            shape: tuple[int, ...] = array.shape
        else:
            shape = tuple(host.shape) if host is not None else (max(len(values), 1),)
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype:
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        if device.type != "cuda":
            if array is not None:
                host = torch.from_numpy(array)
            source = host if host is not None else torch.tensor(values or [0], dtype=dtype)
            buffer.copy_(source)
            return buffer
        ring = self._rings.get(id(buffer))
        if ring is None or ring[0] is not buffer:
            pinned = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(SLOTS)]
            ring = self._rings[id(buffer)] = (buffer, pinned, [p.numpy() for p in pinned])
        pinned_slot = ring[1][self.slot]
        if host is not None:
            pinned_slot.copy_(host)
        elif array is not None or values:
            ring[2][self.slot][:] = values
        buffer.copy_(pinned_slot, non_blocking=True)
        self._copied = True
        return buffer
