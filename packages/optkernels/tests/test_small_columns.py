"""optkernels.small_columns: the lanes' 0-dim inputs aliased into one buffer per column, a
tensor several slots take aliased once and copied into the others on each refresh."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optkernels.lane_program import LaneOp, LaneProgram, NotLanes
from optkernels.small_columns import alias, refuse_shared_writes


def _program(writes: list[tuple[int, int]]) -> LaneProgram:
    """Two lanes, column 0 of 0-dim inputs, column 1 full-size; ``writes``: (var, column)."""
    ops = [
        LaneOp(out=0, op="input", overload="", args=(0,), kwargs=(), small=True),
        LaneOp(out=1, op="input", overload="", args=(1,), kwargs=(), small=False),
    ]
    return LaneProgram(
        lanes=2,
        inputs=[(), ()],
        input_small=[True, False],
        scalar_inputs=[],
        scalar_nodes=[],
        ops=ops,
        writes=writes,
        num_vars=2,
    )


def test_a_tensor_several_lanes_read_takes_one_slot_and_every_lane_sees_its_change():
    lr, other, step0, step1 = (torch.tensor(v) for v in (0.1, 0.2, 1.0, 2.0))
    inputs = [lr, other, lr, step0, step1, lr]
    columns = alias({0: [0, 1, 2], 1: [3, 4, 5]}, inputs)
    np.testing.assert_array_equal(columns.views[0], np.float32([0.1, 0.2, 0.1]))
    np.testing.assert_array_equal(columns.views[1], np.float32([1.0, 2.0, 0.1]))
    # each tensor points at one slot: its first (lr: column 0, slot 0)
    assert lr.data_ptr() == columns.buffers[0].data_ptr()
    assert step1.data_ptr() == columns.buffers[1].data_ptr() + 4
    lr.fill_(0.5)  # (an LR scheduler)
    assert columns.views[0][2] == np.float32(0.1)  # not yet: another slot's copy
    columns.refresh()
    np.testing.assert_array_equal(columns.views[0], np.float32([0.5, 0.2, 0.5]))
    np.testing.assert_array_equal(columns.views[1], np.float32([1.0, 2.0, 0.5]))
    columns.views[1][:2] += 1  # (the host writing step counts back)
    assert (step0.item(), step1.item()) == (2.0, 3.0)


def test_refresh_writes_into_copies_of_device_buffers():
    """(Forced host mode reads device buffers through copies: the copies are refreshed.)"""
    lr = torch.tensor(0.1)
    columns = alias({0: [0, 0]}, [lr])
    lr.fill_(0.3)
    copies = {0: np.float32([0.3, 0.1])}
    columns.refresh(copies)
    np.testing.assert_array_equal(copies[0], np.float32([0.3, 0.3]))


def test_a_written_column_one_tensor_fills_twice_is_refused():
    with pytest.raises(NotLanes, match="each lane would write it once"):
        refuse_shared_writes(_program(writes=[(0, 0)]), {0: [3, 3]})
    refuse_shared_writes(_program(writes=[(0, 0)]), {0: [3, 4]})  # one tensor per lane
    refuse_shared_writes(_program(writes=[(1, 1)]), {0: [3, 3]})  # shared, read only
    with pytest.raises(NotLanes):  # written in one column, read in another
        refuse_shared_writes(_program(writes=[(0, 0)]), {0: [3, 4], 2: [5, 4]})
