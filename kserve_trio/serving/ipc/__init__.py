"""The node-local channel between a worker's device process and its front-end processes.

- The messages both ends speak: frozen dataclasses matched by class (``_messages``).
- ``Channel``: batches of messages over one Unix stream socket, a frame per batch
  (``_channel``).
- ``Arena`` and ``Ring``: a memfd mapping both processes share and the allocator of its slots,
  so tensors cross without passing through the socket (``_arena``).
- ``FrontendLink``: the device process's end, serving each request through an ``RpcServer``
  (``_frontend_link``); ``DeviceLink``: a front end's end, ``request`` in, ``Answer`` out
  (``_device_link``).
"""

from __future__ import annotations

from kserve_trio.serving.ipc._arena import ARENA_BYTES, Arena, Ring
from kserve_trio.serving.ipc._channel import Channel, ChannelClosed, first_batch
from kserve_trio.serving.ipc._device_link import DEVICE_GONE_TEXT, Answer, DeviceLink, read_hello
from kserve_trio.serving.ipc._frontend_link import CANCELLED_TEXT, FrontendLink, Reply, RpcServer
from kserve_trio.serving.ipc._messages import (
    Call,
    Cancel,
    Detail,
    Done,
    Drain,
    Edge,
    ForwardedRpc,
    Free,
    Hello,
    InferCall,
    Log,
    Message,
    Payload,
    Ping,
    Pong,
    Ready,
    Request,
    RestCall,
    RestHead,
    RpcShape,
    Slot,
    StreamCall,
    StreamOrigin,
    ToDevice,
    ToFrontend,
    UnaryCall,
)

__all__ = [
    "ARENA_BYTES",
    "CANCELLED_TEXT",
    "DEVICE_GONE_TEXT",
    "Answer",
    "Arena",
    "Call",
    "Cancel",
    "Channel",
    "ChannelClosed",
    "Detail",
    "DeviceLink",
    "Done",
    "Drain",
    "Edge",
    "ForwardedRpc",
    "Free",
    "FrontendLink",
    "Hello",
    "InferCall",
    "Log",
    "Message",
    "Payload",
    "Ping",
    "Pong",
    "Ready",
    "Reply",
    "Request",
    "RestCall",
    "RestHead",
    "Ring",
    "RpcServer",
    "RpcShape",
    "Slot",
    "StreamCall",
    "StreamOrigin",
    "ToDevice",
    "ToFrontend",
    "UnaryCall",
    "first_batch",
    "read_hello",
]
