"""The caller's headers a gateway passes on to the workers it calls for that caller.

A worker may restrict protocols (``core.process.restricted``): its model-repository, shared-memory or
control RPCs need a header the client sends. Through a gateway, the client's call becomes
one or several worker calls (a forward, a fan-out to every worker); each of them carries the
caller's custom metadata, so the header the worker wants arrives with every call made on the
client's behalf, and the gateway needs no copy of the workers' secrets.

``passing_on(headers)`` sets the headers for the task serving one call (and the tasks it
starts: a fan-out's); ``WorkerClient`` reads them with ``passed_on`` when a call gives no
metadata of its own. Calls the gateway makes for itself (health and routing probes, the
placement scheduler) run outside any caller's context and carry the gateway's own headers
(``worker_client.headers``), never a client's.

What is passed on: a gRPC call's custom metadata (``Call.metadata``: no ``grpc-*`` or
reserved headers) without HTTP hop-by-hop headers; a REST request's headers without those the
HTTP exchange itself uses (``rest_headers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

from kserve_trio.serving.grpc import Call, Method

Headers = Mapping[str, Any]

_CALLER: ContextVar[Headers | None] = ContextVar("kserve_trio_caller_headers", default=None)

_HTTP_ONLY = frozenset(
    {
        "accept",
        "accept-encoding",
        "connection",
        "content-encoding",
        "content-length",
        "content-type",
        "expect",
        "host",
        "inference-header-content-length",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
    }
)


@contextlib.contextmanager
def passing_on(headers: Headers | None) -> Iterator[None]:
    """Within the block, worker calls without metadata of their own carry ``headers``."""
    token = _CALLER.set(dict(headers or {}))
    try:
        yield
    finally:
        _CALLER.reset(token)


def passed_on(metadata: Headers | None, own: Headers | None = None) -> Headers | None:
    """``metadata`` when the call has its own; else, serving a caller, the caller's headers;
    else (the gateway's own call) ``own``."""
    if metadata is not None:
        return metadata
    caller = _CALLER.get()
    if caller is None:
        return own
    return caller or None


def grpc_headers(metadata: Headers) -> dict[str, Any] | None:
    """A gRPC caller's custom metadata to pass on (HTTP hop-by-hop headers dropped)."""
    out = {k: v for k, v in metadata.items() if k not in _HTTP_ONLY}
    return out or None


def rest_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """A REST request's headers to pass on as gRPC metadata: every header but those of the
    HTTP exchange itself (and any ``grpc-*`` or pseudo-header a client might send)."""
    out = {
        k: v for k, v in headers.items() if k not in _HTTP_ONLY and not k.startswith(("grpc-", ":"))
    }
    return out or None


def pass_caller_headers(methods: Mapping[str, Method]) -> dict[str, Method]:
    """``methods`` with each call's custom metadata passed on to the worker calls it makes."""

    def wrapped(method: Method) -> Method:
        run = method.run

        async def passing(call: Call) -> None:
            with passing_on(grpc_headers(call.metadata)):
                await run(call)

        return replace(method, run=passing)

    return {path: wrapped(method) for path, method in methods.items()}


__all__ = [
    "grpc_headers",
    "pass_caller_headers",
    "passed_on",
    "passing_on",
    "rest_headers",
]
