"""The hot-path benchmark suite: one command, every case of docs/benchmarks/history.md "Hot path".

The server under test runs pinned to CPU 0 and the load generator (tools/bench/loadgen.py, a
closed loop over tritonclient's aio client, in its own process) to CPU 1. Reported per case:
requests/s, p50/p99 latency, the server's CPU time per request (utime+stime of every thread,
from /proc, over the measured window) and, for worker cases, the scheduler's mean batch size
(requests per device execution, from /metrics). A single-thread memcpy of the large payload is
measured in the same run as the yardstick for the shared-memory case. Each point applies the
clean-run rule of tools/bench/noise.py (others' CPU and the load average over the window; a
point where others used over ``NOISY_CORES`` is measured again, and reported as noisy).

Usage: python tools/bench/run.py [--duration 5] [--quick] [--only echo,mlp,...] [--json FILE]
       [--no-uvloop]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import Window, clean_point  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def build_repository(path: pathlib.Path) -> pathlib.Path:
    """mlp (the demo bundle) and identity f32 [B,3,224,224] (B in 1, 8, 32, 64), cached."""
    marker = path / ".complete"
    if marker.exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    subprocess.run(
        [PY, "-m", "kserve_trio", "bundle", "demo", str(path), "--only", "mlp"], check=True
    )
    code = (
        "import numpy as np, sys\n"
        "from kserve_trio.export import export_bundle\n"
        "export_bundle('jax', lambda x: x, np.zeros((1, 3, 224, 224), np.float32), [],"
        " dir=sys.argv[1], batch_sizes=[1, 8, 32, 64])\n"
    )
    subprocess.run([PY, "-c", code, str(path / "identity")], check=True)
    marker.write_text("ok")
    return path


class Server:
    def __init__(self, kind: str, repo: pathlib.Path, uvloop: bool) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        env = dict(os.environ)
        if kind == "echo":
            cmd = [PY, str(BENCH / "echo_server.py"), "--port", str(self.port)]
            if not uvloop:
                cmd.append("--no-uvloop")
        else:
            cmd = [
                PY,
                "-m",
                "kserve_trio",
                "worker",
                "--model-repo",
                str(repo),
                "--port",
                str(self.port),
                "--metrics-port",
                str(self.metrics_port),
                "--model-control-mode",
                "static",
                "--log-level",
                "warning",
                "--log-format",
                "json",
            ]
            env["KSERVE_TRIO_UVLOOP"] = "1" if uvloop else "0"
        self.kind = kind
        self.proc = subprocess.Popen(
            ["taskset", "-c", "0", *cmd], env=env, stdout=subprocess.DEVNULL
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}")
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.kind} server not ready")

    def served_and_dispatches(self, model: str) -> tuple[float, float]:
        if self.kind == "echo":
            return 0.0, 0.0
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics").read().decode()
        )

        def value(metric: str) -> float:
            m = re.search(rf'^{metric}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
            return float(m.group(1)) if m else 0.0

        return value("worker_requests_served_total"), value("worker_dispatch_total")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_case(
    server: Server,
    model: str,
    shape: str,
    out_shape: str,
    output: str,
    conc: int,
    duration: float,
    shm: bool,
) -> dict:
    """One clean point (``noise.clean_point``): ``_run_case_once`` again while it is noisy."""
    return clean_point(
        lambda: _run_case_once(server, model, shape, out_shape, output, conc, duration, shm),
        f"{model} c={conc}",
    )


def _run_case_once(
    server: Server,
    model: str,
    shape: str,
    out_shape: str,
    output: str,
    conc: int,
    duration: float,
    shm: bool,
) -> dict:
    cmd = [
        "taskset",
        "-c",
        "1",
        PY,
        str(BENCH / "loadgen.py"),
        "--url",
        f"127.0.0.1:{server.port}",
        "--model",
        model,
        "--shape",
        shape,
        "--output-shape",
        out_shape,
        "--output",
        output,
        "--concurrency",
        str(conc),
        "--duration",
        str(duration),
        "--warmup",
        "1",
    ]
    if shm:
        cmd.append("--shm")
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    window = Window([server.proc.pid, gen.pid])
    served0, disp0 = 0.0, 0.0
    cpu0 = 0.0
    result = None
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            window.start()
            cpu0 = cpu_seconds(server.proc.pid)
            served0, disp0 = server.served_and_dispatches(model)
        elif line.startswith("{"):
            cpu1 = cpu_seconds(server.proc.pid)
            window.stop()
            result = json.loads(line)
    gen.wait()
    if result is None:
        raise RuntimeError(f"load generator failed for {model} c={conc}")
    served1, disp1 = server.served_and_dispatches(model)
    n = max(result["requests"], 1)
    result["server_cpu_ms_per_request"] = round((cpu1 - cpu0) / n * 1e3, 3)
    if disp1 > disp0:
        result["mean_batch"] = round((served1 - served0) / (disp1 - disp0), 2)
    return window.record(result)


def memcpy_gbps(nbytes: int) -> float:
    src = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


CASES = [
    # name, server, model, shape, out shape, output, concurrencies, shm
    ("echo", "echo", "echo", "1,16", "1,16", "input_0", (1, 8, 32), False),
    ("mlp", "worker", "mlp", "1,16", "1,8", "output", (1, 8, 32), False),
    (
        "identity_224",
        "worker",
        "identity",
        "1,3,224,224",
        "1,3,224,224",
        "output",
        (1, 8, 32),
        False,
    ),
    (
        "identity_64x224_inline",
        "worker",
        "identity",
        "64,3,224,224",
        "64,3,224,224",
        "output",
        (1, 4),
        False,
    ),
    (
        "identity_64x224_shm",
        "worker",
        "identity",
        "64,3,224,224",
        "64,3,224,224",
        "output",
        (1, 4),
        True,
    ),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--quick", action="store_true", help="2 s windows")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--json", default="")
    p.add_argument("--no-uvloop", action="store_true")
    p.add_argument("--repo", default=str(ROOT / "build" / "bench-models"))
    args = p.parse_args()
    duration = 2.0 if args.quick else args.duration
    only = {c for c in args.only.split(",") if c}
    repo = build_repository(pathlib.Path(args.repo))
    results = []
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} commit {commit} uvloop={'off' if args.no_uvloop else 'on'}"
    )
    print(
        "| case | c | req/s | p50 ms | p99 ms | server CPU ms/req | mean batch | MB/s "
        "| others' cores |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    servers: dict[str, Server] = {}
    try:
        for name, kind, model, shape, out_shape, output, concs, shm in CASES:
            if only and name not in only:
                continue
            if kind not in servers:
                servers[kind] = Server(kind, repo, not args.no_uvloop)
            for c in concs:
                r = run_case(servers[kind], model, shape, out_shape, output, c, duration, shm)
                r.update(case=name, concurrency=c)
                mbps = r["rps"] * r["payload_bytes"] / 1e6
                r["payload_mb_per_s"] = round(mbps, 1)
                results.append(r)
                print(
                    f"| {name} | {c} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | "
                    f"{r['server_cpu_ms_per_request']} | {r.get('mean_batch', '')} | {mbps:.0f} | "
                    f"{r['others_cores']:.3f}{' noisy' if r.get('noisy') else ''} |",
                    flush=True,
                )
                if r["errors"]:
                    print(f"  errors: {r['errors']}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    if not only or any("64x224" in n for n in only):
        gbps = memcpy_gbps(64 * 3 * 224 * 224 * 4)
        print(f"single-thread memcpy of 38.5 MB: {gbps * 1e3:.0f} MB/s")
        results.append({"case": "memcpy_38.5MB", "mb_per_s": round(gbps * 1e3)})
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"commit": commit, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
