"""Soak: a million requests of mixed traffic through the gateway to a worker with two front
ends, every answer checked against numpy, every server process's memory and descriptors sampled.

Servers: one worker (``--frontend-processes 2``, gRPC and REST) on a repository of the demo's
``mlp`` and ``cnn`` and the peers' ``identity`` on ``[n,3,224,224]`` (``tools/bench/peers.py``
builds it), and one gateway (gRPC and REST) in front of it. Load: ``--procs`` client processes,
each running the mix below in a closed loop with ``--concurrency`` threads, until the total
reaches ``--requests``:

- tritonclient gRPC unary ``mlp`` (1-8 rows) and ``cnn`` (1-4 images);
- tritonclient gRPC streams (ModelStreamInfer, 4 requests per stream);
- tritonclient gRPC with the input and output in system shared memory;
- cancellations: an ``async_infer`` cancelled at once (answers that still arrive are checked);
- 2 MB tensors: ``identity`` on ``[3,3,224,224]`` (1.8 MB each way);
- tritonclient HTTP (REST) ``mlp``.

Every answer is compared with numpy (``mlp_reference``, ``cnn_reference``, identity). Every
``--sample`` seconds the RSS and open descriptors of every server process (the worker, its front
ends, the gateway) are recorded. The verdict: wrong answers, errors other than cancellations,
RSS growth per process after the warm-up (the first sample after ``--warmup`` requests), and
descriptor counts (first against last).

Usage: python tools/bench/soak.py [--requests 1000000] [--procs 2] [--concurrency 4]
           [--sample 30] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
KINDS = ("unary_mlp", "unary_cnn", "stream", "shm", "cancel", "big", "rest")
WEIGHTS = (30, 10, 15, 10, 10, 2, 15)
"""How often each kind is drawn (per hundred): mostly small unary calls, as production is."""
STREAM_REQUESTS = 4
"""Requests per ModelStreamInfer stream."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repository(build: pathlib.Path) -> pathlib.Path:
    """The soak's repository: the demo's mlp and cnn, the peers' 224x224 identity."""
    import peers

    from kserve_trio.export.demo import write_demo_repository

    repo = build / "soak"
    if not (repo / "mlp").exists():
        write_demo_repository(repo, only=["mlp", "cnn"])
    identity = peers.build_repositories(build / "bench-peers")["r224"] / "identity"
    if not (repo / "identity").exists():
        (repo / "identity").symlink_to(identity.resolve())
    return repo


# ----------------------------------------------------------------------------------- the load


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.wrong: list[str] = []

    def ok(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def error(self, kind: str, what: str) -> None:
        with self.lock:
            key = f"{kind}: {what[:120]}"
            self.errors[key] = self.errors.get(key, 0) + 1

    def mismatch(self, kind: str, what: str) -> None:
        with self.lock:
            if len(self.wrong) < 20:
                self.wrong.append(f"{kind}: {what}")
            self.counts["wrong"] = self.counts.get("wrong", 0) + 1


def _client_process(
    index: int,
    grpc_url: str,
    http_url: str,
    quota: int,
    concurrency: int,
    out: multiprocessing.Queue,
) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    from kserve_trio.export.demo import cnn_reference, mlp_reference

    tally = Tally()
    left = [quota]
    left_lock = threading.Lock()

    def take(requests: int) -> bool:
        with left_lock:
            if left[0] <= 0:
                return False
            left[0] -= requests
            return True

    def grpc_input(name: str, x: np.ndarray) -> grpcclient.InferInput:
        inp = grpcclient.InferInput(name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return inp

    def check(kind: str, got: np.ndarray | None, want: np.ndarray) -> None:
        if (
            got is None
            or got.shape != want.shape
            or not np.allclose(got, want, rtol=1e-4, atol=1e-4)
        ):
            tally.mismatch(kind, f"shape {None if got is None else got.shape} vs {want.shape}")
        else:
            tally.ok(kind)

    def worker_thread(t: int) -> None:
        rng = random.Random(index * 1000 + t)
        c = grpcclient.InferenceServerClient(grpc_url)
        h = httpclient.InferenceServerClient(http_url, concurrency=1)
        key = f"soak-{os.getpid()}-{t}"
        region = shm.create_shared_memory_region(key, f"/{key}", 2 * 8 * 16 * 4)
        c.register_system_shared_memory(key, f"/{key}", 2 * 8 * 16 * 4)
        try:
            while True:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                if not take(STREAM_REQUESTS if kind == "stream" else 1):
                    break
                try:
                    if kind == "unary_mlp":
                        x = (
                            np.random.default_rng(rng.randint(0, 1 << 16))
                            .standard_normal((rng.randint(1, 8), 16))
                            .astype(np.float32)
                        )
                        r = c.infer("mlp", [grpc_input("input_0", x)])
                        check(kind, r.as_numpy("output"), mlp_reference(x))
                    elif kind == "unary_cnn":
                        x = (
                            np.random.default_rng(rng.randint(0, 1 << 16))
                            .standard_normal((rng.randint(1, 4), 3, 32, 32))
                            .astype(np.float32)
                        )
                        r = c.infer("cnn", [grpc_input("input_0", x)])
                        check(kind, r.as_numpy("output"), cnn_reference(x))
                    elif kind == "stream":
                        import queue

                        answers: queue.Queue = queue.Queue()
                        xs = {}
                        c.start_stream(
                            lambda result, error, answers=answers: answers.put((result, error))
                        )
                        try:
                            for i in range(STREAM_REQUESTS):
                                x = np.full((rng.randint(1, 8), 16), rng.random(), np.float32)
                                xs[str(i)] = x
                                c.async_stream_infer(
                                    "mlp", [grpc_input("input_0", x)], request_id=str(i)
                                )
                            for _ in range(STREAM_REQUESTS):
                                result, error = answers.get(timeout=60)
                                if error is not None:
                                    tally.error(kind, str(error))
                                    continue
                                rid = result.get_response().id
                                check(kind, result.as_numpy("output"), mlp_reference(xs[rid]))
                        finally:
                            c.stop_stream()
                    elif kind == "shm":
                        x = (
                            np.random.default_rng(rng.randint(0, 1 << 16))
                            .standard_normal((8, 16))
                            .astype(np.float32)
                        )
                        shm.set_shared_memory_region(region, [x])
                        inp = grpcclient.InferInput("input_0", [8, 16], "FP32")
                        inp.set_shared_memory(key, x.nbytes, offset=0)
                        out = grpcclient.InferRequestedOutput("output")
                        out.set_shared_memory(key, 8 * 8 * 4, offset=x.nbytes)
                        c.infer("mlp", [inp], outputs=[out])
                        got = shm.get_contents_as_numpy(region, np.float32, [8, 8], offset=x.nbytes)
                        check(kind, got.copy(), mlp_reference(x))
                    elif kind == "cancel":
                        x = np.ones((2, 16), np.float32)
                        done: list = []
                        event = threading.Event()

                        def on_done(result, error, done=done, event=event):
                            done.append((result, error))
                            event.set()

                        ctx = c.async_infer("mlp", [grpc_input("input_0", x)], on_done)
                        ctx.cancel()
                        event.wait(60)
                        result, error = done[0] if done else (None, "no callback")
                        if error is None:
                            check(kind, result.as_numpy("output"), mlp_reference(x))
                        elif "CANCELLED" in str(error) or "Locally cancelled" in str(error):
                            tally.ok("cancelled")
                        else:
                            tally.error(kind, str(error))
                    elif kind == "big":
                        x = np.random.default_rng(rng.randint(0, 1 << 16)).random(
                            (3, 3, 224, 224), np.float32
                        )
                        r = c.infer("identity", [grpc_input("INPUT0", x)])
                        check(kind, r.as_numpy("OUTPUT0"), x)
                    else:
                        x = (
                            np.random.default_rng(rng.randint(0, 1 << 16))
                            .standard_normal((rng.randint(1, 8), 16))
                            .astype(np.float32)
                        )
                        inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
                        inp.set_data_from_numpy(x, binary_data=rng.random() < 0.5)
                        r = h.infer("mlp", [inp])
                        check(kind, r.as_numpy("output"), mlp_reference(x))
                except InferenceServerException as exc:
                    tally.error(kind, f"{exc.status()} {exc.message()}")
                except Exception as exc:  # a soak counts every failure
                    tally.error(kind, f"{type(exc).__name__}: {exc}")
        finally:
            try:
                c.unregister_system_shared_memory(key)
            finally:
                shm.destroy_shared_memory_region(region)
                c.close()
                h.close()

    threads = [threading.Thread(target=worker_thread, args=(t,)) for t in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"counts": tally.counts, "errors": tally.errors, "wrong": tally.wrong})


# ------------------------------------------------------------------------------------ sampling


def _tree(pid: int) -> list[int]:
    out = [pid]
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out.extend(p for child in task.read_text().split() for p in _tree(int(child)))
        except OSError:
            pass
    return out


def _sample(roots: dict[str, int]) -> dict[str, dict[str, int]]:
    """RSS (KiB) and open descriptors of every process under each root."""
    out: dict[str, dict[str, int]] = {}
    for label, root in roots.items():
        for i, pid in enumerate(_tree(root)):
            try:
                status = pathlib.Path(f"/proc/{pid}/status").read_text()
                rss = int(
                    next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]
                )
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            out[f"{label}[{i}]" if i else label] = {"rss_kib": rss, "fds": fds}
    return out


def _wait_http(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"not ready: {url}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sample", type=float, default=30.0)
    ap.add_argument("--warmup", type=int, default=20_000, help="requests before the RSS baseline")
    ap.add_argument("--json", help="write the samples and verdict here")
    args = ap.parse_args()

    repo = _repository(ROOT / "build")
    wport, whttp, wmetrics = _free_port(), _free_port(), _free_port()
    gport, ghttp, gmetrics = _free_port(), _free_port(), _free_port()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="soak-"))
    worker = subprocess.Popen(
        [
            PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(wport),
            "--http-port", str(whttp), "--metrics-port", str(wmetrics),
            "--frontend-processes", "2", "--model-control-mode", "static", "--log-level", "warning",
        ],
        stdout=open(logs / "worker.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    g = "KSERVE_TRIO_GATEWAY_"
    gateway = subprocess.Popen(
        [PY, "-m", "kserve_trio", "gateway", "--log-level", "warning"],
        env={
            **os.environ,
            g + "WORKERS": f"127.0.0.1:{wport}",
            g + "WORKER_HTTP_ENDPOINTS": f"127.0.0.1:{whttp}",
            g + "LISTEN_GRPC": f"127.0.0.1:{gport}",
            g + "LISTEN_HTTP": f"127.0.0.1:{ghttp}",
            g + "LISTEN_METRICS": f"127.0.0.1:{gmetrics}",
            g + "STARTUP_WAIT_SECONDS": "300",
        },
        stdout=open(logs / "gateway.log", "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    try:
        _wait_http(f"http://127.0.0.1:{wmetrics}/readyz")
        _wait_http(f"http://127.0.0.1:{gmetrics}/readyz")
        roots = {"worker": worker.pid, "gateway": gateway.pid}
        samples: list[dict] = []
        per_proc = args.requests // args.procs
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that imported numpy
        results = ctx.Queue()
        clients = [
            ctx.Process(
                target=_client_process,
                args=(
                    i,
                    f"127.0.0.1:{gport}",
                    f"127.0.0.1:{ghttp}",
                    per_proc,
                    args.concurrency,
                    results,
                ),
            )
            for i in range(args.procs)
        ]
        started = time.monotonic()
        for p in clients:
            p.start()
        served_at_sample = 0
        baseline: dict | None = None
        while any(p.is_alive() for p in clients):
            time.sleep(min(args.sample, 5.0))
            now = time.monotonic() - started
            if samples and now - samples[-1]["t"] < args.sample:
                continue
            served = _served(gmetrics)
            point = {"t": round(now, 1), "served": served, "processes": _sample(roots)}
            samples.append(point)
            if baseline is None and served >= args.warmup:
                baseline = point
            rate = (served - served_at_sample) / max(args.sample, 1e-9)
            served_at_sample = served
            print(
                json.dumps(
                    {
                        "t": point["t"],
                        "served": served,
                        "rps": round(rate),
                        **{k: v["rss_kib"] // 1024 for k, v in point["processes"].items()},
                        **{k + ".fds": v["fds"] for k, v in point["processes"].items()},
                    }
                ),
                flush=True,
            )
            if args.json:  # what a run cut short still leaves
                pathlib.Path(args.json).write_text(json.dumps({"samples": samples}, indent=1))
        outcomes = [results.get(timeout=60) for _ in clients]
        final = {"t": round(time.monotonic() - started, 1), "served": _served(gmetrics),
                 "processes": _sample(roots)}  # fmt: skip
        samples.append(final)
    finally:
        gateway.terminate()
        worker.terminate()
        gateway.wait(60)
        worker.wait(60)
    counts: dict[str, int] = {}
    errors: dict[str, int] = {}
    wrong: list[str] = []
    for o in outcomes:
        for k, v in o["counts"].items():
            counts[k] = counts.get(k, 0) + v
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
        wrong.extend(o["wrong"])
    base = baseline or samples[0]
    growth = {
        name: (final["processes"][name]["rss_kib"] - p["rss_kib"]) / 1024
        for name, p in base["processes"].items()
        if name in final["processes"]
    }
    fds = {
        name: (p["fds"], final["processes"][name]["fds"])
        for name, p in samples[0]["processes"].items()
        if name in final["processes"]
    }
    verdict = {
        "requests": sum(counts.values()) + sum(errors.values()),
        "seconds": final["t"],
        "counts": counts,
        "wrong": counts.get("wrong", 0),
        "wrong_examples": wrong,
        "errors": errors,
        "rss_growth_mib_after_warmup": {k: round(v, 1) for k, v in growth.items()},
        "fds_first_last": fds,
        "baseline_at_served": base["served"],
    }
    print(json.dumps(verdict, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"verdict": verdict, "samples": samples}, indent=1)
        )


def _served(metrics_port: int) -> int:
    """Requests the gateway has answered (its ``gateway_requests_total``, every status)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return -1
    return int(
        sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("gateway_requests_total{")
        )
    )


if __name__ == "__main__":
    main()
