"""Messages as a call sends and receives them: caps, the raw form, the reply's encoding.

- ``Limits``: one server's message caps (``grpc.max_*_msg_bytes``, on decompressed sizes),
  whether every reply is compressed (``grpc.compress_responses``), the server's ``limits:``
  block (``edge``), whose name and repeated-field bounds ``rpc_codec.parse_message``
  applies, and the process's request bytes in flight its calls charge (``inflight``, the
  admission's ``InflightBytes``).
- ``RawMessage``: one received message exactly as it arrived (compressed ones still compressed).
- Parsing a message and a reply's pieces are transport-neutral (``serving.rpc_codec``).
- ``reply_encoding``: the algorithm a reply is compressed with: the request's when it was
  compressed and the client accepts it back, or any accepted one under ``compress_responses``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import IDENTITY, parse_accept_encoding
from kserve_trio.core.protocol import reply_encoding as negotiated_encoding

if TYPE_CHECKING:
    from kserve_trio.serving.admission import InflightBytes


@dataclass(frozen=True)
class Limits:
    """Message caps for one server (decompressed sizes), ``compress_responses`` and the bounds
    of names and repeated fields (``edge``, the server's ``limits:``)."""

    max_recv_bytes: int
    max_send_bytes: int
    compress_responses: bool = False
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    inflight: InflightBytes | None = field(default=None, compare=False)
    """The process's request bytes in flight (``Admission.bytes``); None: not counted."""


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One request message: ``data`` exactly as received (still compressed when
    ``compressed``)."""

    data: bytes
    compressed: bool = False


def reply_encoding(request_encoding: str, accept_encoding: str | None, limits: Limits) -> str:
    """The algorithm a reply is sent with (module docstring)."""
    if request_encoding == IDENTITY and not limits.compress_responses:
        return IDENTITY
    accepted = parse_accept_encoding(accept_encoding)
    return negotiated_encoding(request_encoding, accepted, limits.compress_responses)


__all__ = ["Limits", "RawMessage", "reply_encoding"]
