"""Which Triton this process runs, as far as the compat layer needs to know: what a Triton
whose JIT internals differ raises here (``_MISMATCH``), and the identity a record is made for
(``_installation``)."""

from __future__ import annotations

import functools
import os

# What a Triton version whose JIT internals differ from the ones used below raises here.
_MISMATCH = (AttributeError, KeyError, TypeError, ValueError, IndexError)


@functools.cache
def _installation() -> str:
    """This process's Triton: its version, its library's size and modification time, and
    the environment variables that change what it compiles (a record made by another
    Triton, or under other settings, is not used)."""
    import triton

    parts = [triton.__version__]
    try:
        from triton._C import libtriton

        stat = os.stat(str(libtriton.__file__))
        parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
    except (ImportError, OSError, *_MISMATCH):
        parts.append("?")
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        return "|".join(parts)
    parts.append(repr(sorted(get_cache_invalidating_env_vars().items())))
    return "|".join(parts)
