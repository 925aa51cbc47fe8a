"""The server layer's tests run on both anyio backends: the layer serves asyncio and trio alike."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Overrides the session-wide asyncio of tests/conftest.py."""
    return request.param
