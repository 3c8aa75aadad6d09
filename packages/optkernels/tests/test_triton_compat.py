"""The private Triton APIs behind optkernels' kernels: Triton's self-hash and runtime built
early on a cold kernel cache (prefetch_triton_key, prefetch_runtime); the record of compiled
kernels a later process launches directly (Kernel, compiled offline for an sm_90 target
here: no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types

import pytest
import torch
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from optkernels import _triton_compat
from optkernels._triton_compat import prefetch, records, specialize, stages, version
from optkernels.triton_backend import kernels_recorded


def test_prefetch_computes_the_key_once_in_a_background_thread(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(prefetch, "_key_thread", None)
    ran_in: list[str] = []
    monkeypatch.setattr(
        prefetch,
        "_triton_key_function",
        lambda: lambda: ran_in.append(threading.current_thread().name),
    )
    prefetch.prefetch_triton_key()
    prefetch.prefetch_triton_key()  # (once per process)
    prefetch._await_triton_key()
    assert ran_in == ["optkernels-triton-key"]


def test_prefetch_does_nothing_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(prefetch, "_key_thread", None)
    prefetch.prefetch_triton_key()
    assert prefetch._key_thread is None
    prefetch._await_triton_key()  # nothing to wait for


def test_a_failing_key_leaves_the_error_to_the_first_compile(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(prefetch, "_key_thread", None)

    def broken() -> None:
        raise OSError("libtriton unreadable")

    monkeypatch.setattr(prefetch, "_triton_key_function", lambda: broken)
    prefetch.prefetch_triton_key()
    prefetch._await_triton_key()  # no exception escapes the thread


def test_the_cache_counts_as_cold_until_a_kernel_record_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKERNELS_CACHE_DIR", str(tmp_path / "src"))
    assert not kernels_recorded()  # (no folder yet)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "k_0123.py").write_text("")
    assert not kernels_recorded()  # a source written, never launched
    (tmp_path / "src" / "k_0123.foreach_float32.json").write_text("{}")
    assert kernels_recorded()


@pytest.mark.parametrize("compiler", [True, False], ids=["cold cache", "warm cache"])
def test_the_runtime_modules_are_built_in_background_threads_once(monkeypatch, compiler):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(prefetch, "_runtime_threads", [])
    monkeypatch.setattr(prefetch, "_compiler_threads", [])
    monkeypatch.setattr(prefetch, "_driver_pending", False)
    monkeypatch.setattr(prefetch, "_prefetched", set())
    built: list[tuple[str, object]] = []

    def record(what: object) -> None:
        built.append((threading.current_thread().name, what))

    monkeypatch.setattr(prefetch, "_build_driver", lambda: record("driver"))
    monkeypatch.setattr(prefetch, "_build_launcher", record)
    monkeypatch.setattr(prefetch, "_import_compiler", lambda: record("compiler"))
    signatures = [("*i64", "constexpr"), ("*fp64", "i32", "constexpr")]
    prefetch.prefetch_runtime(signatures, compiler=compiler)
    prefetch.prefetch_runtime(signatures)  # (once per process)
    assert prefetch._driver_pending  # (until the first launch waited for it)
    prefetch._await_driver()
    assert not prefetch._driver_pending
    prefetch._await_runtime()
    expected = ["driver", *signatures, *(["compiler"] if compiler else [])]
    assert sorted((what for _, what in built), key=str) == sorted(expected, key=str)
    assert all(name.startswith("optkernels-triton-runtime-") for name, _ in built)
    assert prefetch._prefetched == set(signatures)


def test_no_runtime_is_built_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(prefetch, "_runtime_threads", [])
    prefetch.prefetch_runtime([("*i64",)])
    assert prefetch._runtime_threads == []
    prefetch._await_runtime()  # nothing to wait for


def test_a_launch_signature_has_the_jits_argument_types():
    import torch

    source = "def k(ptrs, n, values, BLOCK):\n    pass\n"
    fn = type("Fn", (), {"arg_names": ["ptrs", "n", "values", "BLOCK"], "src": source})
    args = (torch.zeros(2, dtype=torch.int64), 7, torch.zeros(1, dtype=torch.float64))
    assert prefetch.launch_signature(fn, args) == ("*i64", "i32", "*fp64", "constexpr")
    one = (args[0], 1, args[2])  # (the JIT specializes an int argument equal to 1)
    assert prefetch.launch_signature(fn, one) == ("*i64", "constexpr", "*fp64", "constexpr")


def test_a_first_launch_whose_launcher_was_not_prefetched_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(prefetch, "_prefetched", {("*i64", "constexpr")})
    monkeypatch.setattr(prefetch, "_runtime_threads", [threading.current_thread()])

    def foreach_float32() -> None:  # (a kernel, as far as the message goes)
        pass

    def launch(*types: str) -> list[tuple[str, None]]:
        return [(t, None) for t in types]  # (a specialization)

    with caplog.at_level("INFO", logger="optcompile.kernels"):
        prefetch._check_prefetched(foreach_float32, launch("*i64", "constexpr"))
        assert caplog.records == []
        prefetch._check_prefetched(foreach_float32, launch("*fp32", "constexpr"))
    assert "foreach_float32: no launcher prefetched" in caplog.text


# -- the record of compiled kernels, and the fingerprint that finds them -------------------


def twice_first(ptrs, n, out, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2.0):
    # out[i] = SCALE * the first element of the float32 tensor at address ptrs[i]
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    address = tl.load(ptrs + i, mask=mask, other=0)
    x = tl.load(address.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    tl.store(out + i, SCALE * x, mask=mask)


@pytest.fixture(scope="module")
def offline():
    """``twice_first`` as Triton's JIT sees it, with the binder and backend of an sm_90
    target (what ``JITFunction.run`` uses on an H100), built on this CPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = JITFunction(twice_first)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    return fn, target, backend, binder


def _bound(offline, args, kwargs):
    """What specialize._bind gives on a GPU: the launch as Triton's JIT binds it."""
    from triton.runtime.jit import compute_cache_key

    _, target, _, binder = offline
    kw = specialize._jit_options(offline[0], kwargs)
    bound, specialization, options = binder(*args, **kw)
    jit_key = compute_cache_key({}, specialization, options)
    return specialize._Launch(0, jit_key, target, kw, bound, specialization, options)


# Triton's interpreter patches triton.language for the rest of the process once an
# interpreted kernel has called a helper (as the tests of generated kernels do), and Triton's
# compiler then fails: the tests that compile run in a fresh process, without TRITON_INTERPRET.
_COMPILING = "OPTKERNELS_TEST_COMPILING"
compiling = pytest.mark.skipif(
    os.environ.get(_COMPILING) != "1",
    reason="run by test_the_compiling_tests_pass_in_a_fresh_process",
)


def test_the_compiling_tests_pass_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[_COMPILING] = "1"
    tests = [
        test_a_recorded_kernel_loads_as_the_kernel_triton_compiled,
        test_a_kernel_compiled_without_triton_s_cache_is_the_one_triton_compiles,
    ]
    ids = [f"{__file__}::{t.__name__}" for t in tests]
    command = [sys.executable, "-m", "pytest", *ids, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and f"{len(tests)} passed" in done.stdout, done.stdout[-4000:]


@compiling
def test_a_recorded_kernel_loads_as_the_kernel_triton_compiled(offline, tmp_path, monkeypatch):
    import triton
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # (its default, without a warning)
    fn, target, backend, _ = offline
    args = (torch.zeros(8, dtype=torch.int64), 5, torch.zeros(8))
    kwargs = {"BLOCK": 128, "num_warps": 4}
    launch = _bound(offline, args, kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, launch.bound, launch.specialization, launch.options
    )
    source = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    key = specialize._fingerprint(fn, args, kwargs)
    entry = records._entry(fn, backend, launch, compiled, key)
    assert entry is not None
    record = str(tmp_path / "k_0123.twice_first.json")
    name = records._entry_name(target, key)
    records._remember(record, name, entry, fn)

    loaded = records._load(fn, record, name)
    assert loaded.asm["cubin"] == compiled.asm["cubin"]
    assert loaded.metadata == compiled.metadata and loaded.hash == compiled.hash
    # (what the launcher is built from: every argument's type, the constexprs' values)
    assert loaded.src.signature == compiled.src.signature == signature
    assert loaded.src.constants == compiled.src.constants == {(3,): 128, (4,): 2.0}
    assert specialize._constexpr_args(fn, len(args), kwargs) == (128, 2.0)

    # A later process launches it from what the record keeps of the function: the same
    # fingerprint, arguments and compiled kernel, without building the function.
    header = records._read(record)[records._HEADER]
    recorded = records._Recorded.of(header, lambda: pytest.fail("function built"))
    assert specialize._fingerprint(recorded, args, kwargs) == key
    assert specialize._constexpr_args(recorded, len(args), kwargs) == (128, 2.0)
    warm = records._load(recorded, record, name)
    assert warm.asm["cubin"] == compiled.asm["cubin"] and warm.hash == compiled.hash
    assert warm.src.signature == signature and warm.src.constants == compiled.src.constants

    assert records._load(fn, record, name.replace("arch=90", "arch=80")) is None
    os.remove(entry["group"]["twice_first.cubin"])  # (Triton's cache emptied since)
    assert records._load(fn, record, name) is None


def _counting(fn):
    """A loader of ``fn`` that counts its calls (a generated module's import)."""
    calls: list[int] = []

    def load():
        calls.append(1)
        return fn

    return load, calls


def test_what_the_record_keeps_of_a_function_launches_as_the_function(offline):
    fn = offline[0]
    load, calls = _counting(fn)
    recorded = records._Recorded.of(records._Recorded.header(fn), load)
    table, out = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.float16)
    for args in ((table, 5, out), (table[1:], 1, out[3:]), (table, 2**40, 2.5)):
        for kwargs in ({"BLOCK": 64}, {"BLOCK": 32, "SCALE": 3.0, "num_warps": 2}):
            fingerprint = specialize._fingerprint(recorded, args, kwargs)
            assert fingerprint == specialize._fingerprint(fn, args, kwargs)
            constexprs = specialize._constexpr_args(recorded, len(args), kwargs)
            assert constexprs == specialize._constexpr_args(fn, len(args), kwargs)
    assert recorded.__name__ == "twice_first" and recorded.arg_names == fn.arg_names
    # (what Triton's launcher reads of it where a launch-enter hook is set: a profiler's)
    assert recorded.launch_metadata is None is fn.launch_metadata
    assert calls == []  # (nothing above needed the function)
    assert recorded.cache_key == fn.cache_key and calls == [1]  # (the rest is the function's)


def test_a_record_without_the_function_s_header_builds_the_function(offline, tmp_path):
    fn = offline[0]
    record = tmp_path / "k_0123.twice_first.json"
    broken = {**records._Recorded.header(fn), "params": 3}
    for header in (None, {"name": "twice_first"}, broken):
        entries = {} if header is None else {records._HEADER: header}
        record.write_text(json.dumps(entries))
        load, calls = _counting(fn)
        kernel = _triton_compat.Kernel(str(record), load)
        assert kernel._recorded() is fn and calls == [1]


def test_a_function_json_cannot_keep_is_not_recorded(offline):
    fn = offline[0]
    assert records._Recorded.header(fn)["params"][-1] == ["SCALE", True, 2.0]

    class Default:  # (a default value JSON cannot keep)
        pass

    params = [records._Param("x", True, Default())]
    odd = types.SimpleNamespace(
        __name__="f", debug=None, arg_names=["x"], params=params, launch_metadata=None
    )
    assert records._Recorded.header(odd) is None
    plain = types.SimpleNamespace(
        __name__="f", debug=None, arg_names=["x"], params=[], launch_metadata=None
    )
    assert records._Recorded.header(plain) is not None
    hooked = types.SimpleNamespace(**{**vars(plain), "launch_metadata": lambda *args: {}})
    assert records._Recorded.header(hooked) is None  # (its launches call it)
    assert records._Recorded.header(object()) is None


def test_a_launch_from_the_record_imports_no_generated_module(tmp_path, monkeypatch):
    """A kernel whose record keeps its function launches (on a GPU) without importing the
    module ``load_kernel`` wrote; the interpreter, or anything else, imports it on use."""
    from optkernels.foreach_kernel import load_kernel

    monkeypatch.setenv("OPTKERNELS_CACHE_DIR", str(tmp_path))
    name = f"unused_{os.getpid()}"
    source = f"@triton.jit\ndef {name}(x, BLOCK: tl.constexpr):\n    pass\n"
    kernel = load_kernel(source, name)
    module = [m for m in sys.modules if m.startswith("optkernels_generated_")]
    digest = os.path.basename(kernel.record).split(".")[0][2:]
    assert f"optkernels_generated_{digest}" not in module
    assert os.path.exists(tmp_path / f"k_{digest}.py")
    os.remove(tmp_path / f"k_{digest}.py")  # (the cache emptied meanwhile: written again)
    assert kernel.fn.__name__ == name  # (imported now)
    assert f"optkernels_generated_{digest}" in sys.modules
    again = load_kernel(source, name)  # (the same module's function, given at once)
    assert again._fn is kernel.fn and again._compiled is kernel._compiled


def test_the_record_names_the_triton_it_was_made_by():
    import triton

    installation = version._installation()
    assert installation.startswith(f"{triton.__version__}|")
    assert "?" not in installation.split("|")[1]  # (libtriton's size and modification time)


_INTS = st.one_of(
    st.sampled_from([0, 1, 2, 15, 16, 17, -16, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64 - 16]),
    st.integers(-(2**64), 2**64),
)


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.lists(st.integers(0, 5), min_size=2, max_size=2),
    dtypes=st.lists(st.sampled_from([torch.int64, torch.int32, torch.float16]), min_size=2),
    ints=st.lists(_INTS, min_size=2, max_size=2),
)
def test_equal_fingerprints_are_launches_the_jit_specializes_alike(offline, offsets, dtypes, ints):
    """A fingerprint must be at least as fine as Triton's own specialization: two launches
    with one fingerprint run the same compiled kernel."""
    buffers = [torch.zeros(16, dtype=d)[k:] for d, k in zip(dtypes, offsets, strict=False)]
    launches = []
    for n in ints:
        args = (buffers[0], n, buffers[1])
        key = specialize._fingerprint(offline[0], args, {"BLOCK": 64})
        if key is None:  # (out of every int type: Triton's JIT refuses it too)
            with pytest.raises(OverflowError):
                _bound(offline, args, {"BLOCK": 64})
            continue
        launch = _bound(offline, args, {"BLOCK": 64})
        assert specialize._agrees(key, launch.specialization)
        launches.append((key, launch.jit_key))
    for key, jit_key in launches:
        assert all(k != key or j == jit_key for k, j in launches)


def test_a_jit_that_specializes_otherwise_is_not_recorded(offline):
    fn = offline[0]
    args = (torch.zeros(4, dtype=torch.int64), 32, torch.zeros(4))
    key = specialize._fingerprint(fn, args, {"BLOCK": 64})
    spec = _bound(offline, args, {"BLOCK": 64}).specialization
    assert specialize._agrees(key, spec)
    assert not specialize._agrees(key, [(spec[0][0], "A16"), *spec[1:]])  # another rule
    assert not specialize._agrees(key, [spec[0], ("i64", "D"), *spec[2:]])
    assert not specialize._agrees(key, spec[:2])


def test_arguments_a_fingerprint_does_not_cover_go_to_the_jit(offline):
    fn = offline[0]
    table = torch.zeros(4, dtype=torch.int64)
    assert specialize._fingerprint(fn, (table, "5", table), {}) is None
    assert specialize._fingerprint(fn, (table, 5, table), {"BLOCK": [64]}) is None
    covered = specialize._fingerprint(fn, (table, 5.0, True), {"BLOCK": 64})
    assert covered is not None and covered[0][1:] == ("float", "bool")


def test_the_specialization_made_from_a_fingerprint_is_the_binders(offline):
    fn = offline[0]
    table, out = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.float16)
    for args in ((table, 5, out), (table[1:], 1, out[3:]), (table, 2**40, out), (table, 32, out)):
        kwargs = {"BLOCK": 64, "num_warps": 2}
        key = specialize._fingerprint(fn, args, kwargs)
        launch = _bound(offline, args, kwargs)
        made = specialize._specialization(fn, key, launch.bound)
        assert made == launch.specialization


@compiling
def test_a_kernel_compiled_without_triton_s_cache_is_the_one_triton_compiles(
    offline, tmp_path, monkeypatch
):
    """What the first launch on a cold cache compiles without Triton's self-hash
    (stages._compile): the binary and metadata triton.compile makes."""
    import triton
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    fn, target, backend, _ = offline
    args = (torch.zeros(8, dtype=torch.int64), 5, torch.zeros(8))
    kwargs = {"BLOCK": 128, "num_warps": 4, "maxnreg": 64}  # (as 16-bit lanes launch)
    launch = _bound(offline, args, kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, launch.bound, launch.specialization, launch.options
    )
    source = ASTSource(fn, signature, constexprs, attrs)
    theirs = triton.compile(source, target=target, options=options.__dict__)
    ours = stages._run_stages(source, target, backend, options, str(tmp_path / "b"), "0a")
    assert ours.asm["cubin"] == theirs.asm["cubin"]
    assert ours.metadata._replace(hash="") == theirs.metadata._replace(hash="")
    assert ours.asm["ptx"] == theirs.asm["ptx"]
    files = sorted(os.listdir(tmp_path / "b"))
    assert files == ["twice_first.cubin", "twice_first.json", "twice_first.ptx"]


@pytest.mark.parametrize("setting", ["TRITON_KERNEL_DUMP", "TRITON_KERNEL_OVERRIDE"])
def test_triton_s_dumps_and_overrides_leave_the_compile_to_triton(offline, tmp_path, setting):
    fn = offline[0]
    args = (torch.zeros(8, dtype=torch.int64), 5, torch.zeros(8))
    key = specialize._fingerprint(fn, args, {"BLOCK": 64})
    record = str(tmp_path / "k_0123.twice_first.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(setting, "1")
        assert stages._compile(fn, record, "name", key, args, {"BLOCK": 64}) is None
    assert not os.path.exists(record)
