"""Client test wiring: every test starts from a fresh client state and leaves none behind."""

from __future__ import annotations

import pytest

from kserve_trio.client import kserve_init


@pytest.fixture(autouse=True)
def fresh_client_state():
    """``kserve_init()`` before and after each test: the default settings, and pools, routes
    and the loop per test (``kserve_shutdown`` alone keeps a test's ``kserve_init`` sizes)."""
    kserve_init()
    yield
    kserve_init()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Every async client test runs on both anyio backends (overrides the session-wide
    asyncio of tests/conftest.py; an in-process worker keeps its own asyncio loop thread)."""
    return request.param
