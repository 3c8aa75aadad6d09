"""Errors and warnings of the user API."""

from __future__ import annotations

import functools
import os
import sys
import warnings


class CompileError(RuntimeError):
    """A compile request that cannot be honoured (bad object or option); says what to pass."""


class NotCompilableError(CompileError, TypeError):
    """``compile()`` was given an object with no tensor function to trace (a module, a class,
    a scheduler); the message says what to pass instead. Also a TypeError."""


class FallbackWarning(UserWarning):
    """A compiled object runs eagerly; the message says why and what would let it compile."""


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line: the innermost caller outside
    optcompile's packages, torch and the code they generate (the line that called
    ``compile()`` or ``step()``, not a line of the library)."""
    frame = sys._getframe(1)
    level = 2  # 1 is this function, 2 its caller
    while frame.f_back is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    import optcudagraph
    import optguard
    import optkernels
    import optsidefx
    import opttrace
    import torch

    files = [m.__file__ for m in (optguard, optsidefx, opttrace, optkernels, optcudagraph, torch)]
    return tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (*files, __file__) if f)


_GENERATED = ("<optguard", "<optsidefx", "<optkernels", "<opttrace")


def _is_library(filename: str) -> bool:
    if filename.startswith(_GENERATED):
        return True
    return os.path.abspath(filename).startswith(_library_dirs())
