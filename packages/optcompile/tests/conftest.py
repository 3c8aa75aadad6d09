from __future__ import annotations

import optcompile
import pytest


@pytest.fixture(autouse=True)
def _reset() -> None:
    optcompile.reset()
