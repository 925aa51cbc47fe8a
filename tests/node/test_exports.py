"""The node package's public surface is what its ``__init__`` states."""

from __future__ import annotations

import inspect

import kserve_trio.node as node


def test_public_surface():
    assert sorted(node.__all__) == [
        "ChildSpec",
        "Detected",
        "GatewaySource",
        "Machine",
        "NodePlan",
        "detect_devices",
        "gateway_launch",
        "plan_node",
        "probe_worker_ready",
        "run_plan",
        "supervise",
        "thread_budget",
    ]
    for name in node.__all__:
        assert getattr(node, name) is not None


def test_supervise_signature_matches_the_documented_api():
    params = inspect.signature(node.supervise).parameters
    assert list(params) == [
        "node_path",
        "role",
        "gateway_path",
        "sink",
        "env",
        "install_signal_handlers",
        "runtime_dir",
    ]
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in list(params)[1:])
    assert params["install_signal_handlers"].default is True
    probe = inspect.signature(node.probe_worker_ready).parameters
    assert list(probe)[:2] == ["node_path", "worker"]
    assert probe["worker"].default is None
