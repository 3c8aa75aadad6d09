"""TracedTensor: the storage-less tensor a traced step computes with.

A TracedTensor carries a tensor's metadata (shape, stride, dtype, device) and the graph
value it currently holds, no data; the Recorder (``recorder.py``) makes them and rebinds
them as ops write them. It also keeps what aliasing needs (``aliasing.py``): the tensors
sharing all of its value, or the base and view ops it is a partial view of.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from opttrace import _torch_compat as compat
from opttrace import meta
from opttrace.errors import TraceError
from opttrace.meta import Spec
from opttrace.view_writes import ViewStep

if TYPE_CHECKING:
    from opttrace.recorder import Recorder


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}, {value.dtype} on {value.device}"
    return f"a {type(value).__name__}"


class TracedTensor(torch.Tensor):
    """A tensor of a traced step: metadata and the graph value it holds, no storage."""

    _recorder: Recorder | None
    _spec: Spec
    _device: torch.device  # (as ``device``, without a call into torch per op)
    _layout: int  # meta.layout_id(_spec, _device): what an op's plan key holds for it
    # (The rest start as these class defaults: a tensor per op need not set them.)
    _node: fx.Node | None = None
    _item: tuple[fx.Node, int] | None = None  # (list node, index) for foreach outputs
    # Aliasing: tensors sharing all of one value (detach, alias) share one list; a partial
    # view (slice, select, reshape) knows its base and goes stale when the base is written.
    _aliases: list[TracedTensor] | None = None
    _view_of: TracedTensor | None = None
    _view_chain: tuple[ViewStep, ...] = ()  # the view ops from ``_view_of`` to this tensor
    _stale: str | None = None

    # No torch-function layer: every method call on a traced tensor would otherwise pay for
    # re-wrapping its results, and the dispatch mode records ops below it anyway.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        recorder: Recorder,
        spec: Spec,
        device: torch.device,
        requires_grad: bool = False,
        layout: int | None = None,
    ) -> TracedTensor:
        t: TracedTensor = compat.MAKE_WRAPPER(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=device,
            requires_grad=requires_grad,
        )
        t._recorder = recorder
        t._spec = spec
        t._device = device
        t._layout = meta.layout_id(spec, device) if layout is None else layout
        return t

    # (no __init__ of its own: Tensor's is object's, a C call that ignores the arguments
    # __new__ took; a Python one would cost a frame for each of a step's tensors)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TraceError(
            f"{func} was called on a traced tensor outside its trace; a traced step must not "
            "keep tensors it received (or made) past its own return"
        )

    def __getattr__(self, name: str) -> Any:
        """An attribute the tensor class lacks: one the real tensor holds in its own dict
        (``p.lr_scale = 0.5`` on a parameter), read through the trace (a float a graph
        input, another constant a guard); AttributeError otherwise, as for the real one."""
        recorder = self.__dict__.get("_recorder")
        reader = None if recorder is None or name.startswith("__") else recorder.on_attr_read
        if reader is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return reader(self, name)

    # ``.grad`` lives in the instance dict, not autograd's slot: a store to it is a side
    # effect the recorder reports (replayed on the real tensor), and the cyclic collector can
    # see the reference (autograd's slot would hide it and leak the whole trace).
    @property
    def grad(self) -> Any:
        return self.__dict__.get("_grad_value")

    @grad.setter
    def grad(self, value: Any) -> None:
        recorder = self._recorder
        if recorder is not None and recorder.on_grad_store is not None:
            recorder.on_grad_store(self, value)
        self.__dict__["_grad_value"] = value

    @property
    def data(self) -> Any:
        return compat.TENSOR_DATA.__get__(self, type(self))

    @data.setter
    def data(self, value: Any) -> None:
        """``t.data = v`` (older optimizers write a step's result so): traced as writing
        ``v``'s values into ``t``. Eager makes ``t`` share ``v``'s storage instead; only a
        later in-place write to ``v`` would tell the two apart."""
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
            self.shape,
            self.dtype,
            self.device,
        ):
            raise TraceError(
                f"the step assigns .data of a tensor ({list(self.shape)} {self.dtype}) "
                f"{_described(value)}: a tensor of the same shape, dtype and device can be "
                "traced (its values are written in place)"
            )
        with torch.no_grad():
            self.copy_(value)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        dtype = str(self.dtype).replace("torch.", "")
        return f"TracedTensor({dtype}, shape={list(self.shape)}, device={self.device})"
