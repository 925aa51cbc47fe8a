"""The server layer's tests run on both anyio backends and both HTTP/2 engines: the layer serves
asyncio and trio alike, on ngh2 and on h2."""

from __future__ import annotations

import pytest

from kserve_trio.http2 import ENGINES


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Overrides the session-wide asyncio of tests/conftest.py."""
    return request.param


@pytest.fixture(params=ENGINES)
def http2_engine(request: pytest.FixtureRequest) -> str:
    """The HTTP/2 engine the server under test runs."""
    return request.param
