"""Per-tensor ATen ops as foreach ops: how the batched plan runs a family in one call.

``foreach_form`` maps a family (one per-tensor op over every lane) to the ``_foreach_*`` op of
the same semantics for its argument kinds, where torch has one: on the CPU a foreach op runs
the per-tensor op on each tensor, so the results are bit for bit those of running the
family's nodes one by one (tests/test_batched.py checks each form in four dtypes).
``can_run_in_place`` says whether the in-place form computes the same too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from optkernels.families import Arg, BatchedOp, is_python
from optkernels.reference import _LOW_PRECISION, same_layout_copy

aten = torch.ops.aten


def is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


# Per-tensor unary ops whose foreach form runs them tensor by tensor.
_UNARY = {
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1",
    "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
}  # fmt: skip


@dataclass(frozen=True)
class Form:
    """A family as one call of ``_foreach_{name}``: ``overload`` "List"/"default" (tensor
    lists, ``kwargs``), "Scalar" (then ``.Scalar`` or ``.ScalarList`` by whether ``scalar``
    is one number or one per lane) or "ScalarAndTensor" (``scalar`` first)."""

    name: str
    overload: str
    lanes: int
    tensors: tuple[Arg, ...]
    scalar: Arg | None = None
    kwargs: tuple[tuple[str, Arg], ...] = ()


def foreach_form(op: BatchedOp) -> Form | None:
    """The family ``op`` as one foreach call; None where torch has no foreach op of the same
    semantics for these argument kinds."""
    name, _, overload = getattr(op.target, "__name__", "").partition(".")
    kinds = [kind_of(a) for a in op.args]
    kw = dict(op.kwargs)
    lanes, args = op.lanes, op.args
    tensor_args = len(kinds) == 2 and all(k in ("T", "t") for k in kinds) and "T" in kinds
    scalar_second = len(kinds) == 2 and kinds[0] == "T" and kinds[1] in ("c", "S")
    if name in _UNARY and overload == "default" and kinds == ["T"] and not kw:
        return Form(name, "default", lanes, args)
    if name in ("add", "sub", "mul", "div") and overload in ("Tensor", "Scalar"):
        alpha = kw.pop("alpha", None)
        if kw or (alpha is not None and kind_of(alpha) != "c"):
            return None
        if tensor_args:
            extra = (("alpha", alpha),) if alpha is not None else ()
            return Form(name, "List", lanes, args, kwargs=extra)
        if scalar_second and alpha is None:
            return Form(name, "Scalar", lanes, args[:1], args[1])
        return None
    if name in ("addcmul", "addcdiv") and overload == "default":
        return _addc_form(op)
    if kw:
        return None
    if name in ("maximum", "minimum") and overload == "default" and tensor_args:
        return Form(name, "List", lanes, args)
    if name in ("clamp_min", "clamp_max", "pow"):
        if overload in ("Tensor", "Tensor_Tensor") and tensor_args:
            return Form(name, "List", lanes, args)
        if overload in ("default", "Tensor_Scalar") and scalar_second:
            return Form(name, "Scalar", lanes, args[:1], args[1])
        if name == "pow" and overload == "Scalar" and kinds == ["c", "T"]:
            return Form(name, "ScalarAndTensor", lanes, args[1:], args[0])
        return None
    if name == "lerp" and len(kinds) == 3 and kinds[:2] == ["T", "T"]:
        if overload == "Tensor" and kinds[2] in ("T", "t"):
            return Form(name, "List", lanes, args)
        if overload == "Scalar" and kinds[2] in ("c", "S"):
            return Form(name, "Scalar", lanes, args[:2], args[2])
        return None
    return None


def _addc_form(op: BatchedOp) -> Form | None:
    """``addcmul``/``addcdiv(self, t1, t2, value=v)`` as ``_foreach_addc*.Scalar``."""
    kinds = [kind_of(a) for a in op.args]
    kw = dict(op.kwargs)
    value = kw.pop("value", ("const", 1))
    if kinds != ["T", "T", "T"] or kw or kind_of(value) not in ("c", "S"):
        return None
    name = op.target.__name__.partition(".")[0]
    return Form(name, "Scalar", op.lanes, op.args, value)


# In-place foreach ops whose CPU kernels round float16/bfloat16 differently from their
# functional forms (a Scalar rounded to the dtype first, ``reference._as_eager_ran``): the
# batched plan runs them only where eager did.
_ROUNDS_IN_PLACE = frozenset({aten._foreach_mul_.Scalar, aten._foreach_mul_.ScalarList})


def can_run_in_place(op: BatchedOp, form: Form | None) -> bool:
    """Whether ``op`` has an in-place foreach form on its first argument that computes what
    eager computed: for a foreach node recorded from an in-place op, that op itself (the
    batched plan runs it, in place or on copies: ``eager_op``); otherwise one that rounds as
    the functional op does."""
    low = any(getattr(v, "dtype", None) in _LOW_PRECISION for v in _vals(op))
    if op.kind == "foreach":
        node = op.nodes[0]
        if node.meta.get("inplace") is not None:
            return True
        name, _, overload = op.target.__name__.partition(".")
        packet = getattr(aten, f"{name}_", None)
        if packet is None or overload not in packet.overloads():
            return False
        return not (getattr(packet, overload) in _ROUNDS_IN_PLACE and low)
    if op.kind != "family" or form is None or form.overload == "ScalarAndTensor":
        return False
    packet = getattr(aten, f"_foreach_{form.name}_", None)
    needed = ("Scalar", "ScalarList") if form.overload == "Scalar" else (form.overload,)
    if packet is None or not all(o in packet.overloads() for o in needed):
        return False
    return not (low and any(getattr(packet, o) in _ROUNDS_IN_PLACE for o in needed))


def _vals(op: BatchedOp) -> list[Any]:
    """The values ``op`` computes (per lane, per item)."""
    out: list[Any] = []
    for node in op.nodes:
        val = node.meta.get("val")
        out.extend(val if isinstance(val, list | tuple) else [val])
    return out


def kind_of(arg: Arg) -> str:
    """The kind of an argument: "T" a column of tensors, "S" a column of per-lane numbers,
    "t" one tensor for every lane, "c" one number (or constant) for every lane, "x" other."""
    tag = arg[0]
    if tag == "column":
        return "T" if all(is_tensor(n) for n in arg[1]) else "S"
    if tag == "node":
        val = arg[1].meta.get("val")
        if isinstance(val, torch.Tensor):
            return "t"
        return "c" if isinstance(val, bool | int | float) or is_python(arg[1]) else "x"
    if tag == "const":
        return "c" if isinstance(arg[1], bool | int | float) else "x"
    return "x"


def eager_op(node: fx.Node) -> Any:
    """What computes a foreach node not run in place as eager did: a node recorded from an
    in-place op runs that op on copies of its first list, laid out alike (an in-place add
    on a contiguous copy of a strided bfloat16 tensor rounds otherwise). Its functional
    form may round otherwise (``_foreach_mul_`` by a Scalar in float16/bfloat16) or, in a
    graph that records no cast back, promote (a 0-dim bfloat16 parameter times a float32 lr
    tensor: eager keeps bfloat16; the tracer records such an op functionally, with a cast)."""
    inplace = node.meta.get("inplace")
    if inplace is None:
        return node.target

    def on_copies(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        out = [same_layout_copy(t) for t in tensors]
        inplace(out, *args, **kwargs)
        return out

    return on_copies


def strided_eager_op(node: fx.Node) -> Any:
    """For a per-tensor node eager ran in place on a non-dense float16/bfloat16 tensor
    (``param.add_(u, alpha=a)`` on a strided view): that op on a copy laid out alike, or
    None. Its functional form writes a dense result, which ATen's CPU kernels compute on
    their vectorized path, rounding otherwise (an ulp in ~3% of the elements)."""
    inplace = self_inplace_op(node)
    first = node.args[0] if node.args else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    if inplace is None or not isinstance(val, torch.Tensor) or val.dtype not in _LOW_PRECISION:
        return None
    if val.numel() == 0 or _dense(tuple(val.shape), tuple(val.stride())):
        return None

    def on_copy(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = same_layout_copy(t)
        inplace(out, *args, **kwargs)
        return out

    return on_copy


def self_inplace_op(node: fx.Node) -> Any:
    """The in-place op eager ran for ``node`` when it writes its first argument
    (``add_``), or None (none recorded, or an ``out=`` form: ``maximum(.., out=exp_inf)``)."""
    inplace = node.meta.get("inplace")
    name = getattr(inplace, "__name__", "").partition(".")[0]
    return inplace if name.endswith("_") else None


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout covers its storage without gaps (any order of dims)."""
    expected = 1
    for size, step in sorted(zip(shape, stride, strict=True), key=lambda d: d[1]):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True
