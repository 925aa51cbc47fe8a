"""The KServe V2 REST surface as gRPC calls: paths to RPCs, JSON bodies to request messages,
reply messages to JSON (pure).

The worker and the gateway answer a REST request by running the gRPC RPC it stands for, so both
transports share every rule, message and status; this module is the translation both use.

Routes (``{m}`` a model, ``{v}`` a version, ``{r}`` a shared-memory region; every segment
percent-decoded):

=======  ==================================================  ==============================
GET      ``/v2``                                             ServerMetadata
GET      ``/v2/health/live``, ``/v2/health/ready``           ServerLive, ServerReady
GET      ``/v2/models/{m}[/versions/{v}]``                   ModelMetadata
GET      ``.../ready``, ``.../config``, ``.../stats``        ModelReady, ModelConfig,
                                                             ModelStatistics
GET      ``/v2/models/stats``                                ModelStatistics (every model)
POST     ``.../infer``                                       ModelInfer
POST     ``/v2/repository/index``                            RepositoryIndex
POST     ``/v2/repository/models/{m}/load``, ``/unload``     RepositoryModelLoad / Unload
GET      ``/v2/systemsharedmemory[/region/{r}]/status``      SystemSharedMemoryStatus
POST     ``/v2/systemsharedmemory/region/{r}/register``      SystemSharedMemoryRegister
POST     ``/v2/systemsharedmemory[/region/{r}]/unregister``  SystemSharedMemoryUnregister
=======  ==================================================  ==============================

GET and POST ``/v2/logging`` are LogSettings (read; change and read) where the server answers it;
GET and POST ``/v2/trace/setting`` and ``/v2/models/{m}/trace/setting`` are TraceSetting, global
and per model (Triton's JSON: each setting a string or a list of strings, ``null`` clears it).
CUDA shared memory answers 501 by the RPC's name. An unknown path is
404, a known path with another method 405. Health and readiness answer 200 when true and 503
when false, with ``{"live"|"ready": bool}``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from kserve_trio.core.errors import (
    InvalidArgument,
    NotFound,
    ServingError,
    StatusCode,
    Unimplemented,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.core.protocol import (
    DEFAULT_JSON_DEPTH,
    DEFLATE,
    GZIP,
    HEADER_LENGTH,
    IDENTITY,
    JsonTooDeep,
    compress,
    load_json,
)
from kserve_trio.proto import inference as pb
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, PayloadTooLarge, inflate_body
from kserve_trio.serving.surface import UNIMPLEMENTED_RPCS

log = get_logger("kserve_trio.serving.rest")


def infer_route(version: str) -> str:
    """ModelInfer's REST route as a template (a traced call's ``http.route``)."""
    if version:
        return "/v2/models/{model_name}/versions/{model_version}/infer"
    return "/v2/models/{model_name}/infer"


class MethodNotAllowed(ServingError):
    """A known path asked with a method it does not serve (HTTP 405)."""

    status = StatusCode.INVALID_ARGUMENT
    http_status = 405


UNSUPPORTED = UNIMPLEMENTED_RPCS
"""RPCs a REST path names that the server does not answer, with the reason 501 gives
(``serving.surface``, shared with the gRPC adapters; both REST apps answer LogSettings and
TraceSetting)."""


@dataclass(frozen=True)
class RestCall:
    """What a request path asks: the RPC, and the model, version or region it names."""

    rpc: str
    method: str
    model: str = ""
    version: str = ""
    region: str = ""


_MODEL_TAILS = {
    "": ("GET", "ModelMetadata"),
    "ready": ("GET", "ModelReady"),
    "config": ("GET", "ModelConfig"),
    "stats": ("GET", "ModelStatistics"),
    "infer": ("POST", "ModelInfer"),
    "trace/setting": ("GET", "TraceSetting"),
}


def _call(method: str, want: str, rpc: str, **names: str) -> RestCall:
    # Trace and log settings are read with GET and written with POST.
    if method != want and not (rpc in ("TraceSetting", "LogSettings") and method == "POST"):
        if not (method == "HEAD" and want == "GET"):
            raise MethodNotAllowed(f"{method} is not allowed here; {rpc} is served on {want}")
    return RestCall(rpc, method, **names)


def route(method: str, path: str) -> RestCall:
    """The RPC a request stands for (``NotFound`` for an unknown path, ``MethodNotAllowed``
    for a known one asked with the wrong method)."""
    parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
    if not parts or parts[0] != "v2":
        raise NotFound(f"no such endpoint: {method} {path}")
    rest = parts[1:]
    if not rest:
        return _call(method, "GET", "ServerMetadata")
    head = rest[0]
    if head == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
        return _call(method, "GET", "ServerLive" if rest[1] == "live" else "ServerReady")
    if head == "models" and len(rest) >= 2:
        if rest[1:] == ["stats"]:
            return _call(method, "GET", "ModelStatistics")
        model, tail, version = rest[1], rest[2:], ""
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
        found = _MODEL_TAILS.get("/".join(tail))
        if found is not None:
            return _call(method, found[0], found[1], model=model, version=version)
    if head == "repository":
        if rest[1:] == ["index"]:
            return _call(method, "POST", "RepositoryIndex")
        if len(rest) == 4 and rest[1] == "models" and rest[3] in ("load", "unload"):
            rpc = "RepositoryModelLoad" if rest[3] == "load" else "RepositoryModelUnload"
            return _call(method, "POST", rpc, model=rest[2])
    if head in ("systemsharedmemory", "cudasharedmemory"):
        kind = "SystemSharedMemory" if head == "systemsharedmemory" else "CudaSharedMemory"
        tail, region = rest[1:], ""
        if len(tail) >= 2 and tail[0] == "region":
            region, tail = tail[1], tail[2:]
        verbs = {"status": "GET", "unregister": "POST"}
        if region:
            verbs["register"] = "POST"
        if len(tail) == 1 and tail[0] in verbs:
            return _call(method, verbs[tail[0]], kind + tail[0].capitalize(), region=region)
    if head == "trace" and rest[1:] == ["setting"]:
        return _call(method, "GET", "TraceSetting")
    if head == "logging" and len(rest) == 1:
        return _call(method, "GET", "LogSettings")
    raise NotFound(f"no such endpoint: {method} {path}")


# ----------------------------------------------------------------------------- request bodies


def request_body(request: HttpRequest, max_bytes: int) -> bytes | bytearray:
    """The request's body, decompressed when ``Content-Encoding`` says gzip or deflate;
    another encoding is UNIMPLEMENTED. Decompression is incremental with the cap on its
    output: it stops one byte past ``max_bytes`` and answers 413 (``PayloadTooLarge``), so a
    bomb costs the cap, not what it would inflate to. What it inflates to is charged to the
    request's bytes in flight as it grows (``HttpRequest.charge``; 429 when it does not fit)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if not encoding or encoding == IDENTITY:
        return request.body
    if encoding not in (GZIP, DEFLATE):
        raise Unimplemented(f"Content-Encoding '{encoding}' is not supported (gzip, deflate)")
    return inflate_body(request.body, encoding, max_bytes, request.charge)


def note_refusal(
    exc: BaseException, request: HttpRequest, max_json_depth: int, stats: EdgeStats | None
) -> None:
    """Count a request a body defence refused (``EdgeStats.refused_requests``); a body refused
    for its nesting is also logged, once per request and never with the body itself."""
    if isinstance(exc, JsonTooDeep):
        log.warning(
            "rest_json_too_deep",
            method=request.method,
            path=request.path,
            limit=max_json_depth,
            body_bytes=len(request.body),
        )
        if stats is not None:
            stats.refuse_request("json_too_deep")
    elif isinstance(exc, PayloadTooLarge) and stats is not None:
        stats.refuse_request("body_too_large")


def compressed_reply(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """``response`` compressed with the first of gzip and deflate the request's
    ``Accept-Encoding`` lists (``Content-Encoding`` says which); as it is otherwise. The
    ``Inference-Header-Content-Length`` of a binary reply counts the uncompressed JSON, which is
    what a client reads after inflating the body (tritonclient.http does)."""
    accepted = request.headers.get("accept-encoding", "")
    if not accepted:
        return response
    names = {part.split(";")[0].strip().lower() for part in accepted.split(",")}
    for algorithm in (GZIP, DEFLATE):
        if algorithm in names:
            body = response.body
            pieces = [body] if isinstance(body, bytes | bytearray | memoryview) else body
            packed = compress(b"".join(pieces), algorithm)
            headers = [*response.headers, ("content-encoding", algorithm)]
            return HttpResponse(response.status, packed, response.content_type, headers)
    return response


def header_length(request: HttpRequest) -> int | None:
    """``Inference-Header-Content-Length`` as an integer (None when absent)."""
    text = request.headers.get(HEADER_LENGTH)
    if text is None:
        return None
    if not text.strip().isdigit():
        raise InvalidArgument(f"Inference-Header-Content-Length '{text}' is not an integer")
    return int(text)


def _body_object(body: bytes | bytearray, rpc: str, max_depth: int) -> dict[str, Any]:
    if not body.strip():
        return {}
    doc = load_json(body, f"the {rpc} request", max_depth)
    if not isinstance(doc, dict):
        raise InvalidArgument(f"the {rpc} request must be a JSON object")
    return doc


def _int_field(doc: dict[str, Any], key: str, rpc: str) -> int:
    value = doc.get(key, 0)
    if value.__class__ is not int or value < 0:
        raise InvalidArgument(f"the {rpc} request's '{key}' must be a non-negative integer")
    return value


def _repository_parameters(doc: dict[str, Any], rpc: str) -> dict[str, pb.ModelRepositoryParameter]:
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"the {rpc} request's 'parameters' must be a JSON object")
    out = {}
    for key, value in params.items():
        if isinstance(value, bool):
            out[key] = pb.ModelRepositoryParameter(bool_param=value)
        elif isinstance(value, int):
            out[key] = pb.ModelRepositoryParameter(int64_param=value)
        elif isinstance(value, str):
            out[key] = pb.ModelRepositoryParameter(string_param=value)
        else:
            raise InvalidArgument(
                f"the {rpc} request's parameter '{key}' must be a boolean, integer or string"
            )
    return out


def grpc_request(
    call: RestCall, body: bytes | bytearray, max_json_depth: int = DEFAULT_JSON_DEPTH
) -> Any:
    """The request message of ``call``'s RPC (any RPC but ModelInfer), from the path and the
    JSON body (nested at most ``max_json_depth`` deep, else 400 before it is parsed)."""
    rpc = call.rpc
    if rpc == "ServerLive":
        return pb.ServerLiveRequest()
    if rpc == "ServerReady":
        return pb.ServerReadyRequest()
    if rpc == "ServerMetadata":
        return pb.ServerMetadataRequest()
    if rpc == "ModelMetadata":
        return pb.ModelMetadataRequest(name=call.model, version=call.version)
    if rpc == "ModelReady":
        return pb.ModelReadyRequest(name=call.model, version=call.version)
    if rpc == "ModelConfig":
        return pb.ModelConfigRequest(name=call.model, version=call.version)
    if rpc == "ModelStatistics":
        return pb.ModelStatisticsRequest(name=call.model, version=call.version)
    if rpc == "RepositoryIndex":
        doc = _body_object(body, rpc, max_json_depth)
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument("the RepositoryIndex request's 'ready' must be a boolean")
        return pb.RepositoryIndexRequest(ready=ready)
    if rpc in ("RepositoryModelLoad", "RepositoryModelUnload"):
        params = _repository_parameters(_body_object(body, rpc, max_json_depth), rpc)
        cls = pb.RepositoryModelLoadRequest
        if rpc == "RepositoryModelUnload":
            cls = pb.RepositoryModelUnloadRequest
        return cls(model_name=call.model, parameters=params)
    if rpc == "SystemSharedMemoryStatus":
        return pb.SystemSharedMemoryStatusRequest(name=call.region)
    if rpc == "SystemSharedMemoryRegister":
        doc = _body_object(body, rpc, max_json_depth)
        key = doc.get("key", "")
        if not isinstance(key, str):
            raise InvalidArgument("the SystemSharedMemoryRegister request's 'key' must be a string")
        return pb.SystemSharedMemoryRegisterRequest(
            name=call.region,
            key=key,
            offset=_int_field(doc, "offset", rpc),
            byte_size=_int_field(doc, "byte_size", rpc),
        )
    if rpc == "SystemSharedMemoryUnregister":
        return pb.SystemSharedMemoryUnregisterRequest(name=call.region)
    if rpc == "LogSettings":
        settings = {}
        for key, value in (
            _body_object(body, rpc, max_json_depth) if call.method == "POST" else {}
        ).items():
            if isinstance(value, bool):
                settings[key] = pb.LogSettingsRequestSettingValue(bool_param=value)
            elif isinstance(value, int) and value >= 0:
                settings[key] = pb.LogSettingsRequestSettingValue(uint32_param=value)
            elif isinstance(value, str):
                settings[key] = pb.LogSettingsRequestSettingValue(string_param=value)
            else:
                raise InvalidArgument(
                    f"log setting '{key}' must be a boolean, a non-negative integer or a string"
                )
        return pb.LogSettingsRequest(settings=settings)
    if rpc == "TraceSetting":
        doc = _body_object(body, rpc, max_json_depth) if call.method == "POST" else {}
        trace_settings = {}
        for key, value in doc.items():
            values = [value] if isinstance(value, str) else value
            if values is None:
                values = []
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise InvalidArgument(
                    f"trace setting '{key}' must be a string, a list of strings or null"
                )
            trace_settings[key] = pb.TraceSettingRequestSettingValue(value=values)
        return pb.TraceSettingRequest(settings=trace_settings, model_name=call.model)
    raise InvalidArgument(f"{rpc} has no REST request body")  # pragma: no cover


def unsupported(rpc: str) -> str:
    """The 501 message for an RPC the server does not answer (the gRPC adapter's wording)."""
    return f"{rpc} is not implemented: {UNSUPPORTED.get(rpc, 'not supported')}"


# ------------------------------------------------------------------------------ reply bodies


def message_json(message: Any) -> Any:
    """A reply message as Triton's REST JSON: fields by their proto names, every field present,
    64-bit integers as JSON numbers, enums by name, unset message fields left out."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        out = {}
        for f in dataclasses.fields(message):
            value = getattr(message, f.name)
            if value is None:
                continue
            out[f.name] = message_json(value)
        return out
    if isinstance(message, list):
        return [message_json(v) for v in message]
    if isinstance(message, dict):
        return {k: message_json(v) for k, v in message.items()}
    if isinstance(message, enum.Enum):
        return message.name
    return message


def _json(doc: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, json.dumps(doc, separators=(",", ":")).encode())


def _setting(value: Any) -> Any:
    for name in ("bool_param", "uint32_param", "string_param"):
        member = getattr(value, name, None)
        if member is not None:
            return member
    return None


def _flag(key: str, value: bool) -> HttpResponse:
    return _json({key: value}, 200 if value else 503)


_REPLIES: dict[str, Callable[[Any, RestCall], HttpResponse]] = {
    "ServerLive": lambda r, c: _flag("live", r.live),
    "ServerReady": lambda r, c: _flag("ready", r.ready),
    "ModelReady": lambda r, c: _json({"name": c.model, "ready": r.ready}, 200 if r.ready else 503),
    "ServerMetadata": lambda r, c: _json(message_json(r)),
    "ModelMetadata": lambda r, c: _json(message_json(r)),
    "ModelConfig": lambda r, c: _json(message_json(r.config) if r.config is not None else {}),
    "ModelStatistics": lambda r, c: _json(message_json(r)),
    "RepositoryIndex": lambda r, c: _json(message_json(r.models)),
    "LogSettings": lambda r, c: _json({k: _setting(v) for k, v in sorted(r.settings.items())}),
    "TraceSetting": lambda r, c: _json(
        {
            k: list(v.value) if k == "trace_level" else ",".join(v.value)
            for k, v in sorted(r.settings.items())
        }
    ),
    "SystemSharedMemoryStatus": lambda r, c: _json(
        [message_json(v) for _, v in sorted(r.regions.items())]
    ),
}


def reply_response(call: RestCall, reply: Any) -> HttpResponse:
    """The REST reply for ``call``'s RPC reply message (an empty 200 for the RPCs whose reply
    carries nothing: load, unload, register, unregister)."""
    make = _REPLIES.get(call.rpc)
    if make is None:
        return HttpResponse(200, b"")
    return make(reply, call)


REPLY_TYPES: dict[str, type] = {
    "ServerLive": pb.ServerLiveResponse,
    "ServerReady": pb.ServerReadyResponse,
    "ServerMetadata": pb.ServerMetadataResponse,
    "ModelMetadata": pb.ModelMetadataResponse,
    "ModelReady": pb.ModelReadyResponse,
    "ModelConfig": pb.ModelConfigResponse,
    "ModelStatistics": pb.ModelStatisticsResponse,
    "RepositoryIndex": pb.RepositoryIndexResponse,
    "RepositoryModelLoad": pb.RepositoryModelLoadResponse,
    "RepositoryModelUnload": pb.RepositoryModelUnloadResponse,
    "SystemSharedMemoryStatus": pb.SystemSharedMemoryStatusResponse,
    "SystemSharedMemoryRegister": pb.SystemSharedMemoryRegisterResponse,
    "SystemSharedMemoryUnregister": pb.SystemSharedMemoryUnregisterResponse,
    "LogSettings": pb.LogSettingsResponse,
    "TraceSetting": pb.TraceSettingResponse,
}
"""Each RPC's reply type (what a side that gets reply bytes parses them with)."""


__all__ = [
    "REPLY_TYPES",
    "UNSUPPORTED",
    "MethodNotAllowed",
    "RestCall",
    "compressed_reply",
    "grpc_request",
    "header_length",
    "infer_route",
    "message_json",
    "note_refusal",
    "reply_response",
    "request_body",
    "route",
    "unsupported",
]
