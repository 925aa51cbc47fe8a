"""kserve_trio's worker against KServe's Python model server on small requests, in one run.

Both serve ``identity`` (``INPUT0`` -> ``OUTPUT0``, same shape and dtype) and ``sum``
(``OUTPUT0 = INPUT0.sum(axis=-1, keepdims=True)``, same dtype) over KServe V2 gRPC: KServe 0.21
runs ``tools/bench/kserve_peer.py`` from ``.venv-kserve`` (created or reused by
``tools/bench/setup_kserve.sh``); kserve_trio runs one worker per shape, because a bundle fixes
the rank: a repository with ``identity`` and ``sum`` on ``[n,16]`` (plus the demo ``mlp``) and
one with ``identity`` and ``sum`` on ``[n,3,224,224]``, all compiled for batch sizes 1, 2, 4, 8,
16 and 32 with the project's export tooling (cached under ``--build``, each bundle built once). The echo server (``tools/bench/echo_server.py``,
the worker's gRPC stack and codec with no scheduler or device) is measured in the same run, and
with ``--base TREE`` (a ``git worktree`` of an older commit) the same servers are run from that
tree too, so a change is measured before and after in one session.

Load: ``tools/bench/raw_load.py`` (a raw ``grpc.aio`` client sending one pre-serialized request,
closed loop, ``c`` calls in flight on one channel), one process per point. With 2 or more CPUs
the servers run on CPU 0 and the load generator on CPU 1 (``taskset``). Rounds interleave the
servers, alternating their order, so drifting background load hits every server alike; the
table gives medians over rounds. Per point the CPU used by every other process (``/proc/stat``
minus the server and the load generator) and the load average are recorded; a point where
others used more than ``NOISY_CORES`` is measured again, and reported as noisy if it stays so.
The raw floor (``h2_floor.py``: asyncio + h2, nothing else) runs beside the echo server. Server CPU per request is utime+stime of the server process
and its descendants from /proc over the measured window. For ``mlp`` the worker's own counters
give the mean batch (requests served / dispatches) over the window.

``--variant LABEL:K=V[,K=V]`` adds a worker started with extra environment (an A/B switch).

Usage: python tools/bench/peers.py [--rounds 3] [--duration 3] [--cases identity16,identity224,
           sum16,sum224,mlp,echo] [--concurrency 1,8] [--base /tmp/base] [--variant slow:KSERVE_TRIO_GRPC_FAST_INFER=0] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import (
    NOISY_CORES,
    RETRIES,
    cpu_seconds,
    load_average,
    machine_busy_seconds,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
PY = sys.executable
BATCH_SIZES = [1, 2, 4, 8, 16, 32]
PINNED = (os.cpu_count() or 1) >= 2 and shutil.which("taskset") is not None

# case: (shape, model on kserve_trio, output there, which servers, concurrencies, expect)
CASES = {
    "identity16": ("1,16", "identity", "OUTPUT0", ("kserve", "ours16"), (1, 8, 32), "identity"),
    "identity224": (
        "1,3,224,224",
        "identity",
        "OUTPUT0",
        ("kserve", "ours224"),
        (1, 8, 32),
        "identity",
    ),
    "sum16": ("1,16", "sum", "OUTPUT0", ("kserve", "ours16"), (1, 8, 32), "sum"),
    "sum224": ("1,3,224,224", "sum", "OUTPUT0", ("kserve", "ours224"), (1, 8, 32), "sum"),
    "mlp": ("1,16", "mlp", "output", ("ours16",), (1, 8), "none"),
    "echo": ("1,16", "echo", "INPUT0", ("echo", "floor"), (1, 8, 32), "identity"),
}


def pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if PINNED else []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ repositories


def _export(target: pathlib.Path, fn: str, shape: tuple[int, ...]) -> None:
    code = (
        "import numpy as np, sys\n"
        "from kserve_trio.export import export_bundle\n"
        f"export_bundle('jax', {fn}, np.zeros({shape!r}, np.float32), [], dir=sys.argv[1],"
        f" batch_sizes={BATCH_SIZES!r}, input_names=['INPUT0'], output_names=['OUTPUT0'])\n"
    )
    subprocess.run([PY, "-c", code, str(target)], check=True)


# bundle name -> the function exported (source text, run on a jax array of the bundle's shape)
BUNDLES = {"identity": "lambda x: x", "sum": "lambda x: x.sum(axis=-1, keepdims=True)"}
SHAPES = {"r16": (1, 16), "r224": (1, 3, 224, 224)}


def _build_once(target: pathlib.Path, build_fn: Callable[[pathlib.Path], None]) -> None:
    """Run ``build_fn(tmp)`` and move ``tmp`` to ``target``, unless ``target`` already exists.

    A bundle is built under a scratch directory (with its own name: the export names the
    model after its directory) and renamed into place, so an interrupted build leaves nothing
    the next run would take for a finished bundle, and a cache made before a bundle was added
    gets just that bundle.
    """
    if target.exists():
        return
    scratch = target.parent / f".{target.name}.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    build_fn(scratch / target.name)
    (scratch / target.name).rename(target)
    shutil.rmtree(scratch, ignore_errors=True)


def _demo_mlp(target: pathlib.Path) -> None:
    code = "import sys\nfrom kserve_trio.export.demo import write_demo_repository\n"
    code += "write_demo_repository(sys.argv[1], only=['mlp'])\n"
    subprocess.run([PY, "-c", code, str(target)], check=True)


def build_repositories(build: pathlib.Path) -> dict[str, pathlib.Path]:
    """``r16`` (identity and sum on [n,16], mlp) and ``r224`` (identity and sum on [n,3,224,224])."""
    repos = {name: build / name for name in SHAPES}
    for name, shape in SHAPES.items():
        for model, fn in BUNDLES.items():
            _build_once(repos[name] / model, lambda d, fn=fn, shape=shape: _export(d, fn, shape))
    # the demo writes mlp into a repository: its scratch directory is one
    _build_once(repos["r16"] / "mlp", lambda d: _demo_mlp(d.parent))
    return repos


# ------------------------------------------------------------------------------------ servers


class Server:
    """One server process on CPU ``cpu`` (0; None: not pinned), ready when ``ServerReady``
    says so."""

    def __init__(
        self,
        label: str,
        kind: str,
        cmd: list[str],
        env: dict[str, str],
        cwd: pathlib.Path,
        metrics_port: int = 0,
        port: int = 0,
        cpu: int | None = 0,
    ) -> None:
        self.label, self.kind, self.metrics_port = label, kind, metrics_port
        self.port = port or int(cmd[cmd.index("--port" if kind != "kserve" else "--grpc_port") + 1])
        self.proc = subprocess.Popen(
            [*(pin(cpu) if cpu is not None else []), *cmd],
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL if kind == "kserve" else None,
        )

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0, ca: str = "") -> None:
        """Block until ServerReady says so (``ca``: the CA of a TLS server to trust)."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(
            self.url, ssl=bool(ca), root_certificates=ca or None
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.proc.returncode}")
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.label} not ready")

    def served_and_dispatches(self, model: str) -> tuple[float, float]:
        if not self.metrics_port:
            return 0.0, 0.0
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url).read().decode()

        def value(metric: str) -> float:
            m = re.search(rf'^{metric}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
            return float(m.group(1)) if m else 0.0

        return value("worker_requests_served_total"), value("worker_dispatch_total")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def worker_server(
    label: str, repo: pathlib.Path, tree: pathlib.Path, env: dict[str, str]
) -> Server:
    port, metrics = free_port(), free_port()
    cmd = [
        PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(port),
        "--metrics-port", str(metrics), "--model-control-mode", "static",
        "--log-level", "warning", "--log-format", "json",
    ]  # fmt: skip
    return Server(label, "worker", cmd, {"PYTHONPATH": str(tree), **env}, tree, metrics)


def echo_server(label: str, tree: pathlib.Path, env: dict[str, str]) -> Server:
    cmd = [PY, str(tree / "tools" / "bench" / "echo_server.py"), "--port", str(free_port())]
    return Server(label, "echo", cmd, {"PYTHONPATH": str(tree), **env}, tree)


def floor_server() -> Server:
    """The raw asyncio + h2 floor (``h2_floor.py``), from this tree only."""
    cmd = [PY, str(BENCH / "h2_floor.py"), "--port", str(free_port())]
    return Server("h2 floor", "echo", cmd, {}, ROOT)


def kserve_server(venv: pathlib.Path) -> Server:
    if venv == ROOT / ".venv-kserve":
        subprocess.run(["bash", str(BENCH / "setup_kserve.sh")], check=True, cwd=ROOT)
    cmd = [
        str(venv / "bin" / "python"), str(BENCH / "kserve_peer.py"), "--grpc_port", str(free_port()),
        "--http_port", str(free_port()), "--enable_latency_logging", "false",
    ]  # fmt: skip
    return Server("KServe", "kserve", cmd, {"KSERVE_LOGLEVEL": "WARNING"}, ROOT)


# ---------------------------------------------------------------------------------- measuring


def measure(server: Server, case: str, conc: int, duration: float) -> dict:
    """One clean point: ``_measure_once`` again while others used over ``NOISY_CORES``."""
    for _ in range(RETRIES + 1):
        result = _measure_once(server, case, conc, duration)
        if result["others_cores"] <= NOISY_CORES:
            return result
        print(
            f"  noisy: others used {result['others_cores']} cores "
            f"(load {result['load']}), measuring again",
            flush=True,
        )
    result["noisy"] = True
    return result


def _measure_once(server: Server, case: str, conc: int, duration: float) -> dict:
    shape, model, output, _, _, expect = CASES[case]
    if server.kind == "kserve":  # serves identity and sum under the same names as ours
        output = "OUTPUT0"
    inp = "input_0" if model == "mlp" else "INPUT0"
    cmd = [
        *pin(1), PY, str(BENCH / "raw_load.py"), "--url", server.url, "--model", model,
        "--input", inp, "--output", output, "--shape", shape, "--concurrency", str(conc),
        "--duration", str(duration), "--warmup", "1", "--expect", expect,
    ]  # fmt: skip
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    cpu0 = cpu1 = gen0 = gen1 = busy0 = busy1 = t0 = t1 = 0.0
    served = [0.0, 0.0]
    disp = [0.0, 0.0]
    result = None
    pid = server.proc.pid
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            t0, busy0, gen0 = time.monotonic(), machine_busy_seconds(), cpu_seconds(gen.pid)
            cpu0 = cpu_seconds(pid)
            if model == "mlp":
                served[0], disp[0] = server.served_and_dispatches(model)
        elif line.startswith("WINDOW_END"):
            cpu1 = cpu_seconds(pid)
            t1, busy1, gen1 = time.monotonic(), machine_busy_seconds(), cpu_seconds(gen.pid)
            if model == "mlp":
                served[1], disp[1] = server.served_and_dispatches(model)
        elif line.startswith("{"):
            result = json.loads(line)
    gen.wait()
    if result is None:
        raise RuntimeError(f"load generator failed: {server.label} {case} c={conc}")
    n = max(result["requests"], 1)
    result["cpu_ms"] = round((cpu1 - cpu0) / n * 1e3, 3)
    others = (busy1 - busy0) - (cpu1 - cpu0) - (gen1 - gen0)
    result["others_cores"] = round(max(0.0, others) / max(t1 - t0, 1e-9), 3)
    result["load"] = load_average()
    if disp[1] > disp[0]:
        result["mean_batch"] = round((served[1] - served[0]) / (disp[1] - disp[0]), 2)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--cases", default="identity16,identity224,mlp,echo", help=",".join(CASES))
    p.add_argument(
        "--concurrency", default="", help="e.g. 1,8: only these of each case's concurrencies"
    )
    p.add_argument("--base", default="", help="a worktree of an older commit, run alongside")
    p.add_argument("--variant", action="append", default=[], help="LABEL:K=V[,K=V] (a worker)")
    p.add_argument("--no-kserve", action="store_true")
    p.add_argument(
        "--kserve-venv",
        default=str(ROOT / ".venv-kserve"),
        help="KServe's environment (default: .venv-kserve, set up by setup_kserve.sh)",
    )
    p.add_argument("--build", default=str(ROOT / "build" / "bench-peers"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    only = {int(c) for c in args.concurrency.split(",") if c}
    repos = build_repositories(pathlib.Path(args.build))
    base = pathlib.Path(args.base).resolve() if args.base else None
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    # role -> servers measured for it (the first one is "ours")
    roles: dict[str, list[Server]] = {
        "kserve": [],
        "ours16": [],
        "ours224": [],
        "echo": [],
        "floor": [],
    }
    needed = {role for c in cases for role in CASES[c][3]}
    servers: list[Server] = []
    try:
        if "kserve" in needed and not args.no_kserve:
            roles["kserve"].append(kserve_server(pathlib.Path(args.kserve_venv)))
        variants = [("kserve_trio", {}, ROOT)]
        for spec in args.variant:
            label, _, kvs = spec.partition(":")
            env = dict(kv.split("=", 1) for kv in kvs.split(",") if kv)
            variants.append((f"kserve_trio:{label}", env, ROOT))
        if base is not None:
            variants.append((f"kserve_trio@{base.name}", {}, base))
        for label, env, tree in variants:
            if "ours16" in needed:
                roles["ours16"].append(worker_server(label, repos["r16"], tree, env))
            if "ours224" in needed:
                roles["ours224"].append(worker_server(label, repos["r224"], tree, env))
        if "echo" in needed:  # one echo server per tree (the worker's switches do not reach it)
            for label, env, tree in variants:
                if env:
                    continue
                name = "echo" + label.removeprefix("kserve_trio")
                roles["echo"].append(echo_server(name, tree, env))
        if "floor" in needed:
            roles["floor"].append(floor_server())
        servers = [s for group in roles.values() for s in group]
        for s in servers:
            s.wait_ready()
        runs: dict[tuple[str, int, str], list[dict]] = {}
        for r in range(args.rounds):
            for case in cases:
                group = [s for role in CASES[case][3] for s in roles[role]]
                for conc in [c for c in CASES[case][4] if not only or c in only]:
                    order = group if r % 2 == 0 else group[::-1]
                    for s in order:
                        res = measure(s, case, conc, args.duration)
                        runs.setdefault((case, conc, s.label), []).append(res)
                        print(
                            f"round {r + 1} {case} c={conc} {s.label}: {res['rps']} req/s "
                            f"p50 {res['p50_ms']} p99 {res['p99_ms']} ms cpu {res['cpu_ms']} "
                            f"ms/req"
                            + (f" batch {res['mean_batch']}" if "mean_batch" in res else "")
                            + (f" errors {res['errors']}" if res["errors"] else "")
                            + f" others {res['others_cores']} cores, load {res['load']}"
                            + (" NOISY" if res.get("noisy") else ""),
                            flush=True,
                        )
    finally:
        for s in servers:
            s.stop()
    print(
        f"\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit {commit}, "
        f"medians of {args.rounds} rounds, {args.duration:g} s windows"
    )
    print(
        "| case | c | server | req/s | p50 ms | p99 ms | server CPU ms/req | mean batch "
        "| others' cores (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (case, conc, label), results in runs.items():
        row = {"case": case, "c": conc, "server": label}
        for k in ("rps", "p50_ms", "p99_ms", "cpu_ms"):
            row[k] = round(statistics.median(x[k] for x in results), 3)
        batches = [x["mean_batch"] for x in results if "mean_batch" in x]
        row["mean_batch"] = round(statistics.median(batches), 2) if batches else None
        row["errors"] = sum(sum(x["errors"].values()) for x in results)
        row["others_cores"] = max(x["others_cores"] for x in results)
        row["noisy"] = any(x.get("noisy") for x in results)
        rows.append(row)
    rows.sort(key=lambda r: (cases.index(r["case"]), r["c"]))
    for row in rows:
        print(
            f"| {row['case']} | {row['c']} | {row['server']} | {row['rps']:,.0f} | "
            f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['cpu_ms']:.3f} | "
            f"{row['mean_batch'] if row['mean_batch'] is not None else ''} | "
            f"{row['others_cores']:.3f}{' noisy' if row['noisy'] else ''} |"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
