"""The messages of the device/front-end channel: tuples whose first item says what they are.

Front end to device process:

- ``(READY, grpc_port, http_port)``: the front end listens (sent once);
- ``(REQUEST, id, kind, rpc, deadline_ns, payload)``: serve this; ``kind`` is one of the
  ``KIND_*`` below, ``rpc`` the RPC's name (REST: the ``HttpRequest`` fields), ``deadline_ns``
  the call's absolute ``time.monotonic_ns()`` deadline (0: none; CLOCK_MONOTONIC is one clock
  for every process of the machine); for ``KIND_INFER`` and ``KIND_STREAM`` ``rpc`` is instead the caller's W3C
  trace context (``trace_settings.caller_context``; None: none, or the worker does not trace), so the device process's span
  continues the caller's trace;
- ``(CANCEL, id)``: the client gave up on ``id`` (its answer is still sent, and discarded);
- ``(FREE, [slot, ...])``: reply slots the front end has copied out;
- ``(EDGE, exposition)``: the front end's edge counters changed (Prometheus text);
- ``(PONG, seq)``: the answer to ``(PING, seq)``, sent by the front end's event loop.

Device process to front end:

- ``(HELLO, config, index, rpcs)``: the first message: the worker's resolved configuration, the
  front end's index and the RPCs it forwards;
- ``(DONE, id, status, message, payload, extra)``: the answer; ``status`` a gRPC status code
  (0: OK), ``extra`` what the kind needs besides the reply (a stream message: the request's
  model and id for an error answer the front end must write itself);
- ``(LOG, settings)``: the log settings now in force (a LogSettings RPC changed them), as
  ``core.logging.update_log_settings`` takes them;
- ``(DRAIN,)``: the worker is shutting down: stop accepting, drain, exit;
- ``(PING, seq)``: the liveness probe (``serving.liveness``): answer ``(PONG, seq)`` at once.

A ``Payload`` is bytes carried in the frame itself, or ``(slot, nbytes)``: a slot of the
sender's arena (``Ring`` slots are absolute positions; the offset is ``slot % size``).
"""

from __future__ import annotations

READY = 1
REQUEST = 2
CANCEL = 3
FREE = 4
EDGE = 5
PONG = 6
HELLO = 10
DONE = 11
LOG = 12
DRAIN = 13
PING = 14

KIND_UNARY = 0
"""A unary RPC answered by the device process's RPC layer: request bytes in, reply bytes out."""
KIND_INFER = 1
"""A ModelInfer request: its message in the request arena, its reply in the reply arena."""
KIND_STREAM = 2
"""One message of a ModelStreamInfer call, answered with the stream's answer message."""
KIND_REST = 3
"""One REST request (method, path, query, headers, body), answered with the HTTP reply."""

Payload = bytes | tuple[int, int]

__all__ = [
    "CANCEL",
    "DONE",
    "DRAIN",
    "EDGE",
    "FREE",
    "HELLO",
    "KIND_INFER",
    "KIND_REST",
    "KIND_STREAM",
    "KIND_UNARY",
    "LOG",
    "PING",
    "PONG",
    "READY",
    "REQUEST",
    "Payload",
]
