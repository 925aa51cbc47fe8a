"""The floor of our stack: a KServe V2 ModelInfer that echoes its inputs, on the same codec and
gRPC layer as the worker (``serving.grpc`` + ``core.protocol.codec``), with no scheduler and no device.
Whatever the worker costs above this is the worker's own.

Model name: any (the benchmarks use ``echo``); each output is the input of the same name
(``INPUT0`` -> ``INPUT0``), as the floors (``floor_wire.py``) answer. ``--http2-engine`` picks
the HTTP/2 engine under the server (``ServerSettings.http2_engine``; default the project's,
ngh2), as the worker's flag of that name does.

Usage: python tools/bench/echo_server.py --port P [--http2-engine ngh2|h2]
           [--event-loop uvloop|asyncio|trio]
"""

from __future__ import annotations

import argparse
import signal

import anyio

from kserve_trio.http2 import DEFAULT_ENGINE, ENGINES
from kserve_trio.serving.background import EVENT_LOOPS, run_loop


async def main(port: int, engine: str) -> None:
    from kserve_trio.core.protocol import decode_infer_request, encode_infer_response
    from kserve_trio.proto import inference as pb
    from kserve_trio.serving.grpc import GrpcServer, Limits, ServerSettings, unary

    limits = Limits(512 << 20, 512 << 20)

    async def model_infer(request):
        decoded = decode_infer_request(request)
        try:
            return encode_infer_response(
                request.model_name,
                decoded.id,
                decoded.inputs,
                decoded.requested_outputs,
                zero_copy=True,
            )
        finally:
            decoded.release()

    async def ready(request):
        return pb.ServerReadyResponse(ready=True)

    async def model_ready(request):
        return pb.ModelReadyResponse(ready=True)

    prefix = "/inference.GRPCInferenceService/"
    server = GrpcServer(
        {
            prefix + "ModelInfer": unary(model_infer, pb.ModelInferRequest, limits, "ModelInfer"),
            prefix + "ServerReady": unary(ready, pb.ServerReadyRequest, limits, "ServerReady"),
            prefix + "ModelReady": unary(model_ready, pb.ModelReadyRequest, limits, "ModelReady"),
        },
        ServerSettings(http2_engine=engine),
    )
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, "127.0.0.1", port)
        print(f"echo listening on {port} ({engine})", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        await server.shutdown(1.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http2-engine", choices=ENGINES, default=DEFAULT_ENGINE)
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default=None)
    parser.add_argument("--no-uvloop", action="store_true", help="same as --event-loop asyncio")
    args = parser.parse_args()
    run_loop(
        main,
        args.port,
        args.http2_engine,
        event_loop="asyncio" if args.no_uvloop else args.event_loop,
    )
