"""The floor of our stack: a KServe V2 ModelInfer that echoes its inputs, on the same codec and
gRPC layer as the worker (``serving.grpc`` + ``core.codec``), with no scheduler and no device.
Whatever the worker costs above this is the worker's own.

Usage: python tools/bench/echo_server.py --port P [--event-loop uvloop|asyncio|trio]

``ECHO_UNPATCHED_FRAME_REPR=1`` serves with hyperframe's own (O(payload)) DATA-frame repr, to
measure what ``serving.grpc``'s fix of it saves.
"""

from __future__ import annotations

import argparse
import signal

import anyio

from kserve_trio.serving.background import EVENT_LOOPS, run_loop


async def main(port: int) -> None:
    import os

    if os.environ.get("ECHO_UNPATCHED_FRAME_REPR") == "1":
        # For the A/B of serving.grpc's frame-repr fix: hyperframe's own DATA repr again.
        import hyperframe.frame

        import kserve_trio.serving.grpc  # noqa: F401  (applies the fix, which this undoes)

        del hyperframe.frame.DataFrame._body_repr
    from kserve_trio.core import codec
    from kserve_trio.proto import inference as pb
    from kserve_trio.serving.grpc import GrpcServer, Limits, unary

    limits = Limits(512 << 20, 512 << 20)

    async def model_infer(request):
        decoded = codec.decode_infer_request(request)
        try:
            return codec.encode_infer_response(
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
        }
    )
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve, "127.0.0.1", port)
        print(f"echo listening on {port}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        await server.shutdown(1.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default=None)
    parser.add_argument("--no-uvloop", action="store_true", help="same as --event-loop asyncio")
    args = parser.parse_args()
    run_loop(main, args.port, event_loop="asyncio" if args.no_uvloop else args.event_loop)
