from __future__ import annotations

import re

import pytest
from optkernels import BACKENDS, BackendError, TorchBackend, get_backend


def test_torch_backend_is_the_torch_reference_backend():
    assert isinstance(get_backend("torch"), TorchBackend)


def test_triton_backend_is_not_available_yet():
    with pytest.raises(BackendError, match="not available"):
        get_backend("triton")


def test_triton_error_suggests_the_torch_backend():
    with pytest.raises(BackendError, match=re.escape("backend='torch'")):
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
        assert "not available" in str(exc)
    else:
        assert backend.name == name
