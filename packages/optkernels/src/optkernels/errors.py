"""Errors of the kernel layer."""


class BackendError(RuntimeError):
    """A graph a backend cannot run, or a backend that is unknown or unavailable here."""


class KernelError(Exception):
    """The lane program uses something the generator cannot emit."""
