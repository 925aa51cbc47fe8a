"""What the gateway costs: the same load against a worker directly and through the gateway,
side by side in one run, plus the echo server (the floor of our gRPC stack) in the same run.

Cases (identity bundles, f32, built once into ``--repo``): [1,16] at concurrency 1 and 32,
[1,3,224,224] (0.6 MB) at 1, and [1,2621440] (10 MiB) at 1. For each case the load generator
(tools/bench/loadgen.py: tritonclient's aio client, closed loop, its own process) runs against
the worker, then against the gateway in front of that worker, ``--rounds`` times alternately.
Reported: p50/p99 of each path, the added latency (gateway minus direct, per round, then the
median over rounds), and CPU time per request of the gateway and of the worker (utime+stime of
every thread from /proc over the measured window). Each point applies the clean-run rule of
tools/bench/noise.py (others' CPU and the load average over the window; a point where others used
over ``NOISY_CORES`` is measured again, and reported as noisy, and a check on a noisy point gives
no verdict).

Placement: with 3 or more CPUs the worker, the gateway and the load generator each get their
own CPU (``taskset``); with fewer, nothing is pinned and the kernel places the three processes
(pinning two of them to one CPU measured worse: the pair preempt each other on every hop).

Targets checked: added p50 at c=1 on [1,16] <= the echo server's p50; added p50 on the 0.6 MB
and 10 MiB tensors <= 0.5x the direct call's p50; gateway CPU per request <= the worker's at
c=1 and c=32 on [1,16].

``--scaling``: instead, the gateway's processes (``processes: N``): two workers behind the
gateway, [1,16] at c=32 from two load-generator processes (two client connections, c=16
each: the kernel spreads connections, not requests, over the gateway's processes), the gateway
with ``--processes 1`` and then ``--processes 2``, ``--rounds`` times alternately. Reported per
N: p50/p99 (the larger of the two generators'), req/s (their sum) and the CPU time per request
of the whole gateway (the parent and its children).

Usage: python tools/bench/gateway.py [--duration 4] [--rounds 2] [--json FILE] [--scaling]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
sys.path.insert(0, str(BENCH))

from noise import Window, clean_point  # noqa: E402
from run import cpu_seconds, free_port  # noqa: E402  (the hot-path bench's helpers)

MODELS = {  # name: (example shape, compiled batch sizes)
    "identity16": ((1, 16), [1, 8, 32]),
    "identity224": ((1, 3, 224, 224), [1]),
    "identity10m": ((1, 2621440), [1]),
}
CASES = [  # name, model, shape, concurrency
    ("[1,16] c=1", "identity16", "1,16", 1),
    ("[1,16] c=32", "identity16", "1,16", 32),
    ("[1,3,224,224] c=1", "identity224", "1,3,224,224", 1),
    ("10 MiB c=1", "identity10m", "1,2621440", 1),
]


def build_repository(path: pathlib.Path) -> pathlib.Path:
    marker = path / ".complete"
    if marker.exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name, (shape, sizes) in MODELS.items():
        code = (
            "import numpy as np, sys\n"
            "from kserve_trio.export import export_bundle\n"
            f"export_bundle('jax', lambda x: x, np.zeros({shape!r}, np.float32), [],"
            f" dir=sys.argv[1], batch_sizes={sizes!r})\n"
        )
        subprocess.run([PY, "-c", code, str(path / name)], check=True)
    marker.write_text("ok")
    return path


def pin(cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 300.0) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if client.is_server_ready():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready")


def start(cmd: list[str], env: dict[str, str], url: str, what: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    wait_ready(url, proc, what)
    return proc


def load(
    url: str, model: str, shape: str, conc: int, duration: float, cpu, pids, under_test=()
) -> dict:
    """One clean point (``noise.clean_point``) of ``_load_once``.

    ``pids`` (name: pid) get a CPU-per-request figure; they, ``under_test`` and the load
    generator are not "others" in the noise window.
    """
    return clean_point(
        lambda: _load_once(url, model, shape, conc, duration, cpu, pids, under_test),
        f"{model} c={conc} on {url}",
    )


def _load_once(url, model, shape, conc, duration, cpu, pids, under_test) -> dict:
    output = "input_0" if model == "echo" else "output"
    cmd = [
        *pin(cpu), PY, str(BENCH / "loadgen.py"), "--url", url, "--model", model,
        "--shape", shape, "--output-shape", shape, "--output", output,
        "--concurrency", str(conc), "--duration", str(duration), "--warmup", "1",
    ]  # fmt: skip
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    window = Window([*pids.values(), *under_test, gen.pid])
    cpu0: dict[str, float] = {}
    result = None
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            window.start()
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        elif line.startswith("{"):
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            window.stop()
            result = json.loads(line)
    gen.wait()
    if result is None:
        raise RuntimeError(f"the load generator failed ({model} c={conc} on {url})")
    n = max(result["requests"], 1)
    for k in pids:
        result[f"{k}_cpu_ms"] = (cpu1[k] - cpu0[k]) / n * 1e3
    return window.record(result)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a gateway's parent and its children)."""
    parents: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        one = todo.pop()
        out.append(one)
        todo.extend(parents.get(one, []))
    return out


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for one in process_tree(pid):
        try:
            total += cpu_seconds(one)
        except OSError:
            continue
    return total


def _split_load_once(url, model, shape, conc, duration, generators, gateway_pid, others) -> dict:
    """``generators`` load-generator processes of ``conc // generators`` each, one window."""
    cmd = [
        PY, str(BENCH / "loadgen.py"), "--url", url, "--model", model, "--shape", shape,
        "--output-shape", shape, "--concurrency", str(conc // generators),
        "--duration", str(duration), "--warmup", "1",
    ]  # fmt: skip
    gens = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(generators)]
    window = Window([*process_tree(gateway_pid), *others, *(g.pid for g in gens)])
    results = []
    for gen in gens:  # each prints WINDOW_START after the same warm-up
        assert gen.stdout is not None
        for line in gen.stdout:
            if line.startswith("WINDOW_START"):
                break
    window.start()
    cpu0 = tree_cpu_seconds(gateway_pid)
    workers0 = sum(tree_cpu_seconds(pid) for pid in others)
    for gen in gens:
        assert gen.stdout is not None
        results.extend(json.loads(line) for line in gen.stdout if line.startswith("{"))
    cpu1 = tree_cpu_seconds(gateway_pid)
    workers1 = sum(tree_cpu_seconds(pid) for pid in others)
    window.stop()
    for gen in gens:
        gen.wait()
    if len(results) != generators:
        raise RuntimeError(f"a load generator failed ({model} c={conc} on {url})")
    requests = sum(r["requests"] for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return window.record(
        {
            "requests": requests,
            "rps": sum(r["rps"] for r in results),
            "p50_ms": max(r["p50_ms"] for r in results),
            "p99_ms": max(r["p99_ms"] for r in results),
            "errors": errors,
            "gateway_cpu_ms": (cpu1 - cpu0) / max(requests, 1) * 1e3,
            "gateway_cores": (cpu1 - cpu0) / duration,
            "workers_cores": (workers1 - workers0) / duration,
        }
    )


def wait_routed(metrics_port: int, model: str, replicas: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            url = f"http://127.0.0.1:{metrics_port}/routing"
            doc = json.loads(urllib.request.urlopen(url, timeout=5).read())
            if len(doc["models"].get(model, [])) >= replicas:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the gateway does not route {model} to {replicas} workers")


def scaling(args, repo: pathlib.Path) -> int:
    """``--scaling`` (module docstring): gateway N=1 against N=2 in front of two workers."""
    model, shape, conc, generators = "identity16", "1,16", 32, 2
    wports = [free_port(), free_port()]
    workers: list[subprocess.Popen] = []
    rows: dict[int, list[dict]] = {1: [], 2: []}
    g = "KSERVE_TRIO_GATEWAY_"
    try:
        for port in wports:
            argv = [
                PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(port),
                "--model-control-mode", "static", "--log-level", "warning",
            ]  # fmt: skip
            workers.append(start(argv, {}, f"127.0.0.1:{port}", "worker"))
        for _ in range(args.rounds):
            for n in (1, 2):
                gport, gmetrics = free_port(), free_port()
                gurl = f"127.0.0.1:{gport}"
                argv = [
                    PY, "-m", "kserve_trio", "gateway", "--log-level", "warning",
                    "--processes", str(n),
                ]  # fmt: skip
                gateway = start(
                    argv,
                    {
                        g + "WORKERS": ",".join(f"127.0.0.1:{p}" for p in wports),
                        g + "LISTEN_GRPC": gurl,
                        g + "LISTEN_METRICS": f"127.0.0.1:{gmetrics}",
                        g + "STARTUP_WAIT_SECONDS": "60",
                    },
                    gurl,
                    f"gateway (processes={n})",
                )
                try:
                    wait_routed(gmetrics, model, len(wports))
                    pids = [w.pid for w in workers]
                    measure = functools.partial(
                        _split_load_once, gurl, model, shape, conc, args.duration, generators,
                        gateway.pid, pids,
                    )  # fmt: skip
                    point = clean_point(measure, f"processes={n}")
                finally:
                    gateway.terminate()
                    gateway.wait(30)
                rows[n].append(point)
                print(
                    f"processes={n}: p50 {point['p50_ms']:.3f} ms, p99 {point['p99_ms']:.3f} ms, "
                    f"{point['rps']:.0f} req/s, gateway CPU {point['gateway_cpu_ms']:.3f} ms/req"
                    + (f", errors {point['errors']}" if point["errors"] else "")
                    + (" NOISY" if point.get("noisy") else ""),
                    flush=True,
                )
    finally:
        for proc in workers:
            proc.terminate()
            proc.wait(15)
    med = statistics.median
    summary = {
        n: {
            "p50_ms": med(r["p50_ms"] for r in rs),
            "p99_ms": med(r["p99_ms"] for r in rs),
            "rps": med(r["rps"] for r in rs),
            "gateway_cpu_ms": med(r["gateway_cpu_ms"] for r in rs),
            "gateway_cores": med(r["gateway_cores"] for r in rs),
            "workers_cores": med(r["workers_cores"] for r in rs),
            "noisy": any(r.get("noisy") for r in rs),
        }
        for n, rs in rows.items()
    }
    print(
        "\n| gateway processes | p50 / p99 ms | req/s | gateway CPU ms/req | gateway cores "
        "| workers' cores |\n|---|---|---|---|---|---|"
    )
    for n, r in summary.items():
        print(
            f"| {n} | {r['p50_ms']:.3f} / {r['p99_ms']:.3f} | {r['rps']:.0f} | "
            f"{r['gateway_cpu_ms']:.3f}{' (noisy)' if r['noisy'] else ''} | "
            f"{r['gateway_cores']:.2f} | {r['workers_cores']:.2f} |"
        )
    print(f"\nreq/s N=2 / N=1: {summary[2]['rps'] / max(summary[1]['rps'], 1e-9):.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"scaling": summary}, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="")
    p.add_argument("--repo", default=str(ROOT / "build" / "bench-gateway-models"))
    p.add_argument(
        "--scaling",
        action="store_true",
        help="gateway --processes 1 against 2, two workers, [1,16] c=32, two generators",
    )
    args = p.parse_args()
    repo = build_repository(pathlib.Path(args.repo))
    if args.scaling:
        return scaling(args, repo)
    ncpu = os.cpu_count() or 1
    cpus = (0, 1, 2) if ncpu >= 3 else (None, None, None)
    worker_cpu, gateway_cpu, load_cpu = cpus
    wport, gport, gmetrics, eport = free_port(), free_port(), free_port(), free_port()
    wurl, gurl, eurl = (f"127.0.0.1:{x}" for x in (wport, gport, eport))
    procs: list[subprocess.Popen] = []
    try:
        echo = start(
            [*pin(worker_cpu), PY, str(BENCH / "echo_server.py"), "--port", str(eport)],
            {}, eurl, "echo server",
        )  # fmt: skip
        procs.append(echo)
        r = load(eurl, "echo", "1,16", 1, args.duration, load_cpu, {}, (echo.pid,))
        echo_p50 = r["p50_ms"]
        echo_noise = {"others_cores": r["others_cores"], "noisy": bool(r.get("noisy"))}
        print(
            f"echo server p50 {echo_p50:.3f} ms, others {r['others_cores']:.3f} cores, "
            f"load {r['load']}" + (" NOISY" if r.get("noisy") else ""),
            flush=True,
        )
        echo.terminate()
        echo.wait(15)
        worker = start(
            [
                *pin(worker_cpu), PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo),
                "--port", str(wport), "--model-control-mode", "static", "--log-level", "warning",
            ],
            {}, wurl, "worker",
        )  # fmt: skip
        procs.append(worker)
        g = "KSERVE_TRIO_GATEWAY_"
        gateway = start(
            [*pin(gateway_cpu), PY, "-m", "kserve_trio", "gateway", "--log-level", "warning"],
            {
                g + "WORKERS": wurl,
                g + "LISTEN_GRPC": gurl,
                g + "LISTEN_METRICS": f"127.0.0.1:{gmetrics}",
                g + "STARTUP_WAIT_SECONDS": "60",
            },
            gurl,
            "gateway",
        )
        procs.append(gateway)
        pids = {"worker": worker.pid, "gateway": gateway.pid}
        rows = []
        for name, model, shape, conc in CASES:
            runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
            for _ in range(args.rounds):
                runs["direct"].append(load(wurl, model, shape, conc, args.duration, load_cpu, pids))
                runs["gateway"].append(
                    load(gurl, model, shape, conc, args.duration, load_cpu, pids)
                )
            rows.append(summarize(name, conc, runs))
            print_row(rows[-1])
        text = urllib.request.urlopen(f"http://127.0.0.1:{gmetrics}/metrics").read().decode()
        errors = [
            ln
            for ln in text.splitlines()
            if ln.startswith("gateway_requests_total") and 'status="OK"' not in ln
        ]
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    report(rows, echo_p50, errors, echo_noise)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"echo_p50_ms": echo_p50, "echo": echo_noise, "cases": rows}, indent=1)
        )
    return 0


def summarize(name: str, conc: int, runs: dict[str, list[dict]]) -> dict:
    med = statistics.median
    d, g = runs["direct"], runs["gateway"]
    return {
        "case": name,
        "concurrency": conc,
        "direct_p50_ms": med(r["p50_ms"] for r in d),
        "direct_p99_ms": med(r["p99_ms"] for r in d),
        "gateway_p50_ms": med(r["p50_ms"] for r in g),
        "gateway_p99_ms": med(r["p99_ms"] for r in g),
        "added_p50_ms": med(b["p50_ms"] - a["p50_ms"] for a, b in zip(d, g, strict=True)),
        "added_p99_ms": med(b["p99_ms"] - a["p99_ms"] for a, b in zip(d, g, strict=True)),
        "direct_rps": med(r["rps"] for r in d),
        "gateway_rps": med(r["rps"] for r in g),
        "worker_cpu_ms": med(r["worker_cpu_ms"] for r in g),
        "gateway_cpu_ms": med(r["gateway_cpu_ms"] for r in g),
        "worker_cpu_ms_direct": med(r["worker_cpu_ms"] for r in d),
        "errors": [r["errors"] for r in (*d, *g) if r["errors"]],
        "others_cores": max(r["others_cores"] for r in (*d, *g)),
        "noisy": any(r.get("noisy") for r in (*d, *g)),
    }


HEADER = (
    "| case | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 / p99 ms | "
    "req/s direct / gateway | gateway CPU ms/req | worker CPU ms/req | others' cores (max) |\n"
    "|---|---|---|---|---|---|---|---|"
)


def print_row(r: dict) -> None:
    if r is None:
        return
    print(
        f"| {r['case']} | {r['direct_p50_ms']:.3f} / {r['direct_p99_ms']:.3f} | "
        f"{r['gateway_p50_ms']:.3f} / {r['gateway_p99_ms']:.3f} | "
        f"{r['added_p50_ms']:+.3f} / {r['added_p99_ms']:+.3f} | "
        f"{r['direct_rps']:.0f} / {r['gateway_rps']:.0f} | {r['gateway_cpu_ms']:.3f} | "
        f"{r['worker_cpu_ms']:.3f} | {r['others_cores']:.3f}{' noisy' if r['noisy'] else ''} |",
        flush=True,
    )
    if r["errors"]:
        print(f"  errors: {r['errors']}", flush=True)


def report(rows: list[dict], echo_p50: float, errors: list[str], echo_noise: dict) -> None:
    print()
    print(HEADER)
    for r in rows:
        print_row(r)
    print(
        f"\necho server p50 ([1,16], c=1), same run: {echo_p50:.3f} ms"
        + (" (noisy)" if echo_noise["noisy"] else "")
    )
    by = {r["case"]: r for r in rows}
    small1, small32 = by["[1,16] c=1"], by["[1,16] c=32"]
    mid, big = by["[1,3,224,224] c=1"], by["10 MiB c=1"]
    checks = [  # text, value, bound, measured on a noisy point
        (
            "added p50 at c=1 on [1,16] <= echo p50",
            small1["added_p50_ms"],
            echo_p50,
            small1["noisy"] or echo_noise["noisy"],
        ),
        (
            "added p50 on [1,3,224,224] <= 0.5x direct p50",
            mid["added_p50_ms"],
            0.5 * mid["direct_p50_ms"],
            mid["noisy"],
        ),
        (
            "added p50 on 10 MiB <= 0.5x direct p50",
            big["added_p50_ms"],
            0.5 * big["direct_p50_ms"],
            big["noisy"],
        ),
        (
            "gateway CPU/req <= worker's at c=1",
            small1["gateway_cpu_ms"],
            small1["worker_cpu_ms"],
            small1["noisy"],
        ),
        (
            "gateway CPU/req <= worker's at c=32",
            small32["gateway_cpu_ms"],
            small32["worker_cpu_ms"],
            small32["noisy"],
        ),
    ]
    for text, value, bound, noisy in checks:
        verdict = "noisy, no verdict" if noisy else "met" if value <= bound else "NOT met"
        print(f"- {text}: {value:.3f} vs {bound:.3f} -> {verdict}")
    if errors:
        print("gateway non-OK requests:", *errors, sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
