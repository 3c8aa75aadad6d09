"""Choosing a backend by name."""

from __future__ import annotations

from optkernels.backend import Backend
from optkernels.errors import BackendError
from optkernels.reference import TorchBackend

BACKENDS = ("torch", "triton", "cpu")


def get_backend(name: str) -> Backend:
    """The backend called ``name``; raises BackendError naming the choices otherwise."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from optkernels.triton_backend import TritonBackend  # imports triton lazily

        return TritonBackend()
    if name == "cpu":
        from optkernels.cpu_backend import CpuBackend

        return CpuBackend()
    raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
