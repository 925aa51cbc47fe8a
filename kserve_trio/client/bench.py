"""``python -m kserve_trio bench``: a closed-loop or fixed-rate load generator for one model.

For each concurrency level it warms up, then measures for ``--duration`` seconds:

- closed loop (default): ``C`` tasks each send the next request as soon as the previous one
  returns;
- fixed rate (``--rate R``): requests are started on a schedule of ``R`` per second with at most
  ``C`` in flight; latency counts from the scheduled start, so a server that falls behind shows
  up in the tail instead of silently lowering the offered load (a start that finds ``C`` in
  flight is counted as ``late`` and sent when a task frees up).

Every request is one chunk of ``--batch`` items through the client's own path: ``infer_async``
over a staging-pool slot, inline (``--transport inline``) or through system shared memory both
ways (``--transport shm``). ``--client tritonclient`` sends the same load through
``tritonclient.grpc.aio`` instead (inline), for comparison.

The report: requests/s, items/s, latency p50/p90/p99/mean/max, errors by status, and the client
process's CPU time per request (user + system, all threads) over the window. A live progress
line goes to stderr; ``--json FILE`` writes the report; ``--plot FILE`` draws the latency
percentiles against concurrency to a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------------------
# Pure pieces: configuration, statistics, the report


@dataclass(frozen=True)
class BenchConfig:
    url: str
    model: str
    concurrency: tuple[int, ...] = (1, 8, 32)
    duration: float = 10.0
    warmup: float = 1.0
    rate: float | None = None
    transport: str = "inline"
    batch: int = 1
    deadline: float = 10.0
    client: str = "kserve_trio"
    progress: bool = True


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> ``(1, 8, 32)``; each level a positive integer."""
    try:
        levels = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected e.g. 1,8,32") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """Latency summary in milliseconds (linear-interpolation percentiles); zeros when empty."""
    if not samples_s:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}
    ms = np.asarray(samples_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "mean": round(float(ms.mean()), 3),
        "max": round(float(ms.max()), 3),
    }


@dataclass
class Window:
    """What one concurrency level measured."""

    concurrency: int
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    late: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def summary(self, batch: int) -> dict[str, Any]:
        ok = len(self.latencies)
        total = ok + sum(self.errors.values())
        secs = self.seconds or float("nan")
        return {
            "concurrency": self.concurrency,
            "seconds": round(self.seconds, 3),
            "requests": total,
            "ok": ok,
            "items": ok * batch,
            "requests_per_s": round(ok / secs, 2) if self.seconds else 0.0,
            "items_per_s": round(ok * batch / secs, 2) if self.seconds else 0.0,
            "latency_ms": percentiles(self.latencies),
            "errors": dict(sorted(self.errors.items())),
            "late": self.late,
            "cpu_seconds": round(self.cpu_seconds, 4),
            "cpu_per_request_us": round(self.cpu_seconds / total * 1e6, 1) if total else 0.0,
        }


def status_name(exc: BaseException) -> str:
    """The bucket an error is counted in: its gRPC status name when it has one."""
    status = getattr(exc, "status", None)
    if status is not None and not callable(status):
        return getattr(status, "name", str(status))
    if callable(status):  # tritonclient's InferenceServerException.status()
        text = str(status() or "")
        return text.rsplit(".", 1)[-1] or type(exc).__name__
    if type(exc).__name__ == "PoolAcquireTimeout":
        return "POOL_ACQUIRE_TIMEOUT"
    return type(exc).__name__


def progress_line(cfg: BenchConfig, w: Window, elapsed: float) -> str:
    lat = percentiles(w.latencies[-2000:])
    rps = len(w.latencies) / elapsed if elapsed > 0 else 0.0
    errs = sum(w.errors.values())
    return (
        f"[c={w.concurrency} {cfg.transport} {cfg.client}] {elapsed:5.1f}/{cfg.duration:g}s "
        f"{len(w.latencies):7d} ok {rps:8.1f} req/s  p50 {lat['p50']:.2f} ms  "
        f"p99 {lat['p99']:.2f} ms  errors {errs}"
    )


def report(cfg: BenchConfig, windows: list[Window]) -> dict[str, Any]:
    return {
        "url": cfg.url,
        "model": cfg.model,
        "client": cfg.client,
        "transport": cfg.transport,
        "batch": cfg.batch,
        "mode": f"fixed rate {cfg.rate:g}/s" if cfg.rate else "closed loop",
        "duration_s": cfg.duration,
        "warmup_s": cfg.warmup,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "levels": [w.summary(cfg.batch) for w in windows],
    }


def table(rep: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    head = (
        f"{rep['model']} via {rep['client']} ({rep['transport']}, batch {rep['batch']}, "
        f"{rep['mode']})"
    )
    lines = [
        head,
        f"{'conc':>5} {'req/s':>10} {'items/s':>10} {'p50 ms':>8} {'p90 ms':>8} "
        f"{'p99 ms':>8} {'cpu/req us':>10}  errors",
    ]
    for lv in rep["levels"]:
        lat = lv["latency_ms"]
        errs = ", ".join(f"{k}={v}" for k, v in lv["errors"].items()) or "-"
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests_per_s']:>10.1f} {lv['items_per_s']:>10.1f} "
            f"{lat['p50']:>8.2f} {lat['p90']:>8.2f} {lat['p99']:>8.2f} "
            f"{lv['cpu_per_request_us']:>10.1f}  {errs}"
        )
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: str) -> None:
    """Latency percentiles against concurrency, as a PNG."""
    from kserve_trio.client._plot import write_line_chart

    series = {
        name: [(lv["concurrency"], lv["latency_ms"][name]) for lv in rep["levels"]]
        for name in ("p50", "p90", "p99")
    }
    write_line_chart(
        path,
        series,
        title=f"{rep['model']} {rep['client']} {rep['transport']} batch {rep['batch']}",
        x_label="concurrency",
        y_label="latency ms",
    )


# --------------------------------------------------------------------------------------------
# Synthetic inputs


def synth_inputs(spec, batch: int) -> dict[str, np.ndarray]:
    """One request's inputs for ``spec``: the leading ``-1`` is ``batch``, other ``-1`` are 1;
    floating types are standard normal, others zero."""
    rng = np.random.default_rng(0)
    arrays = {}
    for meta in spec.inputs:
        shape = [(batch if axis == 0 else 1) if d == -1 else d for axis, d in enumerate(meta.shape)]
        dt = meta.dtype.numpy
        if np.issubdtype(dt, np.floating) or dt.kind == "V" or dt.name == "bfloat16":
            arrays[meta.name] = rng.standard_normal(shape).astype(dt)
        else:
            arrays[meta.name] = np.zeros(shape, dt)
    return arrays


class _OneChunkIO:
    """An IO of ``batch`` items sent as exactly one chunk: staged by copy into the slot."""

    def __init__(self, arrays: dict[str, np.ndarray], outputs, batch: int) -> None:
        self.arrays = arrays
        self.outputs = outputs
        self.batch = batch
        self.per_item = sum(a.nbytes for a in arrays.values()) // batch

    def __len__(self) -> int:
        return self.batch

    def item_input_bytes(self) -> int:
        return self.per_item

    def encode_chunk(self, items, slot):
        from kserve_trio.client import pool_view, scratch

        descs = scratch(slot, [(n, a.shape, a.dtype) for n, a in self.arrays.items()])
        for d, a in zip(descs, self.arrays.values(), strict=True):
            np.copyto(pool_view(d), a)
        return descs

    def decode_chunk(self, items, response) -> None:
        if len(response.outputs) == 0:
            raise RuntimeError("response without outputs")

    def output_specs(self):
        return self.outputs


# --------------------------------------------------------------------------------------------
# The load loops


async def _drive_level(
    cfg: BenchConfig, concurrency: int, call: Callable[[], Awaitable[None]], out=sys.stderr
) -> Window:
    import anyio

    async def measure(window: Window, seconds: float, show: bool) -> None:
        end = time.perf_counter() + seconds
        started = time.perf_counter()

        async def once(t0: float) -> None:
            try:
                await call()
            except Exception as exc:
                window.errors[status_name(exc)] += 1
            else:
                window.latencies.append(time.perf_counter() - t0)

        async def closed_worker() -> None:
            while time.perf_counter() < end:
                await once(time.perf_counter())

        async def ticker() -> None:
            while True:
                await anyio.sleep(0.25)
                if show:
                    out.write("\r" + progress_line(cfg, window, time.perf_counter() - started))
                    out.flush()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            if cfg.rate:
                gate = anyio.Semaphore(concurrency)
                period = 1.0 / cfg.rate
                async with anyio.create_task_group() as sends:
                    i = 0
                    while True:
                        due = started + i * period
                        if due >= end:
                            break
                        delay = due - time.perf_counter()
                        if delay > 0:
                            await anyio.sleep(delay)
                        if gate.value == 0:
                            window.late += 1
                        await gate.acquire()

                        async def send(t0: float = due) -> None:
                            try:
                                await once(t0)
                            finally:
                                gate.release()

                        sends.start_soon(send)
                        i += 1
            else:
                async with anyio.create_task_group() as workers:
                    for _ in range(concurrency):
                        workers.start_soon(closed_worker)
            tg.cancel_scope.cancel()

    if cfg.warmup > 0:
        await measure(Window(concurrency), cfg.warmup, False)
    window = Window(concurrency)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await measure(window, cfg.duration, cfg.progress)
    window.seconds = time.perf_counter() - t0
    window.cpu_seconds = time.process_time() - cpu0
    if cfg.progress:
        out.write("\r" + progress_line(cfg, window, window.seconds) + "\n")
        out.flush()
    return window


async def _kserve_trio_levels(cfg: BenchConfig) -> list[Window]:
    from kserve_trio.client import KServeModel, OutputSpec, infer_async

    mode = "on" if cfg.transport == "shm" else "off"
    model = KServeModel(
        cfg.url, cfg.model, max_batch_size=cfg.batch, deadline=cfg.deadline, shared_memory=mode
    )
    async with model:
        spec = await model.io_spec()
        arrays = synth_inputs(spec, cfg.batch)
        outputs = []
        if cfg.transport == "shm":
            for meta in spec.outputs:
                if meta.shape and meta.shape[0] == -1 and all(d >= 0 for d in meta.shape[1:]):
                    outputs.append(OutputSpec(meta.name, meta.dtype, meta.shape[1:]))
        io = _OneChunkIO(arrays, outputs, cfg.batch)

        async def call() -> None:
            await infer_async(model, io)

        return [await _drive_level(cfg, c, call) for c in cfg.concurrency]


async def _tritonclient_levels(cfg: BenchConfig) -> list[Window]:
    import tritonclient.grpc.aio as aioclient

    from kserve_trio.client.transport import parse_url

    host, port, _secure = parse_url(cfg.url)
    client = aioclient.InferenceServerClient(f"{host}:{port}")
    try:
        meta = await client.get_model_metadata(cfg.model, as_json=True)
        from kserve_trio.client.spec import ModelIOSpec, TensorMeta

        spec = ModelIOSpec(
            [
                TensorMeta(t["name"], t["datatype"], tuple(int(d) for d in t["shape"]))
                for t in meta["inputs"]
            ],
            [
                TensorMeta(t["name"], t["datatype"], tuple(int(d) for d in t["shape"]))
                for t in meta["outputs"]
            ],
            cfg.model,
        )
        arrays = synth_inputs(spec, cfg.batch)
        names = [t.name for t in spec.outputs]

        async def call() -> None:
            inputs = []
            for name, arr in arrays.items():
                inp = aioclient.InferInput(name, list(arr.shape), spec.input(name).datatype)
                inp.set_data_from_numpy(arr)
                inputs.append(inp)
            result = await client.infer(cfg.model, inputs, client_timeout=cfg.deadline)
            for name in names:
                result.as_numpy(name)

        return [await _drive_level(cfg, c, call) for c in cfg.concurrency]
    finally:
        await client.close()


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every level and return the report (the event loop is asyncio, uvloop if present)."""
    import anyio

    from kserve_trio.client.runtime import _has_uvloop

    if cfg.client == "tritonclient" and cfg.transport != "inline":
        raise ValueError("--client tritonclient supports --transport inline only")
    levels = _tritonclient_levels if cfg.client == "tritonclient" else _kserve_trio_levels
    windows = anyio.run(
        levels, cfg, backend="asyncio", backend_options={"use_uvloop": _has_uvloop()}
    )
    return report(cfg, windows)


# --------------------------------------------------------------------------------------------
# Command line


def configure_parser(parser: argparse.ArgumentParser):
    """Add the bench flags to ``parser``; returns the runner."""
    parser.add_argument(
        "--url", required=True, help="server address, host:port or grpc://host:port"
    )
    parser.add_argument("--model", required=True, help="model name")
    parser.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default=(1, 8, 32),
        help="comma-separated in-flight levels (default 1,8,32)",
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds per level (default 10)"
    )
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="warm-up seconds per level (default 1)"
    )
    parser.add_argument(
        "--rate", type=float, help="fixed rate in requests/s (default: closed loop)"
    )
    parser.add_argument(
        "--transport",
        choices=["inline", "shm"],
        default="inline",
        help="request path (default inline)",
    )
    parser.add_argument("--batch", type=int, default=1, help="items per request (default 1)")
    parser.add_argument("--deadline", type=float, default=10.0, help="per-request deadline in s")
    parser.add_argument(
        "--client",
        choices=["kserve_trio", "tritonclient"],
        default="kserve_trio",
        help="client library generating the load (default kserve_trio)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the JSON report here")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of latency vs concurrency")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    parser.add_argument("--log-level", default="warning", help="client log level (default warning)")
    return run


def run(args: argparse.Namespace) -> int:
    from kserve_trio.core.logging import configure_logging

    configure_logging("auto", args.log_level)
    if args.batch < 1:
        print("error: --batch must be >= 1", file=sys.stderr)
        return 2
    if args.duration <= 0 or (args.rate is not None and args.rate <= 0):
        print("error: --duration and --rate must be > 0", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        url=args.url,
        model=args.model,
        concurrency=tuple(args.concurrency),
        duration=args.duration,
        warmup=max(0.0, args.warmup),
        rate=args.rate,
        transport=args.transport,
        batch=args.batch,
        deadline=args.deadline,
        client=args.client,
        progress=not args.no_progress,
    )
    try:
        rep = run_bench(cfg)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(table(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
    if args.plot:
        plot(rep, args.plot)
    failed = sum(sum(lv["errors"].values()) for lv in rep["levels"])
    return 1 if failed else 0


__all__ = [
    "BenchConfig",
    "configure_parser",
    "parse_concurrency",
    "percentiles",
    "plot",
    "report",
    "run",
    "run_bench",
    "status_name",
    "synth_inputs",
    "table",
]
