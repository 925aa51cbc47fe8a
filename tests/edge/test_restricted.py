"""Restricted protocols (Triton's ``--grpc-restricted-protocol`` / ``--http-restricted-api``).

A CLI worker restricts model-repository, shared-memory, logging and control to the header
``admin-key: s3cret`` (``INFERENCE_SERVER_ENDPOINTS_RESTRICTED_PROTOCOLS``); a CLI gateway in
front of it restricts model-repository to its own ``gw-key: g4te``
(``KSERVE_TRIO_GATEWAY_RESTRICTED_PROTOCOLS``), passes each caller's headers on to the worker,
and sends its own ``worker_client.headers`` only on its own probes (never for a client).
Without the header a restricted RPC is PERMISSION_DENIED (REST 403), with it it is served, and
the open groups (health, metadata, inference) are unaffected, on gRPC and REST alike.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.restricted import Restrictions, group_of, parse_restrictions
from tests.edge.edge_procs import Pair, raw_call, rest, worker_and_gateway

WORKER_KEY = {"admin-key": "s3cret"}
GATEWAY_KEY = {"gw-key": "g4te"}
CONTROL_STATUS = "/reactant_control.ControlService/ModelControlStatus"


@pytest.fixture(scope="module")
def pair(demo_repo):
    with worker_and_gateway(
        demo_repo,
        worker_env={
            "INFERENCE_SERVER_ENDPOINTS_RESTRICTED_PROTOCOLS": (
                "model-repository,shared-memory,logging,control:admin-key=s3cret"
            )
        },
        gateway_env={
            "KSERVE_TRIO_GATEWAY_RESTRICTED_PROTOCOLS": "model-repository:gw-key=g4te",
            # the gateway's own probes read RepositoryIndex and ModelControlStatus
            "KSERVE_TRIO_GATEWAY_WORKER_CLIENT_HEADERS": "admin-key=s3cret",
        },
    ) as p:
        yield p


def _denied(call) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == "StatusCode.PERMISSION_DENIED", info.value
    return info.value.message() or ""


def _open_groups_work(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_model_metadata("mlp")
    assert metadata is not None and metadata.name == "mlp"  # type: ignore[attr-defined]
    x = grpcclient.InferInput("input_0", [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    result = client.infer("mlp", [x])
    assert result is not None
    out = result.as_numpy("output")
    assert out is not None and out.shape == (1, 8)


def _index_names(client: grpcclient.InferenceServerClient, headers: dict[str, str]) -> list:
    index = client.get_model_repository_index(headers=headers)
    assert index is not None
    return [m.name for m in index.models]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_worker_grpc_restricts_groups_by_header(pair: Pair):
    client = pair.worker.client()
    message = _denied(lambda: client.get_model_repository_index())
    assert "model-repository" in message and "admin-key" in message and "s3cret" not in message
    _denied(lambda: client.get_system_shared_memory_status())
    _denied(lambda: client.get_log_settings())
    _denied(lambda: client.get_model_repository_index(headers={"admin-key": "wrong"}))
    assert _index_names(client, WORKER_KEY) == ["mlp"]
    assert client.get_log_settings(headers=WORKER_KEY) is not None
    code, _, _ = raw_call(pair.worker.url, CONTROL_STATUS, b"")
    assert code.name == "PERMISSION_DENIED"
    code, _, _ = raw_call(pair.worker.url, CONTROL_STATUS, b"", tuple(WORKER_KEY.items()))
    assert code.name == "OK"
    _open_groups_work(client)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_worker_rest_restricts_groups_by_header(pair: Pair):
    port = pair.worker_http
    status, body = rest(port, "POST", "/v2/repository/index", b"{}")
    assert status == 403, body
    status, body = rest(port, "POST", "/v2/repository/index", b"{}", WORKER_KEY)
    assert status == 200 and json.loads(body)[0]["name"] == "mlp"
    assert rest(port, "GET", "/v2/logging")[0] == 403
    assert rest(port, "GET", "/v2/logging", headers=WORKER_KEY)[0] == 200
    assert rest(port, "GET", "/v2/systemsharedmemory/status")[0] == 403
    assert rest(port, "GET", "/v2/health/ready")[0] == 200
    assert rest(port, "GET", "/v2/models/mlp")[0] == 200


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_through_the_gateway_both_restrictions_apply(pair: Pair):
    client = pair.gateway.client()
    both = {**GATEWAY_KEY, **WORKER_KEY}
    message = _denied(lambda: client.get_model_repository_index(headers=WORKER_KEY))
    assert "gw-key" in message  # the gateway's own restriction
    # the worker refuses a call without its header (the index fan-out leaves a refusing
    # worker out); with both headers the caller's are passed on and the worker answers
    assert _index_names(client, GATEWAY_KEY) == []
    assert _index_names(client, both) == ["mlp"]
    # shared memory is restricted on the worker only: the caller's header reaches it
    message = _denied(lambda: client.unregister_system_shared_memory("nothing"))
    assert "admin-key" in message
    client.unregister_system_shared_memory("nothing", headers=WORKER_KEY)
    _open_groups_work(client)
    port = pair.gateway_http
    assert rest(port, "POST", "/v2/repository/index", b"{}", WORKER_KEY)[0] == 403
    status, body = rest(port, "POST", "/v2/repository/index", b"{}", GATEWAY_KEY)
    assert status == 200 and json.loads(body) == []  # the worker refused: left out
    status, body = rest(port, "POST", "/v2/repository/index", b"{}", both)
    assert status == 200 and [m["name"] for m in json.loads(body)] == ["mlp"]
    assert rest(port, "GET", "/v2/systemsharedmemory/status")[0] == 200  # the gateway's own
    assert rest(port, "GET", "/v2/health/ready")[0] == 200


def test_restriction_specs_parse_like_tritons_flag():
    (r,) = parse_restrictions(["model-repository, Logging:Admin-Key=v=1"])
    assert r.groups == {"model-repository", "logging"} and r.key == "admin-key"
    assert r.value == "v=1"
    for bad in ("health", "nope:k=v", "health:=v", "health:k=", "health:grpc-x=v", ":k=v"):
        with pytest.raises(ConfigError):
            parse_restrictions([bad])
    with pytest.raises(ConfigError, match="restricted twice"):
        parse_restrictions(["health:a=1", "health,logging:b=2"])
    assert group_of("/inference.GRPCInferenceService/RepositoryIndex") == "model-repository"
    assert group_of("/reactant_control.GatewayControlService/Repack") == "control"
    assert group_of("/grpc.health.v1.Health/Check") is None
    restrictions = Restrictions(parse_restrictions(["statistics:k=v"]))
    restrictions.check("health", {})  # open
    restrictions.check("statistics", {"k": b"v"})


def test_worker_cli_flag_sets_the_restrictions():
    import argparse

    from kserve_trio.core.process.config import build_config, validate_config
    from kserve_trio.worker.cli import configure_parser, overrides_from_args

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(
        ["--restricted-protocol", "logging:a=1", "--restricted-protocol", "control:b=2"]
    )
    cfg = build_config(overrides_from_args(args))
    validate_config(cfg, check_dirs=False)
    assert cfg.endpoints.restricted_protocols == ("logging:a=1", "control:b=2")
    bad = build_config({"endpoints": {"restricted_protocols": ["nope:a=1"]}})
    with pytest.raises(ConfigError, match="unknown group 'nope'"):
        validate_config(bad, check_dirs=False)
