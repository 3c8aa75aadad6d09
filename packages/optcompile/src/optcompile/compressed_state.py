"""Optimizer state stored in low precision (``compile(opt, state_dtype=...)``).

Which tensors: a state tensor of a parameter's shape and dtype (float32 or float64) with at
least ``MIN_NUMEL`` elements (exp_avg, exp_avg_sq, momentum buffers, ...); step counts and
small tensors stay exact. Such a tensor lives in ``opt.state`` as its *payload* (a bfloat16
tensor, or optkernels' packed int8 codes and scales), recognized by its dtype and shape
against its parameter, so copies, pickles and checkpoints need no registry.

A step is traced over full-precision state (the payloads are dequantized for the trace,
and put back after it) and the graph is rewritten (``optkernels.compressed``) to read and
write payloads: dequantize where the step starts, quantize what it writes back. The
entry's guards then expect the payloads. A step that runs eagerly (a fallback) runs on the
dequantized state and quantizes it again after. ``state_dict()`` returns full precision;
``load_state_dict()`` quantizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from optguard import (
    AttrSource,
    DataPtrGuard,
    GuardSet,
    ItemSource,
    KeyedSource,
    Locals,
    LocalSource,
    Source,
    TensorMatchGuard,
    TensorMeta,
)
from optkernels.compressed import (
    Compressed,
    CompressionError,
    compress_inputs,
    dequantize_state,
    is_payload,
    quantize_state,
)
from optsidefx import Build, Const, Input, ItemStore, Output
from opttrace import TracedStep, TraceError

from optcompile.errors import CompileError

STATE_DTYPES: dict[Any, str] = {torch.bfloat16: "bf16", "int8": "int8"}
MIN_NUMEL = 4096  # bitsandbytes' min_8bit_size: smaller state stays exact
COUNTER_ATTR = "_optcompile_state_counter"  # bf16's rounding counter, on the optimizer


def state_format(state_dtype: Any) -> str | None:
    """The payload format for ``compile(state_dtype=...)``: None (full precision), "bf16"
    or "int8"; anything else is refused."""
    if state_dtype is None:
        return None
    for key, fmt in STATE_DTYPES.items():
        if state_dtype is key or (isinstance(key, str) and state_dtype == key):
            return fmt
    raise CompileError(
        f"state_dtype={state_dtype!r} is not supported; choose None (full precision), "
        "torch.bfloat16 (stochastic rounding) or 'int8' (blockwise, 256 per block)"
    )


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def compressible(p: torch.Tensor, t: Any) -> bool:
    """Whether state tensor ``t`` of param ``p`` is stored compressed (see the module)."""
    return (
        type(t) is torch.Tensor
        and t.dtype in (torch.float32, torch.float64)
        and t.dtype == p.dtype
        and t.shape == p.shape
        and t.numel() >= MIN_NUMEL
    )


def is_compressed(fmt: str, p: torch.Tensor, t: Any) -> bool:
    """Whether ``t`` is the payload of a compressed state tensor of ``p``."""
    return (
        type(t) is torch.Tensor
        and p.dtype in (torch.float32, torch.float64)
        and p.numel() >= MIN_NUMEL
        and is_payload(fmt, t, p)
    )


def counter(opt: torch.optim.Optimizer) -> int:
    """bf16's rounding counter (an int on the optimizer, 0 in a new one): each compiled step
    reads it as a graph input (its random bits) and the compiled ``step()`` advances it."""
    found = opt.__dict__.get(COUNTER_ATTR)
    if not isinstance(found, int):
        found = opt.__dict__[COUNTER_ATTR] = 0
    return found


def salt(key: Any) -> int:
    """The rounding salt of state entry ``key`` (the same in every process: a CRC)."""
    return zlib.crc32(repr(key).encode()) & 0xFFFF


def encode(opt: torch.optim.Optimizer, fmt: str, t: torch.Tensor, key: Any) -> torch.Tensor:
    """``t`` (state entry ``key``) as a payload; a bf16 conversion draws from the counter
    and advances it."""
    n = counter(opt) if fmt == "bf16" else 0
    payload: torch.Tensor = quantize_state(t, fmt, n, salt(key))
    if fmt == "bf16":
        opt.__dict__[COUNTER_ATTR] = n + 1
    return payload


def decode(fmt: str, p: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    full: torch.Tensor = dequantize_state(payload, fmt, list(p.shape), p.dtype)
    return full


def _compressed_slots(
    opt: torch.optim.Optimizer, fmt: str
) -> Iterator[tuple[torch.Tensor, dict[str, Any], str, torch.Tensor]]:
    """(param, its state dict, key, payload) for each compressed state tensor."""
    for p in _params(opt):
        st: Any = opt.state.get(p)
        for k, t in list(st.items()) if isinstance(st, dict) else ():
            if is_compressed(fmt, p, t):
                yield p, st, k, t


def compress_state(opt: torch.optim.Optimizer, fmt: str) -> None:
    """Store every compressible state tensor of ``opt`` as its payload."""
    for p in _params(opt):
        st: Any = opt.state.get(p)
        for k, t in list(st.items()) if isinstance(st, dict) else ():
            if compressible(p, t):
                st[k] = encode(opt, fmt, t, k)


def decompress_state(opt: torch.optim.Optimizer, fmt: str) -> None:
    """Store every payload of ``opt``'s state at full precision again."""
    for p, st, k, t in list(_compressed_slots(opt, fmt)):
        st[k] = decode(fmt, p, t)


@contextlib.contextmanager
def inflated(
    opt: torch.optim.Optimizer, fmt: str, write_back: bool
) -> Iterator[dict[int, torch.Tensor]]:
    """The state at full precision for the block: yields {id(full tensor): its payload}.
    After it, each payload is back in place, holding the full tensor's new values if
    ``write_back`` (in place: its address, which entries guard, stays)."""
    swapped = []
    for p, st, k, payload in list(_compressed_slots(opt, fmt)):
        full = st[k] = decode(fmt, p, payload)
        swapped.append((st, k, full, payload))
    try:
        yield {id(full): payload for _, _, full, payload in swapped}
    finally:
        for st, k, full, payload in swapped:
            if st.get(k) is not full:
                continue  # the step stored another tensor there: compress_state takes it
            if write_back:
                payload.copy_(encode(opt, fmt, full, k))
            st[k] = payload


def eager_step(opt: torch.optim.Optimizer, fmt: str, run: Callable[[], Any]) -> Any:
    """Run an eager step (``run``) of ``opt`` over its state at full precision."""
    with inflated(opt, fmt, write_back=True):
        result = run()
    compress_state(opt, fmt)  # state the step created
    return result


def traced_step(L: Locals, fmt: str, trace: Callable[[Locals], TracedStep]) -> TracedStep:
    """Trace ``L['opt']``'s step over full-precision state and rewrite it for payloads."""
    opt: torch.optim.Optimizer = L["opt"]
    compress_state(opt, fmt)  # state a first step's replay or an eager step left
    with inflated(opt, fmt, write_back=False) as payloads:
        traced = trace(L)
        owners = {id(t): (p, k) for p in _params(opt) for k, t in opt.state.get(p, {}).items()}
        chosen: dict[int, tuple[torch.Tensor, Any, torch.Tensor]] = {}
        for i, source in enumerate(traced.input_sources):
            t = source.fetch(L)
            owner = owners.get(id(t))
            if owner is not None and (id(t) in payloads or compressible(owner[0], t)):
                chosen[i] = (owner[0], owner[1], t)
        created = dict(_created_state(L, traced))
    stored: dict[int, torch.Tensor] = {}
    for i, (p, k, t) in chosen.items():
        payload = payloads.get(id(t))
        if payload is None:  # created by this trace (the optimizer's _init_group)
            payload = opt.state[p][k] = encode(opt, fmt, t, k)
        stored[i] = payload
    keys = {i: k for i, (_, k, _) in chosen.items()}
    return _rewritten(traced, opt, fmt, stored, keys, created)


def _created_state(L: Locals, traced: TracedStep) -> Iterator[tuple[int, Compressed]]:
    """(output position, dtype) of each compressible state tensor the step creates (a graph
    output stored into ``state[param]``, or into a new dict stored there): stored
    compressed from the start."""
    results = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    for param_source, key, value in _state_stores(traced):
        if not isinstance(value, Output):
            continue
        p = param_source.fetch(L)
        val = results[value.index].meta.get("val")
        if (
            isinstance(p, torch.Tensor)
            and isinstance(val, torch.Tensor)
            and val.dtype in (torch.float32, torch.float64)
            and val.dtype == p.dtype
            and val.shape == p.shape
            and val.numel() >= MIN_NUMEL
        ):
            yield value.index, Compressed("", val.dtype, salt(key))


def _state_stores(traced: TracedStep) -> Iterator[tuple[Source, Any, Any]]:
    """(the param's source, the key, the value) of each store into a param's state the step
    makes:
    ``state[p][key] = value`` and ``state[p] = {key: value, ...}``."""
    state = AttrSource(LocalSource("opt"), "state")
    for effect in traced.effects:
        if not (isinstance(effect, ItemStore) and isinstance(effect.target, Input)):
            continue
        target = effect.target.source
        if isinstance(target, KeyedSource) and target.base == state:
            yield target.key, _constant(effect.key), effect.value
        elif target == state and isinstance(effect.key, Input):
            value = effect.value
            if isinstance(value, Build):
                for key, item in zip(value.keys or (), value.items, strict=False):
                    yield effect.key.source, key, item


def _constant(key: Any) -> Any:
    return key.value if isinstance(key, Const) else key


def _rewritten(
    traced: TracedStep,
    opt: torch.optim.Optimizer,
    fmt: str,
    stored: dict[int, torch.Tensor],
    keys: dict[int, Any],
    created: dict[int, Compressed],
) -> TracedStep:
    sources = traced.input_sources
    by_source = {sources[i]: payload for i, payload in stored.items()}
    for effect in traced.effects:
        if isinstance(effect, ItemStore) and isinstance(effect.target, Input):
            slot = ItemSource(effect.target.source, _constant(effect.key))
            if slot in by_source and effect.value != Input(slot):  # (not a store of itself)
                raise TraceError(
                    f"state_dtype: the step stores a new tensor into {slot.name()} "
                    "(state[...] = ...) on each call; only state updated in place (add_, "
                    "mul_, lerp_, copy_, ...) can be stored compressed. Update it in place, "
                    "or compile with state_dtype=None"
                )
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    inputs = {i: Compressed(fmt, placeholders[i].meta["val"].dtype, salt(keys[i])) for i in stored}
    names = {i: sources[i].name() for i in inputs}
    outputs = {j: dataclasses.replace(c, fmt=fmt) for j, c in created.items()}
    try:
        gm = compress_inputs(traced.graph_module, inputs, names, outputs)
    except CompressionError as exc:
        raise TraceError(f"state_dtype: {exc}") from None
    guards = tuple(_retarget(g, by_source) for g in traced.guards.guards)
    if fmt == "bf16" and (inputs or outputs):
        counter(opt)
        sources = (*sources, AttrSource(LocalSource("opt"), COUNTER_ATTR))
    if not inputs and not outputs:
        return traced
    return dataclasses.replace(
        traced, graph_module=gm, input_sources=sources, guards=GuardSet(guards)
    )


def _retarget(guard: Any, by_source: dict[Any, torch.Tensor]) -> Any:
    """``guard`` on a compressed state tensor made to expect its payload."""
    payload = by_source.get(guard.source)
    if payload is None:
        return guard
    if isinstance(guard, TensorMatchGuard):
        return TensorMatchGuard(guard.source, TensorMeta.of(payload))
    if isinstance(guard, DataPtrGuard):
        return DataPtrGuard(guard.source, payload.data_ptr())
    return guard


def full_precision_state_dict(
    opt: torch.optim.Optimizer, fmt: str, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``state_dict`` (from the optimizer's own ``state_dict()``) with each payload replaced
    by the full-precision tensor it stores (new per-param dicts: opt.state is untouched)."""
    index_to_param: dict[int, torch.Tensor] = {}
    for group, packed in zip(opt.param_groups, state_dict["param_groups"], strict=True):
        index_to_param.update(zip(packed["params"], group["params"], strict=True))
    state = dict(state_dict["state"])
    for index, entries in state.items():
        p = index_to_param.get(index)
        if p is None or not isinstance(entries, dict):
            continue
        state[index] = {
            k: decode(fmt, p, t) if is_compressed(fmt, p, t) else t for k, t in entries.items()
        }
    return {**state_dict, "state": state}


def state_bytes(opt: torch.optim.Optimizer, fmt: str | None) -> tuple[int, int]:
    """(bytes of the state at full precision, bytes stored) of ``opt``'s tensors."""
    full = stored = 0
    for p in _params(opt):
        for t in opt.state.get(p, {}).values():
            if not isinstance(t, torch.Tensor):
                continue
            size = t.numel() * t.element_size()
            stored += size
            compressed = fmt is not None and is_compressed(fmt, p, t)
            full += p.numel() * p.element_size() if compressed else size
    return full, stored
