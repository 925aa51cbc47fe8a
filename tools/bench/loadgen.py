"""Closed-loop KServe V2 load generator (tritonclient's aio client), run in its own process.

Prints one JSON line: requests, errors, seconds, rps, p50/p99 latency (ms). With ``--shm`` every
task stages its input once in its own pre-touched system shared-memory region, registered once,
and asks for the output into another pre-touched region; requests then carry only references.
A line ``WINDOW_START`` on stdout marks the end of the warm-up (the caller samples the server's
CPU time there and at the end).

Usage: python tools/bench/loadgen.py --url H:P --model M --input NAME --output NAME \
           --shape 1,16 --concurrency 8 --duration 5 [--warmup 1] [--shm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

import numpy as np


def _percentile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def run(args) -> dict:
    import tritonclient.grpc.aio as aioclient
    import tritonclient.utils.shared_memory as shm

    shape = [int(d) for d in args.shape.split(",")]
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    out_shape = [int(d) for d in (args.output_shape or args.shape).split(",")]
    out_bytes = int(np.prod(out_shape)) * 4
    client = aioclient.InferenceServerClient(args.url)
    regions = []
    latencies: list[float] = []
    errors: dict[str, int] = {}
    measuring = False
    stop_at = 0.0

    def make_request(i: int):
        inp = aioclient.InferInput(args.input, shape, "FP32")
        out = aioclient.InferRequestedOutput(args.output)
        if not args.shm:
            inp.set_data_from_numpy(x)
            return [inp], [out]
        tag = f"{os.getpid()}_{i}_{uuid.uuid4().hex[:6]}"
        hin = shm.create_shared_memory_region(f"bin_{tag}", f"/bin_{tag}", x.nbytes)
        hout = shm.create_shared_memory_region(f"bout_{tag}", f"/bout_{tag}", out_bytes)
        shm.set_shared_memory_region(hin, [x])  # staged once, pre-touched
        shm.set_shared_memory_region(hout, [np.zeros(out_shape, np.float32)])  # pre-touched
        regions.append((hin, f"bin_{tag}", f"/bin_{tag}", x.nbytes))
        regions.append((hout, f"bout_{tag}", f"/bout_{tag}", out_bytes))
        inp.set_shared_memory(f"bin_{tag}", x.nbytes)
        out.set_shared_memory(f"bout_{tag}", out_bytes)
        return [inp], [out]

    requests = [make_request(i) for i in range(args.concurrency)]
    for _, name, key, size in regions:
        await client.register_system_shared_memory(name, key, size)

    async def worker(i: int) -> None:
        inputs, outputs = requests[i]
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                r = await client.infer(args.model, inputs, outputs=outputs)
                if not args.shm:
                    r.as_numpy(args.output)
                ok = True
            except Exception as exc:  # recorded by status
                status = getattr(exc, "status", None)
                key = status() if callable(status) else type(exc).__name__
                errors[str(key)] = errors.get(str(key), 0) + 1
                ok = False
            if measuring and ok:
                latencies.append(time.perf_counter() - t0)

    try:
        stop_at = time.perf_counter() + args.warmup + args.duration
        tasks = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        measuring = True
        print("WINDOW_START", flush=True)
        t_start = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t_start
    finally:
        for h, name, _, _ in regions:
            try:
                await client.unregister_system_shared_memory(name)
            except Exception:
                pass
            shm.destroy_shared_memory_region(h)
        await client.close()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "seconds": round(elapsed, 3),
        "rps": round(n / elapsed, 1) if elapsed else 0.0,
        "p50_ms": round(_percentile(latencies, 0.5) * 1e3, 3),
        "p99_ms": round(_percentile(latencies, 0.99) * 1e3, 3),
        "payload_bytes": int(x.nbytes),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--input", default="input_0")
    p.add_argument("--output", default="output")
    p.add_argument("--shape", required=True)
    p.add_argument("--output-shape", default=None)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--shm", action="store_true")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    return 0 if result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
