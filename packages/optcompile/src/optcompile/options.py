"""The options of ``compile()``, checked once and kept with what they compiled."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from optguard import DEFAULT_RECOMPILE_LIMIT
from optkernels import Backend, BackendError, get_backend

from optcompile.compressed_state import state_format
from optcompile.cudagraphs import GraphedBackend
from optcompile.errors import CompileError

BACKEND_CHOICES = ("auto", "torch", "triton", "cpu")
# in_backward: gradient bytes per bucket. A bucket's update costs ~100 µs of host time alone
# and up to ~3x that inside a backward (H100 host, GPT-2); at 128 MiB of fp32 gradients its
# AdamW update moves ~0.9 GB, ~0.3 ms at an H100's bandwidth, so the device work of a bucket
# covers its host work. DDP's 25 MiB made GPT-2 124M 13 buckets (30.8 ms per iteration against
# 26.5 for one bucket); 128 MiB makes it 4 (3 of matrices, 1 of vectors), and the peak of a
# CPU run of it stays where 25 MiB's is (the gradients still freed bucket by bucket).
DEFAULT_BUCKET_BYTES = 128 * 2**20
_NAMES = (
    "backend",
    "cudagraphs",
    "fullgraph",
    "recompile_limit",
    "in_backward",
    "bucket_bytes",
    "state_dtype",
)


@dataclass(frozen=True)
class Options:
    """What the user asked ``compile()`` for, as given (``backend="auto"`` stays "auto", so a
    copy unpickled on another machine decides there). Picklable: a compiled optimizer keeps
    its Options, and its copies compile with them."""

    backend: str = "auto"
    cudagraphs: str | bool = "auto"
    fullgraph: bool = False
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT
    in_backward: bool = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    state_dtype: Any = None  # None | torch.bfloat16 | "int8" (compressed_state.py)

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise CompileError(
                f"backend={self.backend!r} is unknown; choose one of {BACKEND_CHOICES}"
            )
        mode = self.cudagraphs
        if not (mode is True or mode is False or (isinstance(mode, str) and mode == "auto")):
            raise CompileError(
                f"cudagraphs must be one of 'auto', True, False; got {self.cudagraphs!r}"
            )
        if not isinstance(self.fullgraph, bool):
            raise CompileError(f"fullgraph must be True or False; got {self.fullgraph!r}")
        limit = self.recompile_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise CompileError(f"recompile_limit must be an int >= 1; got {limit!r}")
        if not isinstance(self.in_backward, bool):
            raise CompileError(f"in_backward must be True or False; got {self.in_backward!r}")
        size = self.bucket_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise CompileError(f"bucket_bytes must be an int >= 1; got {size!r}")
        if self.in_backward and self.state_dtype is not None:
            raise CompileError(
                "state_dtype with in_backward=True is not supported yet: the updates inside "
                "backward() do not convert compressed state; drop one of them"
            )
        state_format(self.state_dtype)

    @property
    def state_format(self) -> str | None:
        """The format compressed state is stored in: None, "bf16" or "int8"."""
        return state_format(self.state_dtype)

    def backend_for(self, obj: Any) -> Backend:
        """The backend these options pick for ``obj`` (CUDA graphs wrapped around it)."""
        name, why = self.backend, "asked for"
        if name == "auto":
            name, why = auto_backend(obj)
            why = f"auto: {why}"
        try:
            chosen: Backend = get_backend(name)
        except BackendError as exc:
            raise CompileError(str(exc)) from exc
        if self.cudagraphs is not False:
            chosen = GraphedBackend(chosen, self.cudagraphs)
        _WHY[chosen] = why
        return chosen

    def differences(self, other: Options) -> list[str]:
        """``name old -> new`` for each option that differs from ``other`` (the older)."""
        return [
            f"{name} {getattr(other, name)!r} -> {getattr(self, name)!r}"
            for name in _NAMES
            if getattr(self, name) != getattr(other, name)
            or type(getattr(self, name)) is not type(getattr(other, name))
        ]


# Why each backend ``backend_for`` made was chosen (explain() prints it).
_WHY: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def backend_reason(backend: Backend) -> str:
    """Why ``backend`` (made by ``Options.backend_for``) was chosen: "asked for", or what
    ``"auto"`` saw."""
    return _WHY.get(backend, "")


def auto_backend(obj: Any) -> tuple[str, str]:
    """The backend ``"auto"`` picks for ``obj``, and why: the Triton kernels for CUDA params
    (functions: when CUDA is available); else the generated C loop nests when a C compiler
    builds them here; else the torch backend."""
    if _wants_triton(obj):
        return "triton", "the params are on a CUDA device and Triton runs there"
    on_cuda = isinstance(obj, torch.optim.Optimizer) and any(
        p.is_cuda for group in obj.param_groups for p in group["params"]
    )
    if on_cuda:
        return "torch", "the params are on a CUDA device, where Triton cannot run"
    from optkernels.cpu_backend import cpu_usable

    reason = cpu_usable()
    if reason is None:
        return "cpu", "the params are on the CPU and a C compiler builds the generated loops"
    return "torch", f"the params are on the CPU and the generated C cannot be built ({reason})"


def _wants_triton(obj: Any) -> bool:
    """ "auto": the Triton kernels when there is a CUDA device, Triton can run, and (for an
    optimizer) its params live on CUDA; otherwise the torch backend."""
    if not torch.cuda.is_available():
        return False
    from optkernels.triton_backend import triton_usable

    if triton_usable() is not None:
        return False
    if isinstance(obj, torch.optim.Optimizer):
        return any(p.is_cuda for group in obj.param_groups for p in group["params"])
    return True
