"""The grpclib server our processes listen with: grpclib's, plus a check of each call's headers.

grpclib answers a malformed ``grpc-timeout`` with UNKNOWN and fails on a ``-bin`` metadata value
that is not base64 before any handler runs, and it keeps the request headers to itself.
``GrpcServer`` installs a connection handler that, for every new call:

1. checks the headers our handlers depend on (``header_problem``, pure): a ``grpc-timeout``
   that is not 1-8 digits and a unit is INVALID_ARGUMENT; a ``-bin`` value that is not base64
   is INVALID_ARGUMENT; a ``grpc-encoding`` we cannot decode is UNIMPLEMENTED, answered with
   ``grpc-accept-encoding`` as the compression spec asks. The call is answered there, with a
   clear message, and no handler task is started;
2. otherwise keeps the headers on grpclib's protocol stream (``request_headers``) so handlers
   can read ``grpc-encoding`` and ``grpc-accept-encoding``, then lets grpclib dispatch the call
   as usual (method, content type and ``te`` checks stay grpclib's, with their HTTP statuses).
"""

from __future__ import annotations

import asyncio
import binascii
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

import grpclib.server
from grpclib.const import Status
from grpclib.protocol import H2Protocol

from kserve_trio.core import compression
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.call_headers import header_value, request_headers
from kserve_trio.serving.fast_unary import FastUnary, fast_path_enabled, plain_call

log = get_logger("kserve_trio.serving.grpc")

Headers = Sequence[tuple[str, str]]

_TIMEOUT_RE = re.compile(r"^[0-9]{1,8}[HMSmun]$")
_B64_RE = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")


def header_problem(headers: Headers) -> tuple[Status, str, Headers] | None:
    """What is wrong with a call's headers, as (status, message, extra trailers), or None."""
    for key, value in headers:
        if key == "grpc-timeout" and not _TIMEOUT_RE.match(value):
            return (
                Status.INVALID_ARGUMENT,
                f"malformed grpc-timeout header {value!r}: expected 1-8 digits and a unit "
                "(H, M, S, m, u, n)",
                (),
            )
        if key.endswith("-bin"):
            unpadded = value.rstrip("=")
            padded = unpadded + "=" * (-len(unpadded) % 4)
            if not _B64_RE.match(value):
                return (
                    Status.INVALID_ARGUMENT,
                    f"metadata {key} is not base64",
                    (),
                )
            try:
                binascii.a2b_base64(padded)
            except binascii.Error:
                return (Status.INVALID_ARGUMENT, f"metadata {key} is not base64", ())
        if key == "grpc-encoding":
            try:
                compression.parse_encoding(value)
            except Exception as exc:
                return (
                    Status.UNIMPLEMENTED,
                    str(exc),
                    (("grpc-accept-encoding", compression.ACCEPT_ENCODING),),
                )
    return None


async def _refuse(
    h2_stream: Any,
    status: Status,
    message: str,
    extra: Headers,
    release_stream: Callable[[], Any],
) -> None:
    try:
        await h2_stream.send_headers(
            [
                (":status", "200"),
                ("content-type", "application/grpc+proto"),
                ("grpc-status", str(status.value)),
                ("grpc-message", message.encode("ascii", "replace").decode("ascii")),
                *extra,
            ],
            end_stream=True,
        )
    except Exception as exc:  # the peer may already be gone
        log.debug("refusal_not_sent", error=repr(exc))
    finally:
        release_stream()


def _fast_unary(func: Any) -> FastUnary | None:
    """The ``FastUnary`` of a handler ``grpc_adapter.unary(..., fast=True)`` built (its
    ``fast_spec``), made once and kept on the handler; None for any other handler."""
    fast = getattr(func, "fast", None)
    if fast is None:
        spec = getattr(func, "fast_spec", None)
        if spec is None:
            return None
        fast = func.fast = FastUnary(*spec)
    return fast


class _Handler(grpclib.server.Handler):
    """grpclib's per-connection handler with the header checks of this module; with
    ``fast`` on, plain calls to a handler that carries a ``FastUnary`` are served by it
    (``serving.fast_unary``), every other call by grpclib."""

    fast = False

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        problem = header_problem(headers)
        if problem is not None:
            status, message, extra = problem
            log.info("call_refused", status=status.name, message=message)
            self.__gc_step__()
            self._tasks[stream] = self.loop.create_task(
                _refuse(stream, status, message, extra, release_stream)
            )
            return
        stream.request_headers = headers
        if self.fast:
            plain = plain_call(headers)
            if plain is not None:
                method = self.mapping.get(plain[0])
                fast = _fast_unary(method.func) if method is not None else None
                if fast is not None and not fast.limits.compress_responses:
                    self.__gc_step__()
                    self._tasks[stream] = self.loop.create_task(
                        fast.serve(stream, plain[1], release_stream)
                    )
                    return
        super().accept(stream, headers, release_stream)


class GrpcServer(grpclib.server.Server):
    """``grpclib.server.Server`` whose connections use ``_Handler``. ``fast_unary`` (default:
    the ``KSERVE_TRIO_GRPC_FAST_UNARY`` switch, on unless 0) enables the fast path for the
    connections made after it is set."""

    fast_unary: bool | None = None

    def _protocol_factory(self) -> H2Protocol:
        self.__gc_step__()
        handler = _Handler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
        handler.fast = fast_path_enabled() if self.fast_unary is None else self.fast_unary
        self._handlers.add(handler)
        return H2Protocol(handler, self._config, self._h2_config)

    @property
    def port(self) -> int:
        """The bound port (after ``start``)."""
        server: asyncio.AbstractServer | None = self._server
        if server is None:
            raise RuntimeError("the server is not started")
        # asyncio.Server and uvloop's server both have ``sockets``; AbstractServer declares none.
        sockets: Sequence[socket.socket] = getattr(server, "sockets", None) or ()
        if not sockets:
            raise RuntimeError("the server has no listening socket")
        return sockets[0].getsockname()[1]


__all__ = ["GrpcServer", "header_problem", "header_value", "request_headers"]
