"""The load loops: synthetic inputs, one concurrency level's closed or fixed-rate loop, and the
two load sources (our client's ``infer_async``, or ``tritonclient.grpc.aio`` for comparison).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

from kserve_trio.bench._report import BenchConfig, Window, progress_line, report, status_name
from kserve_trio.client import (
    InferInput,
    KServeModel,
    OutputSpec,
    PoolSlot,
    ScratchBuffer,
    infer_async,
    pool_view,
    scratch,
)
from kserve_trio.client.spec import ModelIOSpec, TensorMeta
from kserve_trio.client.transport import parse_url
from kserve_trio.core.process import uvloop_available
from kserve_trio.core.protocol import InferResponseMessage

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

    def __init__(
        self, arrays: dict[str, np.ndarray], outputs: list[OutputSpec], batch: int
    ) -> None:
        self.arrays = arrays
        self.outputs = outputs
        self.batch = batch
        self.per_item = sum(a.nbytes for a in arrays.values()) // batch

    def __len__(self) -> int:
        return self.batch

    def item_input_bytes(self) -> int:
        return self.per_item

    def encode_chunk(self, items: range, slot: PoolSlot) -> list[ScratchBuffer | InferInput]:
        staged: list[ScratchBuffer | InferInput] = []
        descs = scratch(slot, [(n, a.shape, a.dtype) for n, a in self.arrays.items()])
        for d, a in zip(descs, self.arrays.values(), strict=True):
            np.copyto(pool_view(d), a)
            staged.append(d)
        return staged

    def decode_chunk(self, items: range, response: InferResponseMessage) -> None:
        if len(response.outputs) == 0:
            raise RuntimeError("response without outputs")

    def output_specs(self) -> list[OutputSpec]:
        return self.outputs


# --------------------------------------------------------------------------------------------
# The load loops


async def _drive_level(
    cfg: BenchConfig,
    concurrency: int,
    call: Callable[[], Awaitable[None]],
    out=sys.stderr,
    clock: Callable[[], float] = time.perf_counter,
) -> Window:
    """One level's measured window (after its warm-up). ``clock`` is the one the schedule,
    latencies and window run on: its tests pass the event loop's, on trio's ``MockClock``."""

    async def measure(window: Window, seconds: float, show: bool) -> None:
        end = clock() + seconds
        started = clock()

        async def once(t0: float) -> None:
            try:
                await call()
            except Exception as exc:
                window.errors[status_name(exc)] += 1
            else:
                window.latencies.append(clock() - t0)

        async def closed_worker() -> None:
            while clock() < end:
                await once(clock())

        async def ticker() -> None:
            while True:
                await anyio.sleep(0.25)
                if show:
                    out.write("\r" + progress_line(cfg, window, clock() - started))
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
                        delay = due - clock()
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
    cpu0, t0 = time.process_time(), clock()
    await measure(window, cfg.duration, cfg.progress)
    window.seconds = clock() - t0
    window.cpu_seconds = time.process_time() - cpu0
    if cfg.progress:
        out.write("\r" + progress_line(cfg, window, window.seconds) + "\n")
        out.flush()
    return window


async def _kserve_trio_levels(cfg: BenchConfig) -> list[Window]:
    mode = "on" if cfg.transport == "shm" else "off"
    model = KServeModel(
        cfg.url,
        cfg.model,
        max_batch_size=cfg.batch,
        deadline=cfg.deadline,
        shared_memory=mode,
        http2_engine=cfg.http2_engine,
    )
    async with model:
        spec = await model.io_spec()
        arrays = synth_inputs(spec, cfg.batch)
        outputs: list[OutputSpec] = []
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

    host, port, _secure = parse_url(cfg.url)
    client = aioclient.InferenceServerClient(f"{host}:{port}")
    try:
        meta = await client.get_model_metadata(cfg.model, as_json=True)
        if not isinstance(meta, dict):
            raise RuntimeError(f"no metadata for model '{cfg.model}'")
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
            if result is None:
                raise RuntimeError(f"no response from model '{cfg.model}'")
            for name in names:
                result.as_numpy(name)

        return [await _drive_level(cfg, c, call) for c in cfg.concurrency]
    finally:
        await client.close()


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every level and return the report (the event loop is asyncio, uvloop if present)."""
    if cfg.client == "tritonclient" and cfg.transport != "inline":
        raise ValueError("--client tritonclient supports --transport inline only")
    levels = _tritonclient_levels if cfg.client == "tritonclient" else _kserve_trio_levels
    windows = anyio.run(
        levels, cfg, backend="asyncio", backend_options={"use_uvloop": uvloop_available()}
    )
    return report(cfg, windows)


__all__ = ["run_bench", "synth_inputs"]
