"""The floor of our stack: a KServe V2 ModelInfer that echoes its inputs, on the same codec and
transport as the worker (grpclib + the worker's grpc adapter + core.codec), with no scheduler and
no device. Whatever the worker costs above this is the worker's own.

Usage: python tools/bench/echo_server.py --port P [--no-uvloop]
"""

from __future__ import annotations

import argparse
import signal

import anyio


async def main(port: int) -> None:
    from kserve_trio.core import codec
    from kserve_trio.proto import inference as pb
    from kserve_trio.serving import h2_settings
    from kserve_trio.serving.grpc_adapter import Limits, unary
    from kserve_trio.serving.grpc_server import GrpcServer

    limits = Limits(512 << 20, 512 << 20)

    async def model_infer(request, ctx):
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

    async def ready(request, ctx):
        return pb.ServerReadyResponse(ready=True)

    async def model_ready(request, ctx):
        return pb.ModelReadyResponse(ready=True)

    class Echo:
        def __mapping__(self):
            prefix = "/inference.GRPCInferenceService/"
            return {
                prefix + "ModelInfer": unary(
                    model_infer, pb.ModelInferRequest, limits, "ModelInfer", fast=True
                ),
                prefix + "ServerReady": unary(ready, pb.ServerReadyRequest, limits, "ServerReady"),
                prefix + "ModelReady": unary(
                    model_ready, pb.ModelReadyRequest, limits, "ModelReady"
                ),
            }

    server = GrpcServer([Echo()], config=h2_settings.server_config())
    await server.start("127.0.0.1", port)
    print(f"echo listening on {port}", flush=True)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            break
    server.close()
    await server.wait_closed()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-uvloop", action="store_true")
    args = parser.parse_args()
    anyio.run(
        main, args.port, backend="asyncio", backend_options={"use_uvloop": not args.no_uvloop}
    )
