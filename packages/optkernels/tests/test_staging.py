"""Staging: host values into device buffers that keep their addresses, through pinned rings
on CUDA (the stress tests run on a CUDA machine) and in place on the CPU."""

from __future__ import annotations

import pytest
import torch
from optkernels.addresses import AddressCheck
from optkernels.staging import EVERY, SLOTS, Staging

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_on_the_cpu_values_are_written_into_the_buffer_which_keeps_its_address():
    staging = Staging()
    cpu = torch.device("cpu")
    staging.begin()
    buffer = staging.upload(None, [1.0, 2.0, 3.0], torch.float32, cpu)
    staging.end()
    assert buffer.tolist() == [1.0, 2.0, 3.0]
    staging.begin()
    same, host = staging.stage(buffer, (3,), torch.float32, cpu)
    host[:] = [4.0, 5.0, 6.0]
    staging.send(same)
    staging.end()
    assert same is buffer and buffer.tolist() == [4.0, 5.0, 6.0]
    assert staging.upload(buffer, [7, 8], torch.int64, cpu) is not buffer  # another shape
    assert staging.upload(None, [], torch.int64, cpu).tolist() == [0]  # none: one zero


def test_address_checks_without_a_native_module_use_torch():
    inputs = [torch.randn(2), 1.0, torch.randn(3)]
    check = AddressCheck([2, -1, 0])
    assert not check.equal(inputs)
    assert check.record(inputs) == [inputs[2].data_ptr(), 0, inputs[0].data_ptr()]
    assert check.equal(inputs)
    assert not check.equal(inputs[:2])  # another length
    inputs[0].set_(torch.randn(4))
    assert not check.equal(inputs)


def _busy(device: torch.device, matmuls: int = 4) -> None:
    """Keep the device busy (~2 ms per matmul on an H200), so the host runs ahead of it."""
    a = torch.randn(4096, 4096, device=device)
    for _ in range(matmuls):
        a = a @ a / 4096


def _rounds(staging: Staging, rounds: int, device: torch.device, busy: int = 0) -> torch.Tensor:
    """``rounds`` rounds each sending its number; what each round's kernels would read. With
    ``busy``, the device is kept busy that many matmuls after the first round (which makes
    the pinned memory: allocating it may wait for the device)."""
    history = torch.zeros(rounds, 64, device=device)
    buffer = None
    for r in range(rounds):
        staging.begin()
        buffer, host = staging.stage(buffer, (64,), torch.float32, device)
        host[:] = float(r)
        staging.send(buffer)
        staging.end()
        history[r].copy_(buffer)  # what the kernels of round r would read
        if r == 0 and busy:
            _busy(device, busy)
    torch.cuda.synchronize()
    return history


def _expected(rounds: int, device: torch.device) -> torch.Tensor:
    return torch.arange(rounds, dtype=torch.float32, device=device)[:, None].expand(-1, 64)


@CUDA
def test_the_host_running_far_ahead_never_overwrites_a_copy_the_device_has_not_done():
    device = torch.device("cuda")
    staging = Staging()
    rounds = 5 * SLOTS
    history = _rounds(staging, rounds, device, busy=40)
    torch.testing.assert_close(history, _expected(rounds, device), rtol=0, atol=0)
    assert staging.events_recorded <= rounds // EVERY + 1  # not one per round
    assert staging.queries <= rounds  # (an event found done: the rounds it covers skip it)
    # No slot still being read was written: the pool grew to as many slots as the host ran
    # rounds ahead (doubling: a few allocations), and keeps them.
    assert staging.grown > 0 and staging.slots > SLOTS, (staging.grown, staging.slots)
    slots, grown = staging.slots, staging.grown
    history = _rounds(staging, rounds, device)  # the device keeping up: slots taken back
    torch.testing.assert_close(history, _expected(rounds, device), rtol=0, atol=0)
    assert (staging.slots, staging.grown) == (slots, grown), (staging.slots, staging.grown, slots)


def test_a_round_without_copies_gives_its_slot_back():
    staging = Staging()
    for _ in range(3 * SLOTS):
        staging.begin()
        staging.upload(None, [1.0], torch.float32, torch.device("cpu"))  # (written in place)
        staging.end()
    assert staging.slots == SLOTS and staging.grown == 0


@CUDA
def test_rounds_alternating_between_streams_never_overwrite_a_copy_not_done():
    device = torch.device("cuda")
    staging = Staging()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    rounds = 4 * SLOTS
    history = torch.zeros(rounds, 16, device=device)
    buffers: list[torch.Tensor | None] = [None, None]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    for r in range(rounds):
        k = (r // 3) % 2  # three rounds on one stream, then three on the other
        with torch.cuda.stream(streams[k]):
            if r % 7 == 0:
                _busy(device)
            staging.begin()
            buffer, host = staging.stage(buffers[k], (16,), torch.float32, device)
            buffers[k] = buffer
            host[:] = float(r)
            staging.send(buffer)
            staging.end()
            history[r].copy_(buffer)
    torch.cuda.synchronize()
    expected = torch.arange(rounds, dtype=torch.float32, device=device)[:, None].expand(-1, 16)
    torch.testing.assert_close(history, expected, rtol=0, atol=0)
    assert staging.queries <= rounds
