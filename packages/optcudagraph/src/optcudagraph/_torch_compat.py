"""The private torch APIs optcudagraph uses, in one place (a torch upgrade is one edit here).

They are the ones torch's own CUDA graph trees (``torch/_inductor/cudagraph_trees.py``) use:
a batch compare of data pointers, a storage aliasing memory it does not own, and an error
message set on a storage so that any later access to its data raises it.
"""

from __future__ import annotations

import torch

_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_poison = getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)


def data_ptrs_equal(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every i in ``indices``."""
    if _ptrs_equal is not None:
        return bool(_ptrs_equal(tensors, ptrs, indices))
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


def alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``t``'s memory with a storage object of its own (not owning the
    memory), so that it can be invalidated without touching ``t``."""
    storage = t.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(alias_storage, t.storage_offset(), t.shape, t.stride())
    return out


def can_invalidate() -> bool:
    return _poison is not None


def invalidate(t: torch.Tensor, message: str) -> None:
    """Make any later access to ``t``'s data raise ``message``."""
    if _poison is not None:
        _poison(t.untyped_storage()._cdata, message)  # the StorageImpl's address
