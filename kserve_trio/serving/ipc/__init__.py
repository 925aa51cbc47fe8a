"""The node-local channel between a worker's device process and its front-end processes.

- ``Channel``: batches of messages over one Unix stream socket, a frame per batch
  (``_channel``).
- ``Arena`` and ``Ring``: a memfd mapping both processes share and the allocator of its slots,
  so tensors cross without passing through the socket (``_arena``).
- The message vocabulary both ends speak (``_messages``).
"""

from __future__ import annotations

from kserve_trio.serving.ipc._arena import ARENA_BYTES, Arena, Ring
from kserve_trio.serving.ipc._channel import Channel, ChannelClosed
from kserve_trio.serving.ipc._messages import (
    CANCEL,
    DONE,
    DRAIN,
    EDGE,
    FREE,
    HELLO,
    KIND_INFER,
    KIND_REST,
    KIND_STREAM,
    KIND_UNARY,
    LOG,
    PING,
    PONG,
    READY,
    REQUEST,
    Payload,
)

__all__ = [
    "ARENA_BYTES",
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
    "Arena",
    "Channel",
    "ChannelClosed",
    "Payload",
    "Ring",
]
