"""optkernels: backends that run traced ATen graphs of optimizer steps.

A Backend compiles an ``fx.GraphModule`` of ATen ops (placeholders in, trailing ``copy_``
writebacks, outputs out) into a Plan called with the graph's inputs. The torch reference
backend runs the ops eagerly and is the ground truth; Triton foreach kernels build on the same
contract. This layer knows nothing of tracing or guards.
"""

from optkernels.addresses import use_native_addresses
from optkernels.backend import Backend, Plan
from optkernels.errors import BackendError
from optkernels.reference import TorchBackend, TorchPlan
from optkernels.registry import BACKENDS, get_backend

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "Plan",
    "TorchBackend",
    "TorchPlan",
    "get_backend",
    "use_native_addresses",
]

__version__ = "0.1.0"
