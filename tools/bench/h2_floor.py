"""The raw floor of a Python gRPC server on h2: asyncio's Protocol (uvloop when installed) and
the h2 library, nothing else.

ModelInfer is answered with ``floor_wire.reply_of`` (an identity: the output ``INPUT0`` is the
input ``INPUT0``; ServerReady and ModelReady answer ready), inline in ``data_received``. No
codec, no deadlines, no flow control beyond what fits the windows: what any Python server built
on h2 must at least spend per request. ``--lean`` turns h2's header validation and
normalization off (inbound and outbound), as the outside measurement of issue 38 ran it; by
default h2 validates, as an engine must. ``engines.py`` and ``peers.py`` measure it beside
``ngh2_floor.py``, ``grpcio_floor.py`` and our echo server.

Usage: python tools/bench/h2_floor.py --port P [--lean] [--no-uvloop]
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events
import h2.settings
from floor_wire import RESPONSE_HEADERS, TRAILERS, answer, parse_args

_WINDOW = 64 << 20


def make_floor(lean: bool) -> type[asyncio.Protocol]:
    checks = not lean
    config = h2.config.H2Configuration(
        client_side=False,
        header_encoding=None,
        validate_inbound_headers=checks,
        validate_outbound_headers=checks,
        normalize_inbound_headers=checks,
        normalize_outbound_headers=checks,
    )

    class Floor(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            self.conn = h2.connection.H2Connection(config)
            self.conn.initiate_connection()
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW})
            self.conn.increment_flow_control_window(_WINDOW - 65535)
            self.streams: dict[int, tuple[bytes, bytearray]] = {}
            transport.write(self.conn.data_to_send())

        def data_received(self, data: bytes) -> None:
            conn = self.conn
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    path = dict(event.headers).get(b":path", b"")
                    self.streams[event.stream_id] = (path, bytearray())
                elif isinstance(event, h2.events.DataReceived):
                    self.streams[event.stream_id][1].extend(event.data)
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    sid = event.stream_id
                    path, body = self.streams.pop(sid)
                    conn.send_headers(sid, RESPONSE_HEADERS)
                    conn.send_data(sid, answer(path, bytes(body)))
                    conn.send_headers(sid, TRAILERS, end_stream=True)
            out = conn.data_to_send()
            if out:
                self.transport.write(out)

    return Floor


async def main(port: int, lean: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(make_floor(lean), "127.0.0.1", port)
    print(f"h2 floor{' (lean)' if lean else ''} listening on {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    try:
        asyncio.run(main(args.port, args.lean))
    except KeyboardInterrupt:
        pass
