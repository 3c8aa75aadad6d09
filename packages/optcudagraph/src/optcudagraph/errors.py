"""Errors raised by optcudagraph."""


class CUDAGraphError(RuntimeError):
    """A CUDA graph cannot be recorded or replayed here; the message says why."""
