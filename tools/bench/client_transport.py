"""The client transport on each event loop: the h2 transport on asyncio, uvloop and trio.

(Until the grpclib-based client transport was removed this compared the two; the figures that
decided it are in docs/benchmarks/history.md, "Trio transport".)

A worker serving the demo repository runs in its own process; each measurement is a fresh
client process running a closed loop of ``KServeModel.infer`` calls (``mlp``, one FP32 [1, 16]
input, inline) at a given concurrency on one event loop, with one transport. It reports
requests/s, p50 / p99 latency and the client process's CPU time (user + system, all threads)
per request over the measurement window. Configurations are interleaved round by round and the
medians of the rounds are printed as a Markdown table (and as JSON with ``--json``). Each point
applies the clean-run rule of tools/bench/noise.py (others' CPU and the load average over the
window, sampled at the client's ``WINDOW_START``/``WINDOW_END`` lines; a point where others used
over ``NOISY_CORES`` is measured again, and reported as noisy).

Usage:
    python tools/bench/client_transport.py [--repo DIR] [--rounds 3] [--duration 5]
        [--concurrency 1,16] [--server-cpu 0 --client-cpu 1] [--json out.json]
        [--configs h2/asyncio,h2/uvloop,h2/trio]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import Window, clean_point

CONFIGS = (
    ("h2", "asyncio"),
    ("h2", "uvloop"),
    ("h2", "trio"),
)


# --------------------------------------------------------------------------------------------
# The client process


def _child(args: argparse.Namespace) -> None:
    import anyio
    import numpy as np

    from kserve_trio.client import InferInput, KServeModel
    from kserve_trio.client.h2_transport import H2Transport as factory

    x = np.random.default_rng(0).standard_normal((1, 16), dtype=np.float32)
    inputs = [InferInput("input_0", x)]

    async def main() -> dict:
        latencies: list[float] = []
        counting = False
        stop_at = 0.0
        async with KServeModel(
            args.url, "mlp", shared_memory="off", transport_factory=factory
        ) as model:

            async def worker() -> None:
                while True:
                    t0 = time.perf_counter()
                    await model.infer(inputs)
                    t1 = time.perf_counter()
                    if t1 >= stop_at and counting:
                        return
                    if counting:
                        latencies.append(t1 - t0)

            await model.infer(inputs)  # connected
            stop_at = time.perf_counter() + args.warmup + args.duration + 3600
            async with anyio.create_task_group() as tg:
                for _ in range(args.concurrency):
                    tg.start_soon(worker)
                await anyio.sleep(args.warmup)
                counting = True
                print("WINDOW_START", flush=True)
                ru0 = resource.getrusage(resource.RUSAGE_SELF)
                t_start = time.perf_counter()
                stop_at = t_start + args.duration
                await anyio.sleep(args.duration)
                elapsed = time.perf_counter() - t_start
                ru1 = resource.getrusage(resource.RUSAGE_SELF)
                print("WINDOW_END", flush=True)
                n = len(latencies)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        latencies.sort()
        return {
            "transport": args.transport,
            "loop": args.backend,
            "concurrency": args.concurrency,
            "requests": n,
            "rps": n / elapsed,
            "p50_ms": 1e3 * latencies[n // 2] if n else float("nan"),
            "p99_ms": 1e3 * latencies[min(n - 1, int(n * 0.99))] if n else float("nan"),
            "cpu_us_per_req": 1e6 * cpu / n if n else float("nan"),
        }

    if args.backend == "trio":
        result = anyio.run(main, backend="trio")
    else:
        result = anyio.run(
            main, backend="asyncio", backend_options={"use_uvloop": args.backend == "uvloop"}
        )
    print(json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# The orchestrator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu)] if cpu is not None else []


def _wait_ready(url: str, timeout: float = 120.0) -> None:
    import anyio

    from kserve_trio.client import KServeModel

    async def ready() -> bool:
        try:
            async with KServeModel(url, "mlp", deadline=2.0) as m:
                return await m.model_ready()
        except Exception:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if anyio.run(ready):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the worker at {url} was not ready within {timeout:.0f}s")


def _point(cmd: list[str], worker_pid: int) -> dict:
    """One client process; the noise window is sampled at its WINDOW_START / WINDOW_END lines."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        window = Window([worker_pid, proc.pid])
        lines = []
        for line in proc.stdout:
            if line.startswith("WINDOW_START"):
                window.start()
            elif line.startswith("WINDOW_END"):
                window.stop()
            else:
                lines.append(line)
        out = "".join(lines)
        if proc.wait():
            err.seek(0)
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err.read())
    return window.record(json.loads(out.strip().splitlines()[-1]))


def _run(args: argparse.Namespace) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="client-transport-bench-")
    repo = pathlib.Path(args.repo) if args.repo else pathlib.Path(tmp) / "models"
    if not repo.exists():
        subprocess.run(
            [sys.executable, "-m", "kserve_trio", "bundle", "demo", str(repo)], check=True
        )
    port = _free_port()
    url = f"127.0.0.1:{port}"
    worker = subprocess.Popen(
        [
            *_pin(args.server_cpu),
            sys.executable,
            "-m",
            "kserve_trio",
            "worker",
            "--model-repo",
            str(repo),
            "--port",
            str(port),
            "--model-control-mode",
            "static",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    results: list[dict] = []
    try:
        _wait_ready(url)
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        configs = [tuple(c.split("/")) for c in args.configs.split(",")]
        for rnd in range(args.rounds):
            for c in concurrencies:
                for transport, backend in configs:
                    cmd = [
                        *_pin(args.client_cpu),
                        sys.executable,
                        __file__,
                        "--child",
                        "--url",
                        url,
                        "--transport",
                        transport,
                        "--backend",
                        backend,
                        "--concurrency",
                        str(c),
                        "--warmup",
                        str(args.warmup),
                        "--duration",
                        str(args.duration),
                    ]
                    row = clean_point(
                        lambda cmd=cmd: _point(cmd, worker.pid), f"{transport}/{backend} c={c}"
                    )
                    row["round"] = rnd
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        worker.terminate()
        worker.wait(30)
    return results


def summarize(results: list[dict]) -> list[dict]:
    """Medians over rounds, with the (min, max) range, per (concurrency, transport, loop)."""
    keys = sorted({(r["concurrency"], r["transport"], r["loop"]) for r in results})
    order = {cfg: i for i, cfg in enumerate(CONFIGS)}
    keys.sort(key=lambda k: (k[0], order.get((k[1], k[2]), 99)))
    rows = []
    for c, transport, loop in keys:
        runs = [
            r
            for r in results
            if (r["concurrency"], r["transport"], r["loop"]) == (c, transport, loop)
        ]
        row = {"concurrency": c, "transport": transport, "loop": loop, "rounds": len(runs)}
        for field in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req"):
            values = [r[field] for r in runs]
            row[field] = statistics.median(values)
            row[field + "_range"] = (min(values), max(values))
        row["others_cores"] = max(r["others_cores"] for r in runs)
        row["noisy"] = any(r.get("noisy") for r in runs)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| c | transport | loop | req/s | p50 (ms) | p99 (ms) | client CPU/req (µs) "
        "| others' cores (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["cpu_us_per_req_range"]
        rlo, rhi = r["rps_range"]
        lines.append(
            f"| {r['concurrency']} | {r['transport']} | {r['loop']} | "
            f"{r['rps']:.0f} [{rlo:.0f}-{rhi:.0f}] | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['cpu_us_per_req']:.0f} [{lo:.0f}-{hi:.0f}] | "
            f"{r['others_cores']:.3f}{' noisy' if r['noisy'] else ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url")
    p.add_argument("--transport", choices=("h2",))
    p.add_argument("--backend", choices=("asyncio", "uvloop", "trio"))
    p.add_argument("--repo", help="demo model repository (default: written to a temp dir)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--server-cpu", type=int)
    p.add_argument("--client-cpu", type=int)
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument(
        "--configs",
        default=",".join(f"{t}/{b}" for t, b in CONFIGS),
        help="transport/loop pairs to run (default: all five)",
    )
    args = p.parse_args()
    if args.child:
        args.concurrency = int(args.concurrency)
        _child(args)
        return
    results = _run(args)
    rows = summarize(results)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "summary": rows}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
