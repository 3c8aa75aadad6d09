"""Errors of the kernel layer."""


class BackendError(RuntimeError):
    """A graph a backend cannot run, or a backend that is unknown or unavailable here."""
