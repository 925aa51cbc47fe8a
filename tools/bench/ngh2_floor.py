"""The raw floor of a Python gRPC server on ngh2: asyncio's Protocol (uvloop when installed)
and libnghttp2 through the ngh2 binding (sans-IO: bytes in, events out, bytes to send), nothing
else.

The same server as ``h2_floor.py`` with the engine swapped: ModelInfer answered with
``floor_wire.reply_of`` (an identity: output ``INPUT0`` = input ``INPUT0``; ServerReady and
ModelReady answer ready) inline in ``data_received``, the same 64 MiB windows, received DATA
acknowledged by the library (``auto_window_update``). What any Python server built on
libnghttp2 must at least spend per request; ``engines.py`` measures it beside the other floors.

Usage: python tools/bench/ngh2_floor.py --port P [--no-uvloop]
"""

from __future__ import annotations

import asyncio

import ngh2
from floor_wire import RESPONSE_HEADERS, TRAILERS, answer, parse_args

_CONFIG = ngh2.Configuration()
_WINDOW = 64 << 20


class Floor(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.conn = ngh2.Connection(ngh2.Role.SERVER, _CONFIG)
        self.conn.initiate_connection({ngh2.Setting.INITIAL_WINDOW_SIZE: _WINDOW})
        self.conn.set_local_window_size(_WINDOW)
        self.streams: dict[int, tuple[bytes, bytearray]] = {}
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        try:
            conn.receive_data(data)
            events = conn.events()
        except ngh2.NGH2Error:
            self.transport.close()
            return
        for event in events:
            kind = type(event)
            if kind is ngh2.RequestReceived:
                path = dict(event.headers).get(b":path", b"")
                self.streams[event.stream_id] = (path, bytearray())
                if event.end_stream:
                    self.reply(event.stream_id)
            elif kind is ngh2.DataReceived:
                self.streams[event.stream_id][1].extend(event.data)
                if event.end_stream:
                    self.reply(event.stream_id)
            elif kind is ngh2.TrailersReceived:
                self.reply(event.stream_id)
        out = conn.data_to_send()
        if out:
            self.transport.write(out)

    def reply(self, sid: int) -> None:
        path, body = self.streams.pop(sid)
        self.conn.send_response(sid, RESPONSE_HEADERS)
        self.conn.send_data(sid, answer(path, bytes(body)))
        self.conn.send_trailers(sid, TRAILERS)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Floor, "127.0.0.1", port)
    print(f"ngh2 floor listening on {port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0])
    try:
        asyncio.run(main(args.port))
    except KeyboardInterrupt:
        pass
