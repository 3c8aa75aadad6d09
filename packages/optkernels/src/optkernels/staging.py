"""Host -> device copies of a plan's small buffers (scalars, host-computed values, address
tables) without stalling the host.

A copy from pageable memory makes the host wait; from pinned memory it is queued on the
stream like a kernel, and the host goes on at once. The catch: the pinned source must not be
rewritten until the device has read it. Each buffer therefore has a pool of pinned sources,
one per slot; a round (one ``prepare`` of a plan) takes a slot and writes it in every buffer
it refreshes. Rather than one event per round (recording one cost the host about as much as
the copy), a round records an event after its copies only when the oldest copy no event
covers yet is ``EVERY - 1`` rounds old (or the stream changed). Slots are taken back in the
order their rounds ran, and a round never waits for the device (a step inside backward must
keep the stream fed): the oldest slot in flight is taken back when the first event recorded
at or after its copy is done (queried once: an event covers the copies of consecutive rounds
on one stream, those since the event before it); when it is not, the pool doubles (every
buffer gets new pinned sources for the new slots, one allocation each). Normally the copy is
long done (the host would have to run ``SLOTS - EVERY`` rounds ahead of the device), and a
host that does run further ahead (a device-bound loop, a deep launch queue) keeps as many
slots as it is rounds ahead, allocated once (the CUDA driver's launch queue bounds that: a
launch blocks once the queue is full, and a round is at least one copy and one launch; the
driver may make the allocation itself wait for the device, once per doubling):
``queries`` counts the events queried, ``grown`` the times the pool doubled. Device buffers
keep their addresses from call to call: a recorded CUDA graph reads them.

The copy itself is queued through the CUDA driver where it can be (optguard's native
``h2d``, handed in like the address checks: ``addresses.native_module``; well under 1 µs of
host time instead of ``copy_``'s ~10), else with ``copy_``. torch's pinned-memory allocator
then records no event of its own: a ring whose copies it did not see waits for its stream
before its pinned memory goes back to that allocator (``_Ring.native``).

On a CPU device (the Triton interpreter) the values are written into the buffer directly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

from optkernels._torch_compat import current_stream
from optkernels.addresses import native_module

SLOTS = 16  # a pool's first size
EVERY = 4  # at most SLOTS: the event covering a slot's copy is recorded before its reuse


class Staging:
    """The pinned staging pools of one plan; ``begin()`` / ``end()`` bracket a round."""

    def __init__(self) -> None:
        self.round = 0
        self.slot = 0
        self.events_recorded = 0
        self.slots = SLOTS  # the pool's size (every ring has this many pinned sources)
        self._free = list(range(SLOTS - 1, -1, -1))  # slots no copy reads (taken from the end)
        # (slot, round) of the rounds with copies, oldest first, until their slot is taken
        # back (their copies done).
        self._in_flight: deque[tuple[int, int]] = deque()
        self._copied = False  # whether this round queued a copy
        # (first, last, event): the event was recorded after the copies of rounds first to
        # last (on its stream; earlier ones are covered by earlier events).
        self._covers: deque[tuple[int, int, Any]] = deque()
        self._done = (0, -1)  # rounds whose copies the device has done (an event found done)
        # False once a round copied on two streams: its copies then lie under two events,
        # and each round checks its own.
        self._one_stream_rounds = True
        self.queries = 0  # events queried (each a driver call that does not wait)
        self.grown = 0  # times the pool doubled (the device that far behind)
        self._spare: list[Any] = []  # events no slot waits for any more
        self._uncovered: int | None = None  # the first round with copies no event covers
        self._last_copy = 0  # the last round with a copy
        self._stream: Any = None  # where the uncovered copies were queued
        self._rings: dict[int, _Ring] = {}
        self.sends = 0  # copies queued (CUDA buffers)
        self.native_sends = 0  # those queued through the CUDA driver (the rest: copy_)

    def begin(self) -> None:
        if _HELD:
            _drain_held()
        self.round += 1
        self._copied = False
        self.slot = self._free.pop() if self._free else self._take_back()

    def end(self) -> None:
        """Put the round's slot in flight (or back, without copies); record an event if the
        oldest uncovered copy is due one (see the module)."""
        if self._copied:
            self._in_flight.append((self.slot, self.round))
            self._copied = False
        elif self.slot not in self._free:
            self._free.append(self.slot)
        if self._uncovered is not None and self.round - self._uncovered >= EVERY - 1:
            self._cover()

    def stage(
        self,
        buffer: torch.Tensor | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """``buffer`` (a new device buffer when it has another shape or dtype) and the host
        array to write its new values into this round; ``send(buffer)`` copies them over.
        The array holds stale values: write all of it."""
        if buffer is not None:
            ring = self._rings.get(id(buffer))
            if ring is not None and ring.buffer is buffer and ring.fits(shape, dtype):
                return buffer, ring.arrays[self.slot]  # the usual call
        if buffer is None or tuple(buffer.shape) != shape or buffer.dtype != dtype:
            if buffer is not None:
                self._rings.pop(id(buffer), None)  # replaced: its ring goes with it
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        if device.type != "cuda":
            return buffer, buffer.numpy()
        ring = self._rings[id(buffer)] = _Ring(buffer, shape, dtype, self.slots)
        return buffer, ring.arrays[self.slot]

    def send(self, buffer: torch.Tensor) -> None:
        """Queue the copy of this round's host array (``stage``) into ``buffer``, on the
        current stream (one stream per round: a plan's ``prepare`` runs no user code)."""
        if buffer.device.type != "cuda":
            return  # written in place
        stream = current_stream(buffer.device)
        if self._uncovered is not None and stream is not self._stream:
            if self._last_copy == self.round:
                self._one_stream_rounds = False
            self._cover()  # the earlier copies went to another stream: cover them there
        ring = self._rings[id(buffer)]
        self.sends += 1
        if ring.native(stream, self.slot):
            self.native_sends += 1
        else:
            buffer.copy_(ring.pinned[self.slot], non_blocking=True)
        self._copied = True
        self._last_copy = self.round
        if self._uncovered is None:
            self._uncovered, self._stream = self.round, stream

    def upload(
        self,
        buffer: torch.Tensor | None,
        values: list[int] | list[float],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """``values`` in a device buffer: ``buffer`` when it has their length (its address
        stays), else a new one (one value, 0, for none)."""
        buffer, host = self.stage(buffer, (max(len(values), 1),), dtype, device)
        host[...] = values if values else 0
        self.send(buffer)
        return buffer

    def _take_back(self) -> int:
        """The oldest slot in flight once its copies are done, else a new one (the pool
        doubled)."""
        if not self._in_flight:  # (every slot held by rounds not ended)
            return self._grow()
        slot, written = self._in_flight[0]
        first, last = self._done
        done = self._one_stream_rounds and first <= written <= last
        if not done and not self._device_done(written):
            return self._grow()
        self._in_flight.popleft()
        return slot

    def _grow(self) -> int:
        """Double the pool: new pinned sources in every ring; one of the new slots."""
        added = range(self.slots, 2 * self.slots)
        for ring in self._rings.values():
            ring.grow(len(added))
        self.slots += len(added)
        self._free.extend(reversed(added))
        self.grown += 1
        return self._free.pop()

    def _cover(self) -> None:
        event = self._spare.pop() if self._spare else torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        first = self._uncovered if self._uncovered is not None else self._last_copy
        self._covers.append((first, self._last_copy, event))
        self.events_recorded += 1
        self._uncovered = self._stream = None

    def _device_done(self, written: int) -> bool:
        """Whether the device has done the copies of round ``written`` (never waits)."""
        covers = self._covers
        while covers and covers[0][1] < written:  # older: no slot needs them any more
            self._spare.append(covers.popleft()[2])
        if not covers:  # the round was never closed (an error between begin and end)
            self._cover()
        first, last, event = covers[0]
        self.queries += 1
        if not event.query():
            return False
        self._done = (first, last)
        return True


class _Ring:
    """The pinned sources of one device buffer, one per slot, with numpy views of them."""

    def __init__(
        self, buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, slots: int
    ) -> None:
        self.buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self.pinned: list[torch.Tensor] = []
        self.arrays: list[np.ndarray] = []
        self._srcs: list[int] = []
        self.grow(slots)
        self._dst = buffer.data_ptr()  # the device buffer keeps its address (see Staging)
        self._nbytes = buffer.numel() * buffer.element_size()
        self._device = buffer.device.index if buffer.device.index is not None else 0
        self._streams: list[Any] = []  # the streams its driver copies were queued on
        self._handle = 0  # the cudaStream_t of the last of them

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return shape == self.shape and dtype == self.dtype

    def grow(self, count: int) -> None:
        """``count`` more slots: one pinned allocation, a view of it per slot."""
        block = torch.zeros((count, *self.shape), dtype=self.dtype, pin_memory=True)
        added = list(block.unbind(0))
        self.pinned.extend(added)
        self.arrays.extend(p.numpy() for p in added)
        self._srcs.extend(p.data_ptr() for p in added)

    def native(self, stream: Any, slot: int) -> bool:
        """Queue the copy of ``slot`` into the buffer on ``stream`` through the CUDA driver;
        False when it was not queued (the caller uses ``copy_``). torch's pinned-memory
        allocator does not see such a copy: the ring's pinned tensors are held until
        ``stream`` has done everything queued when the ring goes (``_drain``)."""
        module = native_module()
        if module is None:
            return False
        streams = self._streams
        if not streams or streams[-1] is not stream:  # (by identity: current_stream's)
            if not any(s is stream for s in streams):
                weakref.finalize(self, _drain, stream, self.pinned)
            streams[:] = [*(s for s in streams if s is not stream), stream]
            self._handle = stream.cuda_stream
        return module.h2d(self._dst, self._srcs[slot], self._nbytes, self._handle, self._device)


def _drain(stream: Any, pinned: list[Any]) -> None:
    """Wait for ``stream`` (its copies from ``pinned`` included) before ``pinned`` is freed:
    its allocator would hand the memory out again at once. While this thread captures a CUDA
    graph, waiting would break the capture: ``pinned`` is held until a later round runs
    outside one (``_drain_held``)."""
    # (an error: the process is exiting, or the device failed; nothing left to protect)
    with contextlib.suppress(Exception):
        if torch.cuda.is_current_stream_capturing():
            _HELD.append((stream, pinned))
            return
        stream.synchronize()


# Pinned memory of rings dropped during a capture, with the stream to wait for (see _drain).
_HELD: list[tuple[Any, list[Any]]] = []


def _drain_held() -> None:
    with contextlib.suppress(Exception):
        if torch.cuda.is_current_stream_capturing():
            return
    held = _HELD[:]
    _HELD.clear()
    for stream, pinned in held:
        _drain(stream, pinned)
