"""Client test wiring: every test starts from a fresh client state and leaves none behind."""

from __future__ import annotations

import pytest

from kserve_trio.client import kserve_shutdown


@pytest.fixture(autouse=True)
def fresh_client_state():
    """``kserve_shutdown`` before and after each test: pools, routes and the loop are per test."""
    kserve_shutdown()
    yield
    kserve_shutdown()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Every async client test runs on both anyio backends (overrides the session-wide
    asyncio of tests/conftest.py; an in-process worker keeps its own asyncio loop thread)."""
    return request.param
