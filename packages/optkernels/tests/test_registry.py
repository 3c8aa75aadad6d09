from __future__ import annotations

import re

import pytest
import torch
from optkernels import BACKENDS, BackendError, TorchBackend, get_backend


def test_torch_backend_is_the_torch_reference_backend():
    assert isinstance(get_backend("torch"), TorchBackend)


def test_triton_backend_runs_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_backend("triton").name == "triton"


def test_triton_without_cuda_or_interpreter_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendError, match=re.escape("TRITON_INTERPRET=1")):
        get_backend("triton")


def test_unknown_backend_error_names_it_and_lists_the_choices():
    with pytest.raises(BackendError) as info:
        get_backend("tpu")
    assert "'tpu'" in str(info.value)
    assert all(name in str(info.value) for name in BACKENDS)


@pytest.mark.parametrize("name", BACKENDS)
def test_no_listed_backend_is_reported_as_unknown(name):
    try:
        backend = get_backend(name)
    except BackendError as exc:
        assert "cannot run here" in str(exc)
    else:
        assert backend.name == name
