"""opttrace: trace optimizer steps and foreach functions into ATen graphs.

The tracer runs the real Python of a step on tracked inputs (fake tensors bound to graph
placeholders by Source, tracked containers, the optimizer seen through a tracking view) while
``torch.compiler.is_compiling()`` reports True. Every value read from the inputs installs a
guard; every store into them goes to the side-effect ledger. The result is a TracedStep:
an ``fx.GraphModule`` of ATen ops, its input Sources, a GuardSet and the resolved effects.
"""

from opttrace.errors import TraceError
from opttrace.meta import clear_cache
from opttrace.optimizer import (
    closure_reason,
    eager_only_reason,
    eager_step,
    init_state,
    trace_step,
)
from opttrace.patches import TRACE_LOCK
from opttrace.tracer import TracedStep, trace

__all__ = [
    "TRACE_LOCK",
    "TraceError",
    "TracedStep",
    "clear_cache",
    "closure_reason",
    "eager_only_reason",
    "eager_step",
    "init_state",
    "trace",
    "trace_step",
]

__version__ = "0.1.0"
