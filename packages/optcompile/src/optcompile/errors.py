"""Errors and warnings of the user API."""


class CompileError(RuntimeError):
    """A compile request that cannot be honoured (bad object or option); says what to pass."""


class FallbackWarning(UserWarning):
    """A compiled object runs eagerly; the message says why and what would let it compile."""
