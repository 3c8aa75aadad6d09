"""The private torch APIs optkernels uses, in one place (a torch upgrade is one edit here)."""

from __future__ import annotations

import torch

# C++ batch compare of data pointers (what torch's CUDA graph trees use to check static
# inputs); present in CUDA builds of torch.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def data_ptrs_equal(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every i in ``indices``."""
    if _ptrs_equal is not None:
        return bool(_ptrs_equal(tensors, ptrs, indices))
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)
