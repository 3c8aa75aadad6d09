"""Choosing a backend by name."""

from __future__ import annotations

from optkernels.backend import Backend
from optkernels.errors import BackendError
from optkernels.reference import TorchBackend

BACKENDS = ("torch", "triton")


def get_backend(name: str) -> Backend:
    """The backend called ``name``; raises BackendError naming the choices otherwise."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        raise BackendError(
            "backend='triton' is not available yet: the Triton foreach kernels have not "
            "landed in optkernels. Use backend='torch' (or 'auto', which picks torch for now)."
        )
    raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
