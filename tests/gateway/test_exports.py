"""The gateway's public surface (stated once in its ``__init__``; this test pins it). Its
layering (no jax, runtime, worker or node) is checked with the others' in
tests/core/test_proto_fresh.py."""

from __future__ import annotations

import kserve_trio.gateway as gateway

EXPECTED = {
    "GatewayConfig",
    "Resolver",
    "RoutingPolicy",
    "RunningGateway",
    "SchedulingMode",
    "WorkBasis",
    "hosts_file_resolver",
    "load_gateway_config",
    "serve_gateway",
    "stop",
    "system_resolver",
}


def test_gateway_exports_exactly_its_public_surface():
    assert set(gateway.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(gateway, name) is not None
