"""optcompile: compile optimizer steps and foreach-style functions.

``compile(optimizer)`` returns the same optimizer with a compiled ``step``; ``compile(fn)``
returns a compiled function. ``explain(obj)`` reports what happened (traces, retrace
reasons, guards, generated code); ``reset()`` drops every compiled entry.
"""

from optcompile.api import BACKEND_CHOICES, Explanation, compile, explain, reset
from optcompile.errors import CompileError, FallbackWarning

__all__ = [
    "BACKEND_CHOICES",
    "CompileError",
    "Explanation",
    "FallbackWarning",
    "compile",
    "explain",
    "reset",
]
