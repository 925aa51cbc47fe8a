"""Python function calls and wall time per ModelInfer on the worker's in-process service path.

Serves the demo ``mlp`` with ``serve(..., blocking=False)``, builds one f32 [1,16] request,
parses it as the gRPC adapter does, and calls ``InferenceService.model_infer`` on the worker's
own event loop, sequentially, ``--requests`` times per round (no transport, no client). Reports:

- calls per request: cProfile over one round on the event-loop thread (the service, the
  inference core, the scheduler's dispatch loop and the codec; the device thread's own work is
  not in it). Deterministic, so it compares commits exactly;
- wall and event-loop-thread CPU microseconds per request of each of ``--rounds`` unprofiled
  rounds (wall is noisy on a shared VM; the loop thread's CPU time less so, as waiting for a
  core does not count; compare interleaved runs only).

Usage: ``python tools/bench/service_calls.py [--requests 3000] [--rounds 3] [--json]``. To
compare commits, run it from a ``git archive`` of each one, alternating.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time

import anyio.from_thread
import numpy as np

from kserve_trio.core.protocol import encode_infer_request
from kserve_trio.core.tensors import NamedTensor
from kserve_trio.export.demo import write_demo_repository
from kserve_trio.worker import service as service_mod
from kserve_trio.worker.server import serve, stop

try:
    from kserve_trio.core.protocol import parse_infer_request
except ImportError:  # a commit from before the one ModelInfer wire module
    from kserve_trio.core.protocol.wire import parse_infer_request


def _service(running):
    parts = getattr(running, "parts", None)
    if parts is not None:  # a tree with build_worker: the worker's own service
        return parts.service
    state = running.state
    try:
        from kserve_trio.worker.inference import InferenceCore
    except ImportError:  # a commit from before the inference core
        return service_mod.InferenceService(state)
    return service_mod.InferenceService(state, InferenceCore(state))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=3000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="unprofiled timing rounds")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)

    root = tempfile.mkdtemp()
    write_demo_repository(root, only=["mlp"])
    running = serve(
        None, blocking=False, model_dirs=[root], model_control_mode="static", endpoints={"port": 0}
    )
    svc = _service(running)
    x = np.ones((1, 16), np.float32)
    data = bytes(encode_infer_request("mlp", [NamedTensor.from_array("input_0", x)]))

    async def round_(n: int, profile: cProfile.Profile | None) -> tuple[float, float]:
        requests = [parse_infer_request(data) for _ in range(n)]
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        if profile is not None:
            profile.enable()
        for request in requests:
            await svc.model_infer(request, 0)
        if profile is not None:
            profile.disable()
        return (time.perf_counter_ns() - t0) / n / 1e3, (time.thread_time_ns() - c0) / n / 1e3

    try:
        anyio.from_thread.run(round_, 500, None, token=running._portal)  # warm-up
        prof = cProfile.Profile()
        anyio.from_thread.run(round_, args.requests, prof, token=running._portal)
        calls = pstats.Stats(prof).total_calls / args.requests
        timed = [
            anyio.from_thread.run(round_, args.requests, None, token=running._portal)
            for _ in range(args.rounds)
        ]
    finally:
        stop(running)
    walls, cpus = [w for w, _ in timed], [c for _, c in timed]
    result = {
        "calls_per_request": round(calls, 1),
        "wall_us_per_request": [round(w, 1) for w in walls],
        "wall_us_median": round(statistics.median(walls), 1) if walls else None,
        "loop_cpu_us_per_request": [round(c, 1) for c in cpus],
        "loop_cpu_us_median": round(statistics.median(cpus), 1) if cpus else None,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"calls per request: {result['calls_per_request']}")
        print(f"wall us per request: {result['wall_us_per_request']}")
        print(f"loop-thread CPU us per request: {result['loop_cpu_us_per_request']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
