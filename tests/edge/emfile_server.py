"""A server process whose accept loops run out of descriptors: ``serve_app`` and a
``GrpcServer`` with no connection cap, under an open-file limit a few dozen descriptors above
what the process holds once started, so a flood of idle connections reaches EMFILE.

``python -m tests.edge.emfile_server LOOP HEADROOM`` (LOOP: asyncio, uvloop or trio) prints one JSON line
(``{"http": port, "grpc": port, "limit": n}``) once both listen; ``GET /stats`` answers the
refused-connection counts as JSON. It runs until killed.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import anyio

from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc import GrpcServer, ServerSettings
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app

NO_CAP = 0


async def main(headroom: int) -> None:
    stats = EdgeStats()
    limits = EdgeLimits(max_connections=NO_CAP)

    async def app(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, json.dumps(dict(stats.refused_connections)).encode())

    grpc = GrpcServer({}, ServerSettings(limits=limits), stats, connection_cap=NO_CAP)
    async with anyio.create_task_group() as tg:
        http_port = await tg.start(
            lambda task_status: serve_app(
                "127.0.0.1",
                0,
                app,
                max_body_bytes=1 << 16,
                limits=limits,
                stats=stats,
                connection_cap=NO_CAP,
                task_status=task_status,
            )
        )
        grpc_port = await tg.start(grpc.serve, "127.0.0.1", 0)
        limit = len(os.listdir("/proc/self/fd")) + headroom
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        print(json.dumps({"http": http_port, "grpc": grpc_port, "limit": limit}), flush=True)


if __name__ == "__main__":
    loop = sys.argv[1]
    options = {"use_uvloop": loop == "uvloop"} if loop != "trio" else {}
    backend = "trio" if loop == "trio" else "asyncio"
    anyio.run(main, int(sys.argv[2]), backend=backend, backend_options=options)
