"""optcudagraph: CUDA graph trees for compiled optimizer steps.

``tree_manager(device)`` is the per-device manager (shared memory pool, generations,
recordings, replays); ``manager.graphed(fn, name)`` turns a function of device work into
one that is warmed up, recorded once and replayed, re-recorded (with the reason) when a
static input moves. Depends on torch only.
"""

from optcudagraph.errors import CUDAGraphError
from optcudagraph.tree import (
    DEFAULT_MAX_RERECORDS,
    Graphed,
    Recording,
    TreeManager,
    reset_managers,
    tree_manager,
)

__all__ = [
    "DEFAULT_MAX_RERECORDS",
    "CUDAGraphError",
    "Graphed",
    "Recording",
    "TreeManager",
    "reset_managers",
    "tree_manager",
]

__version__ = "0.1.0"
