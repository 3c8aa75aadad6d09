"""A cold cache's compile: a launch through Triton's stages as ``triton.compile`` does on a
miss, into files beside the kernel's record instead of Triton's cache (so without Triton's
self-hash, its cache key, and without its binder)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from optkernels._triton_compat.prefetch import _check_prefetched, _current_device
from optkernels._triton_compat.records import _entry_of, _remember
from optkernels._triton_compat.specialize import _constexpr_args, _jit_options, _specialization

log = logging.getLogger("optcompile.kernels")


def _compile(
    fn: Any, record: str, name: str, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Compile the launch fingerprinted ``key`` as Triton's JIT would, without Triton's
    cache (whose key is Triton's self-hash: ``triton_key``), into files beside the record,
    and record it as ``name``; None where this Triton, its settings or the kernel's
    parameters ask for Triton's own path (hooks, overrides, dumps), or anything differs."""
    from triton import knobs

    compilation, runtime = knobs.compilation, knobs.runtime
    customized = (
        getattr(compilation, "override", False),
        getattr(compilation, "dump_ir", False),
        getattr(compilation, "always_compile", False),
        getattr(compilation, "use_ir_loc", None),
        getattr(compilation, "listener", None),
        getattr(runtime, "jit_cache_hook", None),
        getattr(runtime, "jit_post_compile_hook", None),
        getattr(runtime, "add_stages_inspection_hook", None),
    )
    if any(customized):
        return None
    try:
        from triton.compiler import ASTSource

        _, _, target, backend, _ = fn.device_caches[_current_device()]
        kw = _jit_options(fn, kwargs)
        values = (*args, *_constexpr_args(fn, len(args), kwargs))
        bound = dict(zip(fn.arg_names, values, strict=True))
        specialization = _specialization(fn, key, bound)
        if specialization is None:
            return None
        _check_prefetched(fn, specialization)
        packed = fn._pack_args(backend, kw, bound, specialization, kw)
        options, signature, constexprs, attrs = packed
        if getattr(options, "ir_override", None):
            return None
        src = ASTSource(fn, signature, constexprs, attrs)
        digest = hashlib.sha256(f"{os.path.basename(record)}|{name}".encode()).hexdigest()
        folder = os.path.join(os.path.dirname(record), "bin", digest[:32])
        compiled = _run_stages(src, target, backend, options, folder, digest)
    except Exception as exc:  # (Triton's own path compiles it, and raises what it raises)
        log.debug("%s: compiled through Triton's JIT (%r)", fn.__name__, exc)
        return None
    entry = _entry_of(compiled, signature, constexprs, attrs)
    if entry is not None:
        _remember(record, name, entry, fn)
    return compiled


def _run_stages(src: Any, target: Any, backend: Any, options: Any, folder: str, digest: str) -> Any:
    """What ``triton.compile`` does on a miss of its cache (Triton 3.6 to 3.9): the source's
    IR through the backend's stages, the binary and the metadata written to ``folder``."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars, ir
    from triton.compiler import CompiledKernel

    metadata = {
        "hash": digest,
        "target": target,
        **options.__dict__,
        **get_cache_invalidating_env_vars(),
        "triton_version": triton.__version__,
    }
    stages: dict[str, Callable[[Any, dict[str, Any]], Any]] = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen = backend.get_codegen_implementation(options)
    module = src.make_ir(target, options, codegen, backend.get_module_map(), context)
    kept: dict[str, Any] = {}  # (the binary, and the assembly a reader may want: PTX)
    for ext, stage in list(stages.items())[list(stages).index(src.ext) :]:
        module = stage(module, metadata)
        if ext in ("ptx", "amdgcn", backend.binary_ext):
            kept[ext] = module
    kept["json"] = json.dumps(metadata, default=vars)
    os.makedirs(folder, exist_ok=True)
    group = {}
    for ext, data in kept.items():
        path = os.path.join(folder, f"{src.name[:150]}.{ext}")
        _write(path, data if isinstance(data, bytes) else str(data).encode())
        group[os.path.basename(path)] = path
    return CompiledKernel(src, group, digest)


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
