"""Errors of the side-effect layer."""


class SideEffectError(RuntimeError):
    """A side effect the compiled step cannot replay; the message names it and what to do."""
