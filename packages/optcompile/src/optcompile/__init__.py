"""optcompile: compile optimizer steps and foreach-style functions.

``compile(optimizer)`` returns the same optimizer with a compiled ``step``; ``compile(fn)``
returns a compiled function; ``compile(optimizer, in_backward=True)`` runs the
update inside ``loss.backward()``, and ``accumulate(optimizer)`` holds it back for
micro-batches. ``explain(obj)`` reports what happened (traces, retrace
reasons, guards, generated code); ``reset()`` drops every compiled entry. ``set_logs`` (or
``$OPTCOMPILE_LOGS``) prints the ``optcompile.*`` loggers' topics.
"""

from optcompile.api import BACKEND_CHOICES, compile, explain, reset
from optcompile.backward import accumulate
from optcompile.errors import CompileError, FallbackWarning, NotCompilableError
from optcompile.explanation import Explanation
from optcompile.logs import TOPICS as LOG_TOPICS
from optcompile.logs import set_logs, set_logs_from_env

__version__ = "0.1.0"

__all__ = [
    "BACKEND_CHOICES",
    "LOG_TOPICS",
    "CompileError",
    "Explanation",
    "FallbackWarning",
    "NotCompilableError",
    "__version__",
    "accumulate",
    "compile",
    "explain",
    "reset",
    "set_logs",
]

set_logs_from_env()
