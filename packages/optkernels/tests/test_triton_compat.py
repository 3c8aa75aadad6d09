"""Triton's self-hash started early on a cold kernel cache (_triton_compat.prefetch_triton_key)."""

from __future__ import annotations

import threading

from optkernels import _triton_compat
from optkernels.triton_backend import kernels_recorded


def test_prefetch_computes_the_key_once_in_a_background_thread(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_triton_compat, "_key_thread", None)
    ran_in: list[str] = []
    monkeypatch.setattr(
        _triton_compat,
        "_triton_key_function",
        lambda: lambda: ran_in.append(threading.current_thread().name),
    )
    _triton_compat.prefetch_triton_key()
    _triton_compat.prefetch_triton_key()  # (once per process)
    _triton_compat._await_triton_key()
    assert ran_in == ["optkernels-triton-key"]


def test_prefetch_does_nothing_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_triton_compat, "_key_thread", None)
    _triton_compat.prefetch_triton_key()
    assert _triton_compat._key_thread is None
    _triton_compat._await_triton_key()  # nothing to wait for


def test_a_failing_key_leaves_the_error_to_the_first_compile(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_triton_compat, "_key_thread", None)

    def broken() -> None:
        raise OSError("libtriton unreadable")

    monkeypatch.setattr(_triton_compat, "_triton_key_function", lambda: broken)
    _triton_compat.prefetch_triton_key()
    _triton_compat._await_triton_key()  # no exception escapes the thread


def test_the_cache_counts_as_cold_until_a_kernel_record_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKERNELS_CACHE_DIR", str(tmp_path / "src"))
    assert not kernels_recorded()  # (no folder yet)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "k_0123.py").write_text("")
    assert not kernels_recorded()  # a source written, never launched
    (tmp_path / "src" / "k_0123.foreach_float32.json").write_text("{}")
    assert kernels_recorded()


def test_the_runtime_modules_are_built_in_background_threads_once(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_triton_compat, "_runtime_threads", [])
    monkeypatch.setattr(_triton_compat, "_prefetched", set())
    built: list[tuple[str, object]] = []

    def record(what: object) -> None:
        built.append((threading.current_thread().name, what))

    monkeypatch.setattr(_triton_compat, "_build_driver", lambda: record("driver"))
    monkeypatch.setattr(_triton_compat, "_build_launcher", record)
    signatures = [("*i64", "constexpr"), ("*fp64", "i32", "constexpr")]
    _triton_compat.prefetch_runtime(signatures)
    _triton_compat.prefetch_runtime(signatures)  # (once per process)
    _triton_compat._await_runtime()
    assert sorted((what for _, what in built), key=str) == sorted(["driver", *signatures], key=str)
    assert all(name.startswith("optkernels-triton-runtime-") for name, _ in built)
    assert _triton_compat._prefetched == set(signatures)


def test_no_runtime_is_built_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_triton_compat, "_runtime_threads", [])
    _triton_compat.prefetch_runtime([("*i64",)])
    assert _triton_compat._runtime_threads == []
    _triton_compat._await_runtime()  # nothing to wait for


def test_a_launch_signature_has_the_jits_argument_types():
    import torch

    source = "def k(ptrs, n, values, BLOCK):\n    pass\n"
    fn = type("Fn", (), {"arg_names": ["ptrs", "n", "values", "BLOCK"], "src": source})
    args = (torch.zeros(2, dtype=torch.int64), 7, torch.zeros(1, dtype=torch.float64))
    assert _triton_compat.launch_signature(fn, args) == ("*i64", "i32", "*fp64", "constexpr")
    one = (args[0], 1, args[2])  # (the JIT specializes an int argument equal to 1)
    assert _triton_compat.launch_signature(fn, one) == ("*i64", "constexpr", "*fp64", "constexpr")


def test_a_first_launch_whose_launcher_was_not_prefetched_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(_triton_compat, "_prefetched", {("*i64", "constexpr")})

    def foreach_float32() -> None:  # (a kernel, as far as the message goes)
        pass

    def launch(*types: str) -> _triton_compat._Launch:
        specialization = [(t, None) for t in types]
        return _triton_compat._Launch(0, None, None, {}, None, specialization, None)

    with caplog.at_level("INFO", logger="optcompile.kernels"):
        _triton_compat._check_prefetched(foreach_float32, launch("*i64", "constexpr"))
        assert caplog.records == []
        _triton_compat._check_prefetched(foreach_float32, launch("*fp32", "constexpr"))
    assert "foreach_float32: no launcher prefetched" in caplog.text
