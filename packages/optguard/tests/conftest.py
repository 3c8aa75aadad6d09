"""Fixtures shared by optguard's tests."""

from __future__ import annotations

import os

import pytest
from optguard import native


@pytest.fixture(params=["python", "native"])
def checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the per-tensor checks in Python (the guard tree, attrgetter) and
    with the native module (built here if need be; a failed build fails the test unless
    OPTCOMPILE_NATIVE=0 says not to build it)."""
    if request.param == "python":
        monkeypatch.setenv("OPTCOMPILE_NATIVE", "0")
        monkeypatch.setattr(native, "_module", None)
        monkeypatch.setattr(native, "_status", native.status())
    elif native.start(wait=True) is None:
        if os.environ.get("OPTCOMPILE_NATIVE") == "0":
            pytest.skip("OPTCOMPILE_NATIVE=0")
        pytest.fail(f"the native checks did not build: {native.status()}")
    return str(request.param)
