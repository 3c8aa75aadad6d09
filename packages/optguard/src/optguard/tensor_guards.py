"""Guards on tensors: their metadata, their storage address, and memory they must not share.

``TensorMatchGuard`` (type, dtype, device, layout, shape, stride, requires_grad, as a
``TensorMeta``), ``DataPtrGuard`` (the address a graph baked in) and ``DisjointGuard`` (inputs
a graph writes share no memory), with the memory-span arithmetic the last one uses.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optguard.codegen import SourceCode
from optguard.guard import Guard, type_hint
from optguard.sources import Source


@dataclass(frozen=True)
class TensorMeta:
    """What a compiled entry assumes about a tensor input."""

    cls: type
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    layout: torch.layout = field(default=torch.strided)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            type(t),
            t.dtype,
            t.device,
            tuple(t.shape),
            tuple(t.stride()),
            t.requires_grad,
            t.layout,
        )

    def diff(self, t: Any) -> str | None:
        """The first field where ``t`` differs, as ``"dtype (float32 -> bfloat16)"``."""
        if not isinstance(t, torch.Tensor):
            return f"is no longer a tensor ({type(t).__qualname__})"
        found = TensorMeta.of(t)
        for name in ("cls", "dtype", "device", "layout", "shape", "stride", "requires_grad"):
            old, new = getattr(self, name), getattr(found, name)
            if old != new:
                show = (lambda c: c.__qualname__) if name == "cls" else str
                return f"{'type' if name == 'cls' else name} changed ({show(old)} -> {show(new)})"
        return None


@dataclass(frozen=True)
class TensorMatchGuard(Guard):
    """A tensor with the same type, dtype, device, layout, shape, stride and requires_grad."""

    meta: TensorMeta

    def test(self, var: str, code: SourceCode) -> str:
        m = self.meta
        hints = _META_HINTS.get((m.cls, m.dtype, m.device, m.layout))
        if hints is None:
            hints = _meta_hints(m)
        cls = code.constant(m.cls, hints[0])
        dtype = code.constant(m.dtype, hints[1])
        device = code.constant(m.device, hints[2])
        layout = code.constant(m.layout, hints[3])
        return (
            f"(type({var}) is {cls} and {var}.dtype is {dtype} and {var}.device == {device}"
            f" and {var}.shape == {code.inline(m.shape, 'shape')}"
            f" and {var}.stride() == {code.inline(m.stride, 'stride')}"
            f" and {var}.requires_grad is {m.requires_grad} and {var}.layout is {layout})"
        )

    def expected(self) -> str:
        m = self.meta
        grad = ", requires_grad" if m.requires_grad else ""
        return (
            f"is {m.cls.__name__}({str(m.dtype).replace('torch.', '')}, {m.device}, "
            f"shape={list(m.shape)}, stride={list(m.stride)}{grad})"
        )

    def changed(self, value: Any) -> str:
        return self.meta.diff(value) or super().changed(value)


# The names of a tensor metadata's constants in generated code, by (cls, dtype, device,
# layout): 10,000 params' metadata guards name the same few.
_META_HINTS: dict[tuple[Any, ...], tuple[str, str, str, str]] = {}


def _meta_hints(m: TensorMeta) -> tuple[str, str, str, str]:
    hints = (
        type_hint(m.cls),
        str(m.dtype).replace("torch.", ""),
        f"{m.device.type}_device",
        str(m.layout).replace("torch.", ""),
    )
    return _META_HINTS.setdefault((m.cls, m.dtype, m.device, m.layout), hints)


@dataclass(frozen=True)
class DataPtrGuard(Guard):
    """A tensor's storage address is unchanged: graphs that bake addresses in (CUDA graphs,
    static kernel tables) depend on it."""

    ptr: int

    def test(self, var: str, code: SourceCode) -> str:
        # A named constant, not a literal: the generated text (and its compiled code, cached
        # on disk by text) is then the same in every process.
        return f"{var}.data_ptr() == {code.constant(self.ptr, 'ptr')}"

    def holds(self, value: Any) -> bool:
        # (its test, without compiling one per address: an entry has one per pinned tensor)
        return bool(value.data_ptr() == self.ptr)

    def expected(self) -> str:
        return f"has data pointer {self.ptr:#x}"

    def changed(self, value: Any) -> str:
        try:
            return f"data pointer changed ({self.ptr:#x} -> {value.data_ptr():#x})"
        except Exception:
            return super().changed(value)


@dataclass(frozen=True)
class DisjointGuard(Guard):
    """The tensors at ``source`` and ``others`` occupy disjoint memory. A graph reads all its
    inputs before it writes any, where eager writes them one after another: inputs it
    writes must not share memory (two arguments ``f(x, x)``, a view of another)."""

    others: tuple[Source, ...]

    def test(self, var: str, code: SourceCode) -> str:
        return f"{code.constant(disjoint, 'disjoint')}({code.tuple_of(self.sources())})"

    def expected(self) -> str:
        return f"shares no memory with {self._others()}"

    def _others(self) -> str:
        names = [o.name() for o in self.others[:3]]
        more = len(self.others) - len(names)
        return ", ".join(names) + (f" or {more} more" if more else "")

    def fetch(self, L: Any) -> Any:
        return tuple(s.fetch(L) for s in self.sources())

    def sources(self) -> tuple[Source, ...]:
        return (self.source, *self.others)

    def holds(self, value: Any) -> bool:
        return disjoint(value)

    def changed(self, value: Any) -> str:
        return f"shares memory with one of {self._others()}"


def disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of ``tensors`` reach a common byte (see ``overlapping``)."""
    return overlapping(tensors) is None


def overlapping(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The positions of two of ``tensors`` that reach a common byte (lower address first),
    or None. Conservatively: by the span from each one's first to its last element, so interleaved
    views count as sharing. Spans are compared as addresses: distinct allocations never
    overlap (CUDA's unified addressing keeps device and host pointers apart)."""
    spans = sorted(
        [(span, i) for i, span in enumerate(map(memory_span, tensors)) if span[0] < span[1]]
    )
    for (a, i), (b, j) in itertools.pairwise(spans):
        if b[0] < a[1]:
            return (i, j)
    return None


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of what ``t`` reaches; empty for no elements."""
    start = t.data_ptr()
    if t.dim() == 0:
        return (start, start + t.element_size())
    if t.numel() == 0:
        return (start, start)
    stride = t.stride()  # (sum of (n - 1) * s, without a Python call per dimension)
    extent = sum(map(operator.mul, t.shape, stride)) - sum(stride) + 1
    return (start, start + extent * t.element_size())
