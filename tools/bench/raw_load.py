"""Closed-loop ModelInfer load from the cheapest Python client there is, in its own process.

A ``grpc.aio`` channel and a generic unary call to ``/inference.GRPCInferenceService/ModelInfer``
carrying one request serialized once up front (the tensor in ``raw_input_contents``); replies
are not decoded during the load. So the client takes as little of a 2-core machine as it can,
and the same bytes go to every server compared. Before the load one reply is decoded and
checked (``--expect identity``: the output equals the input, shape included; ``sum``: it is
FP32 and equals numpy's ``x.sum(axis=-1, keepdims=True)`` in shape and, to float32 rounding,
in value; ``none``: it has an output), so a server that answers wrongly fails the run instead
of looking fast.

Prints ``WINDOW_START`` when the measured window opens and ``WINDOW_END`` when it closes (the
caller samples the server's CPU time there), then one JSON line: requests, errors by status,
seconds, rps, p50/p99 ms.

Usage: python tools/bench/raw_load.py --url H:P --model M --input INPUT0 --output OUTPUT0 \
           --shape 1,16 --concurrency 8 --duration 4 [--warmup 1] [--expect identity|sum|none]
           [--ca CA.pem]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def percentile(samples: list[float], q: float) -> float:
    """The q-quantile of ``samples`` (nearest rank), 0 for none."""
    if not samples:
        return 0.0
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def build_request(model: str, name: str, x: np.ndarray) -> bytes:
    """One ModelInferRequest, serialized, with ``x`` as raw contents."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    # Asks for the output as raw bytes: KServe's server otherwise answers gRPC in typed
    # contents (kserve_trio always answers raw).
    req.parameters["binary_data_output"].bool_param = True
    t = req.inputs.add()
    t.name = name
    t.datatype = "FP32"
    t.shape.extend(x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x).tobytes())
    return req.SerializeToString()


def check_reply(data: bytes, output: str, x: np.ndarray, expect: str) -> None:
    """Raise when the reply is not what ``expect`` asks for."""
    from tritonclient.grpc import service_pb2 as pb

    resp = pb.ModelInferResponse.FromString(data)
    names = [o.name for o in resp.outputs]
    if output not in names:
        raise SystemExit(f"reply has no output {output!r} (outputs: {names})")
    i = names.index(output)
    if len(resp.raw_output_contents) <= i:
        raise SystemExit(f"output {output!r} is not in raw_output_contents")
    if expect == "none":
        return
    if resp.outputs[i].datatype != "FP32":
        raise SystemExit(f"{expect} reply is {resp.outputs[i].datatype}, not FP32")
    shape = list(resp.outputs[i].shape)
    raw = resp.raw_output_contents[i]
    if len(raw) != 4 * int(np.prod(shape)):
        raise SystemExit(f"{expect} reply holds {len(raw)} bytes for shape {shape}")
    got = np.frombuffer(raw, np.float32).reshape(shape)
    if expect == "identity":
        if got.shape != x.shape or not np.array_equal(got, x):
            raise SystemExit(f"identity reply differs from the input (shape {got.shape})")
    elif expect == "sum":
        want = x.sum(axis=-1, keepdims=True)
        # The server may add in another order than numpy's pairwise sum: float32 rounding only.
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-4):
            err = np.abs(got - want).max() if got.shape == want.shape else None
            raise SystemExit(f"sum reply differs from numpy (shape {got.shape}, max error {err})")
    else:
        raise SystemExit(f"unknown expectation {expect!r}")


async def run(args: argparse.Namespace) -> dict:
    import grpc

    shape = [int(d) for d in args.shape.split(",")]
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    request = build_request(args.model, args.input, x)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    if args.ca:
        with open(args.ca, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        channel = grpc.aio.secure_channel(args.url, credentials, options=options)
    else:
        channel = grpc.aio.insecure_channel(args.url, options=options)
    call = channel.unary_unary(METHOD)  # bytes in, bytes out
    check_reply(await call(request, timeout=60), args.output, x, args.expect)
    latencies: list[float] = []
    errors: dict[str, int] = {}
    measuring = False
    stop_at = time.perf_counter() + args.warmup + args.duration

    async def worker() -> None:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                await call(request, timeout=args.timeout)
            except grpc.aio.AioRpcError as exc:
                key = exc.code().name
                errors[key] = errors.get(key, 0) + 1
                if sum(errors.values()) > 1000:
                    return
                continue
            if measuring:
                latencies.append(time.perf_counter() - t0)

    try:
        tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        measuring = True
        print("WINDOW_START", flush=True)
        t_start = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t_start
        print("WINDOW_END", flush=True)
    finally:
        await channel.close()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "seconds": round(elapsed, 3),
        "rps": round(n / elapsed, 1) if elapsed else 0.0,
        "p50_ms": round(percentile(latencies, 0.5) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1e3, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--input", default="INPUT0")
    p.add_argument("--output", default="OUTPUT0")
    p.add_argument("--shape", required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--expect", choices=("identity", "sum", "none"), default="identity")
    p.add_argument("--ca", default="", help="TLS: the CA bundle (PEM) the server chains to")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    return 0 if result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
