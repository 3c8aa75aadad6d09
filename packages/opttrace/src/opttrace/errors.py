"""Errors of the tracing layer."""

from __future__ import annotations


class TraceError(RuntimeError):
    """The tracer cannot capture this step; the message names the file, line and reason.

    ``where`` is ``"file:line"`` of the user (or torch.optim) code that did it, when known.
    """

    def __init__(self, reason: str, where: str | None = None) -> None:
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)
