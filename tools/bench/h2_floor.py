"""The raw floor of a Python gRPC server: asyncio's Protocol and the h2 library, nothing else.

A ModelInfer answered by rewriting the request's top-level fields into a response (ServerReady and
ModelReady answer ready; model name, version and id kept, the input tensors' metadata kept as the outputs', ``raw_input_contents``
sent back as ``raw_output_contents``, requested outputs and parameters dropped), so a client
sees an identity model. No codec, no deadlines, no flow control beyond what fits the windows:
what any Python server built on h2 must at least spend per request. ``peers.py`` measures it in
the same run as our echo server and the worker.

Usage: python tools/bench/h2_floor.py --port P [--no-uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings

_CONFIG = h2.config.H2Configuration(client_side=False, header_encoding=None)
_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc+proto")]
_TRAILERS = [(b"grpc-status", b"0")]
_KEEP = {1: 1, 2: 2, 3: 3, 5: 5, 7: 6}  # request field -> response field


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def reply_of(request: bytes) -> bytes:
    """The identity response of a ModelInferRequest (module docstring)."""
    out = []
    pos = 0
    while pos < len(request):
        tag, pos = _varint(request, pos)
        field, wire = tag >> 3, tag & 7
        start = pos
        if wire == 2:
            length, pos = _varint(request, pos)
            pos += length
        elif wire == 0:
            _, pos = _varint(request, pos)
        else:
            raise ValueError("unexpected wire type")
        if field in _KEEP:
            out.append(_encode_varint(_KEEP[field] << 3 | wire) + request[start:pos])
    return b"".join(out)


class Floor(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.conn = h2.connection.H2Connection(_CONFIG)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64 << 20})
        self.conn.increment_flow_control_window((64 << 20) - 65535)
        self.bodies: dict[int, bytearray] = {}
        self.ready: dict[int, bool] = {}
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.bodies[event.stream_id] = bytearray()
                path = dict(event.headers).get(b":path", b"")
                self.ready[event.stream_id] = path.endswith(b"Ready")
            elif isinstance(event, h2.events.DataReceived):
                self.bodies[event.stream_id] += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                body = bytes(self.bodies.pop(event.stream_id))
                reply = b"\x08\x01" if self.ready.pop(event.stream_id) else reply_of(body[5:])
                sid = event.stream_id
                conn.send_headers(sid, _HEADERS)
                conn.send_data(sid, struct.pack(">BI", 0, len(reply)) + reply)
                conn.send_headers(sid, _TRAILERS, end_stream=True)
        out = conn.data_to_send()
        if out:
            self.transport.write(out)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Floor, "127.0.0.1", port)
    print(f"h2 floor listening on {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    if not args.no_uvloop:
        import uvloop

        uvloop.install()
    try:
        asyncio.run(main(args.port))
    except KeyboardInterrupt:
        pass
