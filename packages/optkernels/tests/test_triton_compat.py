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
