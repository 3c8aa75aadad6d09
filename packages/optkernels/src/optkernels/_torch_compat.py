"""The private torch APIs optkernels uses, in one place (a torch upgrade is one edit here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# C++ batch compare of data pointers (what torch's CUDA graph trees use to check static
# inputs); present in CUDA builds of torch. ~100 ns per tensor (pybind casts).
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def data_ptrs_equal(tensors: Sequence[Any], ptrs: list[int], indices: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every i in ``indices`` (``tensors``
    may hold other values at other positions)."""
    if _ptrs_equal is not None:
        return bool(_ptrs_equal(tensors, ptrs, indices))
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


_STREAMS: dict[Any, Any] = {}


def current_stream(device: torch.device) -> Any:
    """``torch.cuda.current_stream(device)`` without a new Stream object per call (building
    one costs more than the rest of recording an event)."""
    data = torch._C._cuda_getCurrentStream(device.index)  # (stream id, device index, type)
    stream = _STREAMS.get(data)
    if stream is None:
        stream = _STREAMS[data] = torch.cuda.Stream(  # type: ignore[no-untyped-call]
            stream_id=data[0], device_index=data[1], device_type=data[2]
        )
    return stream


def direct_call(target: Any) -> Any:
    """The C++ callable behind an ATen OpOverload (``OpOverload.__call__`` only forwards to
    it: ~0.4 us less per call, which a loop over thousands of lanes pays each time)."""
    op = getattr(target, "_op", None) if isinstance(target, torch._ops.OpOverload) else None
    return op if callable(op) else target


_FAKE_MODE: Any = None


def fake_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with metadata and no storage (for ``node.meta["val"]`` of nodes a rewrite
    adds): a FakeTensor of one shared mode."""
    global _FAKE_MODE
    from torch._subclasses.fake_tensor import FakeTensorMode

    if _FAKE_MODE is None:
        _FAKE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
    with _FAKE_MODE:
        return torch.empty(tuple(shape), dtype=dtype, device=device)


def capturing() -> bool:
    """Whether the current CUDA stream is recording a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
