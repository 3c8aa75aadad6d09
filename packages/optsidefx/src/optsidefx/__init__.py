"""optsidefx: the side-effect ledger and the code that replays it after a compiled step.

The tracer records into a Ledger every store to an existing object (with the containers the
step created and kept), every in-place write to an input tensor and the returned value. After the
trace, the ledger is pruned and resolved; tensor writes become trailing ``copy_`` nodes of the
graph and everything else becomes a generated ``replay(L, outs)`` function.
"""

from optsidefx.errors import SideEffectError
from optsidefx.ledger import (
    Apply,
    AttrStore,
    Build,
    Call,
    CallResult,
    Const,
    Effect,
    Input,
    ItemStore,
    Ledger,
    Output,
    Ref,
    Return,
    TensorWrite,
)
from optsidefx.replay import Replay, generate_replay
from optsidefx.writeback import append_writebacks

__all__ = [
    "Apply",
    "AttrStore",
    "Build",
    "Call",
    "CallResult",
    "Const",
    "Effect",
    "Input",
    "ItemStore",
    "Ledger",
    "Output",
    "Ref",
    "Replay",
    "Return",
    "SideEffectError",
    "TensorWrite",
    "append_writebacks",
    "generate_replay",
]

__version__ = "0.1.0"
