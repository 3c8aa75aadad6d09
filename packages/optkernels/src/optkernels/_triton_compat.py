"""The private Triton APIs optkernels uses, in one place (a Triton upgrade is one edit here).

Triton's JIT keys its disk cache by a hash of Triton's own source files (``triton_key``),
computed once per process: about 0.4 s in a fresh process before any cached binary is
found; and its binder (``native_specialize_impl``) imports Triton's Gluon packages on its
first call (0.17 s where they have no .pyc). So each generated kernel keeps a small record
next to its source: for each fingerprint of the arguments it was launched with (what the
JIT specializes on, or finer: ``_fingerprint``), Triton's cache entry (the hash and the
files) and the signature its launcher is built for; and, once, what a launch needs of the
function itself (``_Recorded``: its name, debug setting and parameters). A later process
builds the compiled kernel from those files and launches it itself: Triton neither
compiles, hashes itself nor binds, and the function's module is not even imported (Triton's
``@triton.jit`` builds a JITFunction from its source lines: ~2 ms each). Anything
unexpected (another Triton, target or setting, files gone, a JIT that specializes
differently, a launcher that refuses the arguments) falls back to Triton's own path, which
is always correct, only slower.

A process whose kernels are not recorded yet (a cold cache) compiles them: through
Triton's stages as ``triton.compile`` does on a miss, but into files beside the record
instead of Triton's cache (``_compile``), so without Triton's self-hash (its cache key)
and without its binder (the specialization is made from the fingerprint). Where that
cannot be done as Triton would (hooks, overrides or dumps set, parameters with settings,
anything unexpected), Triton's JIT compiles, after its self-hash: most of it reading and
hashing ``libtriton`` (hundreds of MB), which runs without the GIL. ``prefetch_triton_key``
starts that in a background thread when the backend is made on a cold cache
(``compile()``), so that such a first compile finds it done or under way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("optcompile.kernels")

# What a Triton version whose JIT internals differ from the ones used below raises here.
_MISMATCH = (AttributeError, KeyError, TypeError, ValueError, IndexError)


class Kernel:
    """A generated ``@triton.jit`` function, launched as ``kernel[grid](*args, **kwargs)``.

    On CUDA a launch finds its compiled kernel by the arguments' fingerprint (``_fingerprint``:
    what Triton's JIT specializes on, or finer) and launches it directly; the first launch of
    a fingerprint in a process looks it up in the record (see the module docstring), else
    goes through Triton's JIT, which compiles it, and records it.

    ``load`` returns the function (importing its module, whose ``@triton.jit`` builds a
    JITFunction from its source lines); it runs when Triton's JIT, the interpreter or an
    unrecorded fingerprint needs the function: a warm launch of a recorded kernel needs only
    what the record keeps of it (``_Recorded``)."""

    def __init__(self, record: str, load: Callable[[], Any], fn: Any = None) -> None:
        self.record = record
        self._load_fn = load
        self._fn = fn  # (given where its module is imported already)
        self._seen: Any = fn  # the function, or what the record keeps of it
        self._direct: bool | None = None  # (decided at the first launch)
        # (device, fingerprint) -> the compiled kernel, or None where Triton's JIT launches
        # it; shared by every Kernel of the same source and name (the same record's name).
        self._compiled = _COMPILED.setdefault(os.path.basename(record), {})

    @property
    def fn(self) -> Any:
        """The ``@triton.jit`` function (its module imported on first use)."""
        if self._fn is None:
            self._fn = self._seen = self._load_fn()
        return self._fn

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if self._direct is None:  # (the interpreter's functions have no JIT cache)
            loaded = self._fn is not None
            self._direct = hasattr(self._fn, "device_caches") if loaded else not _interpreting()
        if not self._direct:
            return self.fn[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = self._seen if self._seen is not None else self._recorded()
        key = _fingerprint(fn, args, kwargs)
        device = _current_device()
        compiled = self._compiled.get((device, key), _UNSEEN)
        if compiled is None:
            self.fn[grid](*args, **kwargs)
        elif compiled is _UNSEEN:
            self._first(grid, args, kwargs, device, key)
        else:
            compiled[(*grid, 1, 1)[:3]](*args, *_constexpr_args(fn, len(args), kwargs))

    def _recorded(self) -> Any:
        """What the record keeps of the function (``_Recorded``), else the function."""
        recorded = _Recorded.of(_read(self.record).get(_HEADER), lambda: self.fn)
        if recorded is None:
            return self.fn
        self._seen = recorded
        return recorded

    def _first(
        self,
        grid: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: int,
        key: Any,
    ) -> None:
        """A fingerprint's first launch in this process: recorded, or Triton's."""
        _await_driver()  # (loading, compiling, binding use Triton's driver, built there)
        compiled = None
        fn = self._seen
        if key is not None:
            name = _entry_name(_current_target(), key)
            compiled = _load(fn, self.record, name)
            if compiled is None:
                compiled = _compile(self.fn, self.record, name, key, args, kwargs)
        _await_runtime()  # (the launchers: built there, while this compiled)
        if compiled is not None:
            try:
                compiled[(*grid, 1, 1)[:3]](*args, *_constexpr_args(fn, len(args), kwargs))
            except _MISMATCH as exc:  # another Triton's launcher: its JIT launches it
                log.debug("%s: recorded kernel not launched (%r)", fn.__name__, exc)
            else:
                self._compiled[device, key] = compiled
                return
        self._compiled[device, key] = self._through_triton(grid, args, kwargs, key)

    def _through_triton(
        self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], key: Any
    ) -> Any:
        """Launch through Triton's JIT (which compiles, or loads from its cache) and record
        the compiled kernel under ``key``; it, where later launches may use it directly."""
        try:
            launch = _bind(self.fn, args, kwargs)
        except _MISMATCH:
            launch = None
        if launch is not None:
            _check_prefetched(self.fn, launch.specialization)
        if launch is None or launch.jit_key not in self.fn.device_caches[launch.device][0]:
            _await_triton_key()  # (Triton compiles: its key is computed, or being computed)
        self.fn[grid](*args, **kwargs)
        if launch is None or key is None:
            return None
        kernel_cache, _, _, backend, _ = self.fn.device_caches[launch.device]
        compiled = kernel_cache.get(launch.jit_key)
        entry = _entry(self.fn, backend, launch, compiled, key)
        if entry is None:
            return None
        _remember(self.record, _entry_name(launch.target, key), entry, self.fn)
        return compiled


_UNSEEN = object()
_COMPILED: dict[str, dict[Any, Any]] = {}  # a record's name -> its kernels (Kernel._compiled)
_HEADER = "function"  # the record's entry for what it keeps of the function (_Recorded)


def _interpreting() -> bool:
    """Whether ``@triton.jit`` makes interpreted functions (TRITON_INTERPRET)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


@dataclass(frozen=True)
class _Param:
    name: str
    has_default: bool
    default: Any


class _Recorded:
    """What a warm launch of a recorded kernel needs of its ``@triton.jit`` function, kept
    in its record by the process that compiled it: its name, debug setting and parameters
    (the fingerprint, the constexpr arguments, the compiled kernel's source). Anything else
    is asked of the function itself (``load``), built on first use."""

    def __init__(self, header: dict[str, Any], load: Callable[[], Any]) -> None:
        self._load = load
        self.__name__: str = header["name"]
        self.debug = header["debug"]
        self.arg_names: list[str] = list(header["arg_names"])
        self.params = [_Param(str(n), bool(d), v) for n, d, v in header["params"]]
        # (Triton's launcher asks for it where a launch-enter hook is set: a profiler's;
        # only functions without one are recorded)
        self.launch_metadata = None

    def __getattr__(self, name: str) -> Any:
        if name == "_load":  # (not set yet)
            raise AttributeError(name)
        return getattr(self._load(), name)

    @staticmethod
    def header(fn: Any) -> dict[str, Any] | None:
        """What ``_Recorded`` keeps of ``fn``; None where JSON would not keep it as it is."""
        try:
            if fn.launch_metadata is not None:  # (a callable: JSON would not keep it)
                return None
            header = {
                "name": fn.__name__,
                "debug": fn.debug,
                "arg_names": list(fn.arg_names),
                "params": [
                    [p.name, p.has_default, p.default if p.has_default else None] for p in fn.params
                ],
            }
            kept = json.loads(json.dumps(header)) == header
        except (*_MISMATCH, ValueError):
            return None
        return header if kept else None

    @classmethod
    def of(cls, header: Any, load: Callable[[], Any]) -> _Recorded | None:
        """The function as ``header`` (from a record) keeps it; None where it is no header."""
        try:
            return cls(header, load)
        except (*_MISMATCH, ValueError):
            return None


# Python types of kernel arguments a fingerprint covers, and the one Triton's JIT gives them.
_INT_RANGES = (("i32", -(2**31), 2**31), ("i64", -(2**63), 2**63), ("u64", 0, 2**64))


def _fingerprint(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What picks a launch's compiled kernel, at least as finely as Triton's JIT picks it
    (``native_specialize_impl``): per positional argument, a tensor's dtype and whether its
    address is 16-byte aligned; an int's type (i32, i64, u64), whether it is 1 (a constexpr)
    and whether it is a multiple of 16; floats and bools by type; then the keyword arguments
    (constexprs, launch options) and the debug settings the JIT adds to them. None for
    other arguments (Triton's JIT launches those)."""
    parts: list[Any] = []
    for arg in args:
        kind = type(arg)
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif kind is int:
            if arg == 1:
                parts.append(1)
                continue
            ranges = [name for name, low, high in _INT_RANGES if low <= arg < high]
            if not ranges:
                return None
            parts.append((ranges[0], arg & 15 == 0))
        elif kind is float or kind is bool:
            parts.append(kind.__name__)
        else:
            return None
    try:
        options = tuple(sorted(kwargs.items()))
        hash(options)
    except TypeError:
        return None
    return (tuple(parts), options, _debug_settings(fn))


def _debug_settings(fn: Any) -> tuple[Any, ...]:
    """What ``JITFunction.run`` adds to a launch's options from Triton's knobs."""
    from triton import knobs

    compilation = knobs.compilation
    return (
        getattr(fn, "debug", None),
        getattr(knobs.runtime, "debug", None),
        getattr(compilation, "instrumentation_mode", None),
        getattr(compilation, "fpsan_homomorphic_casts", None),
    )


def _agrees(key: Any, specialization: Any) -> bool:
    """Whether Triton's JIT specialized the launch fingerprinted ``key`` as ``_fingerprint``
    expects (its vocabulary: "D" for 16-byte alignment, a constexpr for an int equal to 1):
    only then is the fingerprint recorded."""
    parts = key[0]
    if len(specialization) < len(parts):
        return False
    for part, (kind, spec) in zip(parts, specialization, strict=False):
        if part == 1:
            if kind != "constexpr" or spec != 1:
                return False
        elif isinstance(part, tuple):
            dtype_or_kind, aligned = part
            pointer = isinstance(dtype_or_kind, torch.dtype)
            if pointer != kind.startswith("*") or (not pointer and kind != dtype_or_kind):
                return False
            if spec not in (None, "D" if aligned else ""):
                return False
        elif kind != {"float": "fp32", "bool": "u1"}[part]:
            return False
    return True


def _constexpr_args(fn: Any, given: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The values of ``fn``'s parameters after the ``given`` positional arguments, by keyword
    or default: a compiled kernel takes every argument, constexprs included."""
    out = []
    for param in fn.params[given:]:
        if param.name in kwargs:
            out.append(kwargs[param.name])
        elif param.has_default:
            out.append(param.default)
        else:
            raise TypeError(f"{fn.__name__}: no value for {param.name}")
    return tuple(out)


def _current_device() -> int:
    from triton.runtime.driver import driver

    if _driver_pending:  # (Triton makes its driver on first use, in no thread-safe way)
        _await_driver()
    return driver.active.get_current_device()  # type: ignore[no-any-return]


def _current_target() -> Any:
    from triton.runtime.driver import driver

    return driver.active.get_current_target()


@dataclass(frozen=True)
class _Launch:
    """One launch bound as ``JITFunction.run`` binds it: its device, JIT cache key and
    target, and what building the compiled kernel's source needs."""

    device: int
    jit_key: Any
    target: Any
    kwargs: dict[str, Any]
    bound: Any
    specialization: Any
    options: Any


def _bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Launch:
    from triton.runtime.jit import compute_cache_key

    device = _current_device()
    _, key_cache, target, _, binder = fn.device_caches[device]
    kw = _jit_options(fn, kwargs)
    bound, specialization, options = binder(*args, **kw)
    jit_key = compute_cache_key(key_cache, specialization, options)
    return _Launch(device, jit_key, target, kw, bound, specialization, options)


def _specialization(fn: Any, key: Any, bound: dict[str, Any]) -> list[Any] | None:
    """The specialization Triton's binder gives the launch fingerprinted ``key`` with the
    arguments ``bound`` (by parameter name), made from the fingerprint; None for a kernel
    whose parameters carry settings beyond constexpr-ness (annotations, const pointers,
    do_not_specialize): the binder's own rules apply to those."""
    from triton._utils import canonicalize_ptr_dtype

    parts = iter(key[0])
    out: list[Any] = []
    for param in fn.params:
        if param.is_constexpr:
            out.append(("constexpr", bound[param.name]))
            continue
        plain = not (param.annotation_type or param.is_const or param.do_not_specialize)
        if not plain or param.do_not_specialize_on_alignment:
            return None
        part = next(parts, None)
        if part is None:
            return None
        if part == 1:
            out.append(("constexpr", 1))
        elif part in ("float", "bool"):
            out.append(({"float": "fp32", "bool": "u1"}[part], None))
        else:
            dtype_or_kind, aligned = part
            pointer = isinstance(dtype_or_kind, torch.dtype)
            kind = canonicalize_ptr_dtype(dtype_or_kind, False) if pointer else dtype_or_kind
            out.append((kind, "D" if aligned else ""))
    return out if next(parts, None) is None else None


def _jit_options(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A launch's keyword arguments with what ``JITFunction.run`` adds before binding."""
    from triton import knobs

    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kw


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


def _entry(
    fn: Any, backend: Any, launch: _Launch, compiled: Any, key: Any
) -> dict[str, Any] | None:
    """The record of a compiled kernel: Triton's cache entry (hash, files) and the source
    its launcher is built from (signature, constexprs); None where it does not hold
    (another JIT's specialization, values JSON does not keep)."""
    group = getattr(compiled, "metadata_group", None)
    if not group or not isinstance(getattr(compiled, "hash", None), str):
        return None
    if not _agrees(key, launch.specialization):
        return None
    _, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, launch.bound, launch.specialization, launch.options
    )
    return _entry_of(compiled, signature, constexprs, attrs)


def _entry_of(compiled: Any, signature: Any, constexprs: Any, attrs: Any) -> dict[str, Any] | None:
    """A record entry: where the compiled kernel's files are, and what its launcher is
    built from; None where JSON would not keep it as it is."""
    entry = {
        "hash": compiled.hash,
        "group": dict(compiled.metadata_group),
        "signature": dict(signature),
        "constexprs": [[list(path), value] for path, value in constexprs.items()],
        "attrs": [[list(path), value] for path, value in attrs.items()],
    }
    try:
        kept = json.loads(json.dumps(entry)) == entry
    except (TypeError, ValueError):
        return None
    plain = all(isinstance(v, int | float | str | None) for _, v in entry["constexprs"])
    return entry if kept and plain else None


def _load(fn: Any, record: str, name: str) -> Any:
    """The compiled kernel recorded as ``name``, from Triton's cache files; None where
    there is none (or it cannot be read)."""
    from triton.compiler import ASTSource, CompiledKernel

    try:
        entry = _read(record).get(name)
        if entry is None or not all(os.path.exists(p) for p in entry["group"].values()):
            return None
        constexprs = {tuple(path): value for path, value in entry["constexprs"]}
        attrs = {tuple(path): value for path, value in entry["attrs"]}
        src = ASTSource(fn, entry["signature"], constexprs, attrs)
        return CompiledKernel(src, entry["group"], entry["hash"])
    except (*_MISMATCH, OSError, StopIteration) as exc:
        log.debug("%s: recorded kernel not loaded (%r)", fn.__name__, exc)
        return None


def _entry_name(target: Any, key: Any) -> str:
    return f"{_installation()}|{target}|{key!r}"


@functools.cache
def _installation() -> str:
    """This process's Triton: its version, its library's size and modification time, and
    the environment variables that change what it compiles (a record made by another
    Triton, or under other settings, is not used)."""
    import triton

    parts = [triton.__version__]
    try:
        from triton._C import libtriton

        stat = os.stat(str(libtriton.__file__))
        parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
    except (ImportError, OSError, *_MISMATCH):
        parts.append("?")
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        return "|".join(parts)
    parts.append(repr(sorted(get_cache_invalidating_env_vars().items())))
    return "|".join(parts)


def _remember(record: str, name: str, entry: dict[str, Any], fn: Any) -> None:
    """Record ``entry`` as ``name``, and what a later process needs of ``fn`` to launch it
    without building ``fn`` (``_Recorded``)."""
    entries = _read(record)
    entries[name] = entry
    header = _Recorded.header(fn)
    if header is not None:
        entries[_HEADER] = header
    tmp = f"{record}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f)
    os.replace(tmp, record)


def _read(record: str) -> dict[str, Any]:
    try:
        with open(record) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


_key_thread: threading.Thread | None = None


def prefetch_triton_key() -> None:
    """Compute Triton's self-hash (``triton_key``, cached by Triton for the process) in a
    background thread; see the module docstring. Once per process; never under the
    interpreter (it compiles nothing)."""
    global _key_thread
    if _key_thread is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return
    key = _triton_key_function()
    if key is None:
        return
    _key_thread = threading.Thread(
        target=_quietly, args=(key,), name="optkernels-triton-key", daemon=True
    )
    _key_thread.start()


def _triton_key_function() -> Callable[[], Any] | None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    return triton_key  # type: ignore[no-any-return]


def _quietly(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):  # the first compile computes it again, and says why
        fn()


def _await_triton_key() -> None:
    if _key_thread is not None:
        _key_thread.join()


_runtime_threads: list[threading.Thread] = []
_compiler_threads: list[threading.Thread] = []  # (the one importing Triton's compiler)
_driver_pending = False  # a background thread is making Triton's driver (prefetch_runtime)
_prefetched: set[tuple[str, ...]] = set()


def prefetch_runtime(signatures: Sequence[tuple[str, ...]], compiler: bool = True) -> None:
    """Build (or, on a warm cache, load) Triton's CUDA driver utilities and the launchers of
    kernels whose arguments have the types ``signatures`` (as ``launch_signature`` gives
    them) and, with ``compiler``, import its compiler, in background threads; see the module
    docstring. Once per process; never under the interpreter."""
    global _driver_pending
    if _runtime_threads or os.environ.get("TRITON_INTERPRET") == "1":
        return
    _prefetched.update(signatures)
    launchers = [functools.partial(_build_launcher, s) for s in signatures]
    jobs = [_build_driver, *launchers, *([_import_compiler] if compiler else [])]
    for i, job in enumerate(jobs):
        name = f"optkernels-triton-runtime-{i}"
        thread = threading.Thread(target=_quietly, args=(job,), name=name, daemon=True)
        thread.start()
        _runtime_threads.append(thread)
        if job is _import_compiler:
            _compiler_threads.append(thread)
    _driver_pending = True


def _build_driver() -> None:
    from triton.runtime.driver import driver

    driver.active  # noqa: B018 (its first use builds the driver's C utilities)


def _import_compiler() -> None:
    """The modules the first compile imports (Triton's code generator, ~0.06 s, and the
    gluon language its code generation imports on first use, 0.13 s on an H100 host whose
    Triton has no bytecode for it): here while the main thread traces, which the first
    launch then waits for anyway."""
    import triton.compiler.code_generator

    with contextlib.suppress(ImportError):  # (a Triton without gluon)
        import triton.experimental.gluon.language  # noqa: F401


def _build_launcher(signature: tuple[str, ...]) -> None:
    """What Triton 3.6's ``CudaLauncher`` builds for a kernel of ``signature`` (its module
    is cached by its source, which only the argument types shape). Later versions launch
    every kernel through one module of the driver's: nothing to build."""
    from triton.backends.nvidia import driver as cuda

    make_launcher = getattr(cuda, "make_launcher", None)
    if make_launcher is None:
        return
    cuda.compile_module_from_src(
        src=make_launcher({}, dict(enumerate(signature)), None),
        name="__triton_launcher",
        library_dirs=cuda.library_dirs(),
        include_dirs=cuda.include_dirs,
        libraries=cuda.libraries,
    )


def _await_runtime() -> None:
    for thread in _runtime_threads:
        thread.join()


def _await_driver() -> None:
    """Wait for Triton's driver and compiler modules (prefetch_runtime's first and last
    jobs), not for the launchers, which the first launch waits for."""
    global _driver_pending
    for thread in _runtime_threads[:1] + _compiler_threads:
        thread.join()
    _driver_pending = False


def launch_signature(fn: Any, args: Sequence[Any]) -> tuple[str, ...]:
    """The argument types Triton's JIT gives a launch of ``fn`` with the positional ``args``
    (its other parameters being constexprs given by keyword): what a launcher is built for."""
    from triton.runtime.jit import mangle_type

    rest = fn.arg_names[len(args) :]
    return (*(mangle_type(a, True) for a in args), *("constexpr" for _ in rest))


def _check_prefetched(fn: Any, specialization: Any) -> None:
    """Say so when a first launch's signature (from its ``specialization``) was not among
    those prefetched (Triton 3.6 then builds its launcher in the foreground)."""
    if not _runtime_threads:
        return
    try:
        signature = tuple(kind for kind, _ in specialization)
    except _MISMATCH:
        return
    if signature not in _prefetched:
        log.info("%s: no launcher prefetched for its signature %s", fn.__name__, signature)
