"""serving.rest_routes: REST paths to the gRPC RPCs they stand for, JSON bodies to request
messages, reply messages to Triton's JSON (pure)."""

from __future__ import annotations

import json

import pytest

from kserve_trio.core.errors import InvalidArgument, NotFound
from kserve_trio.proto import inference as pb
from kserve_trio.serving.http import error_response
from kserve_trio.serving.rest_routes import (
    MethodNotAllowed,
    RestCall,
    grpc_request,
    message_json,
    reply_response,
    route,
)


@pytest.mark.parametrize(
    ("method", "path", "want"),
    [
        ("GET", "/v2", RestCall("ServerMetadata", "GET")),
        ("HEAD", "/v2/", RestCall("ServerMetadata", "HEAD")),
        ("GET", "/v2/health/live", RestCall("ServerLive", "GET")),
        ("GET", "/v2/health/ready", RestCall("ServerReady", "GET")),
        ("GET", "/v2/models/m", RestCall("ModelMetadata", "GET", model="m")),
        ("GET", "/v2/models/m/versions/1", RestCall("ModelMetadata", "GET", "m", "1")),
        ("GET", "/v2/models/a%2Fb%20c/ready", RestCall("ModelReady", "GET", model="a/b c")),
        ("GET", "/v2/models/m/versions/2/config", RestCall("ModelConfig", "GET", "m", "2")),
        ("GET", "/v2/models/m/stats", RestCall("ModelStatistics", "GET", model="m")),
        ("GET", "/v2/models/stats", RestCall("ModelStatistics", "GET")),
        ("POST", "/v2/models/m/infer", RestCall("ModelInfer", "POST", model="m")),
        ("POST", "/v2/models/m/versions/1/infer", RestCall("ModelInfer", "POST", "m", "1")),
        ("POST", "/v2/repository/index", RestCall("RepositoryIndex", "POST")),
        ("POST", "/v2/repository/models/m/load", RestCall("RepositoryModelLoad", "POST", "m")),
        ("POST", "/v2/repository/models/m/unload", RestCall("RepositoryModelUnload", "POST", "m")),
        ("GET", "/v2/systemsharedmemory/status", RestCall("SystemSharedMemoryStatus", "GET")),
        (
            "GET",
            "/v2/systemsharedmemory/region/r1/status",
            RestCall("SystemSharedMemoryStatus", "GET", region="r1"),
        ),
        (
            "POST",
            "/v2/systemsharedmemory/region/r1/register",
            RestCall("SystemSharedMemoryRegister", "POST", region="r1"),
        ),
        (
            "POST",
            "/v2/systemsharedmemory/unregister",
            RestCall("SystemSharedMemoryUnregister", "POST"),
        ),
        ("GET", "/v2/cudasharedmemory/status", RestCall("CudaSharedMemoryStatus", "GET")),
        ("POST", "/v2/trace/setting", RestCall("TraceSetting", "POST")),
        ("GET", "/v2/models/m/trace/setting", RestCall("TraceSetting", "GET", model="m")),
        ("GET", "/v2/logging", RestCall("LogSettings", "GET")),
        ("POST", "/v2/logging", RestCall("LogSettings", "POST")),
    ],
)
def test_paths_name_their_rpc(method, path, want):
    assert route(method, path) == want


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/", 404),
        ("GET", "/v1/models/m", 404),
        ("GET", "/v2/models/m/nope", 404),
        ("POST", "/v2/systemsharedmemory/register", 404),  # registering needs a region
        ("POST", "/v2/models/m", 405),
        ("GET", "/v2/models/m/infer", 405),
        ("GET", "/v2/repository/index", 405),
        ("DELETE", "/v2/health/live", 405),
    ],
)
def test_unknown_paths_are_404_and_wrong_methods_405(method, path, status):
    with pytest.raises((NotFound, MethodNotAllowed)) as err:
        route(method, path)
    response = error_response(err.value)
    assert response.status == status
    assert json.loads(response.body)["error"] == err.value.message


def test_bodies_become_the_request_messages():
    call = RestCall("SystemSharedMemoryRegister", "POST", region="r")
    body = json.dumps({"key": "/k", "offset": 8, "byte_size": 64}).encode()
    assert grpc_request(call, body) == pb.SystemSharedMemoryRegisterRequest(
        name="r", key="/k", offset=8, byte_size=64
    )
    load = grpc_request(
        RestCall("RepositoryModelLoad", "POST", model="m"),
        json.dumps({"parameters": {"a": True, "b": 3, "c": "x"}}).encode(),
    )
    assert load.model_name == "m" and load.parameters == {
        "a": pb.ModelRepositoryParameter(bool_param=True),
        "b": pb.ModelRepositoryParameter(int64_param=3),
        "c": pb.ModelRepositoryParameter(string_param="x"),
    }
    assert grpc_request(RestCall("RepositoryIndex", "POST"), b"") == pb.RepositoryIndexRequest()
    index = grpc_request(RestCall("RepositoryIndex", "POST"), b'{"ready": true}')
    assert index.ready is True
    for call, body, message in [
        (RestCall("RepositoryIndex", "POST"), b"[1]", "must be a JSON object"),
        (RestCall("RepositoryIndex", "POST"), b'{"ready": 1}', "'ready' must be a boolean"),
        (
            RestCall("SystemSharedMemoryRegister", "POST", region="r"),
            b'{"key": "/k", "byte_size": -1}',
            "'byte_size' must be a non-negative integer",
        ),
        (RestCall("RepositoryModelLoad", "POST", model="m"), b"{", "malformed JSON"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            grpc_request(call, body)


def test_replies_are_triton_json():
    stats = pb.ModelStatisticsResponse(
        model_stats=[pb.ModelStatistics(name="m", version="1", inference_count=1 << 40)]
    )
    doc = message_json(stats)
    assert doc["model_stats"][0]["inference_count"] == 1 << 40  # a JSON number, not a string
    cfg = pb.ModelConfig(
        name="m", input=[pb.ModelInput(name="x", data_type=pb.DataType.TYPE_FP32, dims=[4])]
    )
    assert message_json(cfg)["input"][0]["data_type"] == "TYPE_FP32"
    ready = reply_response(RestCall("ServerReady", "GET"), pb.ServerReadyResponse(ready=False))
    assert (ready.status, json.loads(ready.body)) == (503, {"ready": False})
    model = reply_response(
        RestCall("ModelReady", "GET", model="m"), pb.ModelReadyResponse(ready=True)
    )
    assert (model.status, json.loads(model.body)) == (200, {"name": "m", "ready": True})
    regions = pb.SystemSharedMemoryStatusResponse(
        regions={
            "b": pb.SystemSharedMemoryStatusResponseRegionStatus(name="b", key="/b", byte_size=2),
            "a": pb.SystemSharedMemoryStatusResponseRegionStatus(name="a", key="/a", byte_size=1),
        }
    )
    listed = json.loads(reply_response(RestCall("SystemSharedMemoryStatus", "GET"), regions).body)
    assert [r["name"] for r in listed] == ["a", "b"]
    assert listed[0] == {"name": "a", "key": "/a", "offset": 0, "byte_size": 1}
    empty = reply_response(RestCall("SystemSharedMemoryRegister", "POST"), None)
    assert (empty.status, empty.body) == (200, b"")
