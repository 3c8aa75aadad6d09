"""CUDA graph trees: warm-up, record, replay; static inputs that move; stale outputs; a pool
shared by several graphs. Recording needs a CUDA device: those tests are skipped elsewhere
and run on the GPU machine."""

from __future__ import annotations

import pytest
import torch
from optcudagraph import CUDAGraphError, reset_managers, tree_manager

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fresh_managers():
    reset_managers()
    yield
    reset_managers()


def test_a_cpu_device_is_refused_with_the_reason():
    with pytest.raises(CUDAGraphError, match="CUDA graphs need a CUDA device, got cpu"):
        tree_manager("cpu")


@cuda
def test_warm_up_then_one_recording_then_replays_that_follow_the_inputs_contents():
    manager = tree_manager("cuda")
    x = torch.arange(4.0, device="cuda")
    calls = []

    def double():
        calls.append(1)
        return x * 2

    f = manager.graphed(double, "double")
    torch.testing.assert_close(f([x]), x * 2)  # warm-up: eager
    assert f.recordings == 0 and len(calls) == 1
    for i in range(5):
        x.fill_(float(i))
        torch.testing.assert_close(f([x]).clone(), torch.full((4,), 2.0 * i, device="cuda"))
    assert f.recordings == 1 and f.replays == 5
    assert len(calls) == 2  # the warm-up and the recording; replays run no Python
    assert manager.recordings[0].reason == "first recording"
    assert manager.describe()[0].startswith("cuda:0: 1 recording(s), 5 replay(s)")


@cuda
def test_an_output_overwritten_by_a_later_replay_raises_instead_of_showing_new_data():
    x = torch.ones(3, device="cuda")
    f = tree_manager("cuda").graphed(lambda: x + 1, "inc", warmup=0)
    first = f([x])
    kept = first.clone()
    x.fill_(5.0)
    second = f([x])
    torch.testing.assert_close(second, torch.full((3,), 6.0, device="cuda"))
    torch.testing.assert_close(kept, torch.full((3,), 2.0, device="cuda"))
    with pytest.raises(RuntimeError, match=r"output of CUDA graph #\d+ .*overwritten: replay 2"):
        first + 0


@cuda
def test_a_moved_static_input_re_records_with_the_reason_until_the_limit_then_runs_eagerly():
    holder = {"x": torch.ones(2, device="cuda")}
    f = tree_manager("cuda").graphed(lambda: holder["x"] * 3, "triple", max_rerecords=2)
    f([holder["x"]])
    f([holder["x"]])  # recorded
    for value in (2.0, 3.0, 4.0):
        holder["x"] = torch.full((2,), value, device="cuda")  # a new address
        torch.testing.assert_close(f([holder["x"]]), torch.full((2,), 3 * value, device="cuda"))
    assert f.recordings == 3
    assert (
        len(f.rerecord_reasons) == 2
        and "static input 0 ((2,) float32) moved" in (f.rerecord_reasons[0])
    )
    assert f.fallback_reason is not None and "max_rerecords=2" in f.fallback_reason
    assert any("runs without CUDA graphs" in line for line in f.manager.describe())


@cuda
def test_a_call_vouching_for_the_same_static_inputs_replays_without_comparing_them():
    x = torch.ones(2, device="cuda")
    f = tree_manager("cuda").graphed(lambda: x * 3, "triple")
    f([x], same=True)  # warm-up and recording take the static inputs as given
    f([x], same=True)
    x.copy_(torch.full((2,), 2.0))  # new contents at the same address: replayed
    torch.testing.assert_close(f([x], same=True), torch.full((2,), 6.0, device="cuda"))
    assert f.recordings == 1 and f.replays >= 2 and not f.rerecord_reasons
    moved = torch.full((2,), 5.0, device="cuda")
    f([moved])  # without the promise a moved static input is compared and re-records
    assert f.recordings == 2 and "moved" in f.rerecord_reasons[0]


@cuda
def test_two_functions_called_alternately_share_the_pool_and_each_record_once():
    manager = tree_manager("cuda")
    a = torch.ones(8, device="cuda")
    b = torch.ones(8, device="cuda")
    add = manager.graphed(lambda: a.add_(1), "add", warmup=0)
    mul = manager.graphed(lambda: b.mul_(2), "mul", warmup=0)
    for _ in range(4):
        add([a])
        mul([b])
    torch.testing.assert_close(a, torch.full((8,), 5.0, device="cuda"))
    torch.testing.assert_close(b, torch.full((8,), 16.0, device="cuda"))
    assert [r.function for r in manager.recordings] == ["add", "mul"]
    assert [r.generation for r in manager.recordings] == [1, 2]
    assert manager.replays == 8 and add.graph_id != mul.graph_id


@cuda
def test_a_re_recording_invalidates_the_outputs_of_the_earlier_generation():
    holder = {"x": torch.ones(2, device="cuda")}
    f = tree_manager("cuda").graphed(lambda: holder["x"] * 2, "double", warmup=0)
    old = f([holder["x"]])
    holder["x"] = torch.zeros(2, device="cuda")
    new = f([holder["x"]])
    torch.testing.assert_close(new, torch.zeros(2, device="cuda"))
    with pytest.raises(RuntimeError, match=r"generation 1\) .*re-recorded \(generation 2\)"):
        old.sum()


@cuda
def test_a_stale_call_re_records_with_its_reason_and_on_record_runs_before_the_replay():
    """A number baked into the recording changed (``stale``): re-recorded, not replayed.
    ``on_record`` sees what the recording allocated before its first replay runs."""
    manager = tree_manager("cuda")
    x = torch.arange(4.0, device="cuda")
    scale = [2.0]
    made: list[torch.Tensor] = []
    seen: list[int] = []

    def scaled():
        out = x * scale[0]  # the number is baked in
        made.append(out)
        return out

    f = manager.graphed(scaled, "scaled", warmup=0, on_record=lambda: seen.append(len(made)))
    torch.testing.assert_close(f([x]), x * 2)
    assert f.recordings == 1 and seen == [1]
    torch.testing.assert_close(f([x]), x * 2)  # replayed
    scale[0] = 3.0
    torch.testing.assert_close(f([x], stale="scale 2.0 -> 3.0"), x * 3)
    assert f.recordings == 2 and f.rerecord_reasons == ["scale 2.0 -> 3.0"] and seen == [1, 2]
