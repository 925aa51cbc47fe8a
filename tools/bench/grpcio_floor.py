"""The floor of a Python gRPC server on grpcio's C core: a ``grpc.aio`` server with one generic
handler, nothing else.

The same echo as ``h2_floor.py`` and ``ngh2_floor.py`` (``floor_wire.reply_of``: an identity,
output ``INPUT0`` = input ``INPUT0``; ServerReady and ModelReady answer ready), on bytes: no
protobuf classes, no interceptors. grpc.aio runs on asyncio's own loop (its completion queue is
polled by grpc's threads; uvloop is not supported by grpc.aio), so ``--no-uvloop`` is implied.
What KServe's Python server (a ``grpc.aio`` server) must at least spend per request;
``engines.py`` measures it beside the other floors.

Usage: python tools/bench/grpcio_floor.py --port P
"""

from __future__ import annotations

import asyncio
import sys

import grpc
from floor_wire import READY_REPLY, reply_of


async def model_infer(request: bytes, context) -> bytes:
    return reply_of(request)


async def ready(request: bytes, context) -> bytes:
    return READY_REPLY


async def main(port: int) -> None:
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    )
    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),
            "ServerReady": grpc.unary_unary_rpc_method_handler(ready),
            "ModelReady": grpc.unary_unary_rpc_method_handler(ready),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"grpcio floor listening on {port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        asyncio.run(main(args.port))
    except KeyboardInterrupt:
        sys.exit(0)
