"""The worker with its front end in several processes (``--frontend-processes N``) against one
process and KServe's Python server, in one run.

Servers: kserve_trio's worker on the peers' repositories (``identity`` on ``[n,16]`` and on
``[n,3,224,224]``, built by ``tools/bench/peers.py``'s ``build_repositories``) with N = 1 and
N = 2 (and more with ``--frontends``), and KServe 0.21 (``tools/bench/kserve_peer.py`` from
``.venv-kserve``). Nothing is pinned: the front ends, the device process and the load share the
machine's cores as the scheduler places them.

Load: ``--procs P`` processes of ``tools/bench/raw_load.py`` (each a raw ``grpc.aio`` channel,
so P client connections, which SO_REUSEPORT spreads over the front ends) with ``c / P`` calls
in flight each, closed loop; req/s is their sum, p50/p99 the worst of them. The window is from
the last ``WINDOW_START`` to the first ``WINDOW_END``. Per point: the server's CPU per request
(every process of the server), the device process's own CPU per request (the worker's pid
alone: what stays on the device's core), and the CPU every other process used (``/proc/stat``
minus the server and the load), measured again while above ``NOISY_CORES``. Rounds interleave
the servers in alternating order; the table gives medians over rounds.

Usage: python tools/bench/frontends.py [--rounds 3] [--duration 4] [--procs 2]
           [--points identity16:1,identity16:32,identity224:8] [--frontends 1,2] [--no-kserve]
           [--json F]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import peers
from noise import (
    CLK_TCK,
    NOISY_CORES,
    RETRIES,
    cpu_seconds,
    load_average,
    machine_busy_seconds,
)

peers.pin = lambda cpu: []  # nothing pinned here (module docstring)

PY = sys.executable
SHAPES = {"identity16": ("1,16", "r16"), "identity224": ("1,3,224,224", "r224")}


def own_cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` alone (not its children)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def worker(label: str, repo: pathlib.Path, frontends: int) -> peers.Server:
    port, metrics = peers.free_port(), peers.free_port()
    cmd = [
        PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(port),
        "--metrics-port", str(metrics), "--model-control-mode", "static",
        "--log-level", "warning", "--log-format", "json",
        "--frontend-processes", str(frontends),
    ]  # fmt: skip
    return peers.Server(label, "worker", cmd, {"PYTHONPATH": str(peers.ROOT)}, peers.ROOT, metrics)


def measure_once(server: peers.Server, case: str, conc: int, procs: int, duration: float) -> dict:
    shape, _ = SHAPES[case]
    each = max(1, conc // procs)
    gens = []
    for _ in range(procs if conc >= procs else 1):
        cmd = [
            PY, str(peers.BENCH / "raw_load.py"), "--url", server.url, "--model", "identity",
            "--input", "INPUT0", "--output", "OUTPUT0", "--shape", shape,
            "--concurrency", str(each if conc >= procs else conc),
            "--duration", str(duration), "--warmup", "1", "--expect", "identity",
        ]  # fmt: skip
        gens.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    pid = server.proc.pid
    split0 = frontend_split(server)
    sample0: tuple[float, ...] = ()
    sample1: tuple[float, ...] = ()
    results = []

    def sample() -> tuple[float, ...]:
        return (
            time.monotonic(),
            machine_busy_seconds(),
            cpu_seconds(pid),
            own_cpu_seconds(pid),
            sum(cpu_seconds(g.pid) for g in gens),
        )

    # Each generator prints WINDOW_START, WINDOW_END, then its JSON line; read them in turn
    # (they start together, so the windows overlap by all but the start-up skew).
    lines = [iter(g.stdout) for g in gens]  # type: ignore[arg-type]
    for it in lines:
        for line in it:
            if line.startswith("WINDOW_START"):
                break
    sample0 = sample()
    ended = False
    for it in lines:
        for line in it:
            if line.startswith("WINDOW_END"):
                if not ended:
                    sample1 = sample()
                    ended = True
            elif line.startswith("{"):
                results.append(json.loads(line))
                break
    for g in gens:
        g.wait()
    split1 = frontend_split(server)
    if len(results) != len(gens):
        raise RuntimeError(f"a load generator failed: {server.label} {case} c={conc}")
    t = max(sample1[0] - sample0[0], 1e-9)
    rps = sum(r["rps"] for r in results)
    n = max(rps * t, 1.0)
    server_cpu = sample1[2] - sample0[2]
    device_cpu = sample1[3] - sample0[3]
    gen_cpu = sample1[4] - sample0[4]
    others = (sample1[1] - sample0[1]) - server_cpu - gen_cpu
    return {
        "rps": round(rps, 1),
        "p50_ms": max(r["p50_ms"] for r in results),
        "p99_ms": max(r["p99_ms"] for r in results),
        "errors": sum(sum(r.get("errors", {}).values()) for r in results),
        "cpu_ms": round(server_cpu / n * 1e3, 4),
        "device_cpu_ms": round(device_cpu / n * 1e3, 4),
        "server_cores": round(server_cpu / t, 3),
        "others_cores": round(max(0.0, others) / t, 3),
        "load": load_average(),
        "split": [round(b - a) for a, b in zip(split0, split1, strict=True)],
    }


def frontend_split(server: peers.Server) -> list[float]:
    """Requests each front end forwarded so far (empty for a server without front ends):
    SO_REUSEPORT places a connection by a hash of its addresses, so two connections land on
    one front end about half the time, and the table says which runs did."""
    if server.kind != "worker" or not server.metrics_port:
        return []
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("worker_frontend_requests_total{"):
            index = int(line.split('frontend_process="')[1].split('"')[0])
            counts[index] = float(line.rsplit(" ", 1)[1])
    return [counts[i] for i in sorted(counts)]


def measure(server: peers.Server, case: str, conc: int, procs: int, duration: float) -> dict:
    for _ in range(RETRIES + 1):
        result = measure_once(server, case, conc, procs, duration)
        if result["others_cores"] <= NOISY_CORES:
            return result
        print(f"  noisy: others used {result['others_cores']} cores, again", flush=True)
    result["noisy"] = True
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--points", default="identity16:1,identity16:32,identity224:8")
    p.add_argument("--frontends", default="1,2")
    p.add_argument("--no-kserve", action="store_true")
    p.add_argument("--build", default=str(peers.ROOT / "build" / "bench-peers"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    points = [(c.split(":")[0], int(c.split(":")[1])) for c in args.points.split(",")]
    repos = peers.build_repositories(pathlib.Path(args.build))
    servers: dict[str, list[peers.Server]] = {}
    for case in sorted({c for c, _ in points}):
        repo = repos[SHAPES[case][1]]
        row = [worker(f"N={n}", repo, n) for n in map(int, args.frontends.split(","))]
        if not args.no_kserve:
            row.append(peers.kserve_server(peers.ROOT / ".venv-kserve"))
        servers[case] = row
    table: dict[tuple[str, int, str], list[dict]] = {}
    try:
        for case, conc in points:
            row = servers[case]
            for server in row:
                server.wait_ready()
            for r in range(args.rounds):
                for server in row if r % 2 == 0 else list(reversed(row)):
                    res = measure(server, case, conc, args.procs, args.duration)
                    table.setdefault((case, conc, server.label), []).append(res)
                    print(f"{case} c={conc} {server.label} round {r}: {res}", flush=True)
    finally:
        for row in servers.values():
            for server in row:
                server.stop()
    summary = []
    for (case, conc, label), runs in table.items():
        med = {
            k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("noisy", "split")
        }
        med["splits"] = [r["split"] for r in runs]
        balanced = [
            r["rps"] for r in runs if r["split"] and min(r["split"]) > 0.2 * sum(r["split"])
        ]
        if balanced:  # runs whose connections landed on different front ends
            med["rps_balanced"] = statistics.median(balanced)
        med.update(case=case, concurrency=conc, server=label, rounds=len(runs))
        med["rps_range"] = [min(r["rps"] for r in runs), max(r["rps"] for r in runs)]
        summary.append(med)
        print(json.dumps(med))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
