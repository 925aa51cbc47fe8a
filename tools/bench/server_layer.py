"""Our gRPC server layer against the raw h2 floor and against the landed tree, in one run.

Servers (each in its own process; ``--base TREE`` is a ``git worktree`` of the commit to
compare with, run from the same interpreter):

- ``h2 floor``: ``h2_floor.py``, asyncio + h2 and nothing else;
- ``echo`` / ``echo@base``: ``echo_server.py`` of each tree (the server layer and our codec,
  no scheduler);
- ``worker`` / ``worker@base``: the CLI worker of each tree on identity bundles ([n,16] and
  [n,3,224,224]); ``worker tls`` / ``worker tls@base``: the same with TLS on its port;
- ``gateway`` / ``gateway@base``: each tree's gateway in front of that tree's worker.

Load: ``raw_load.py`` (raw ``grpc.aio``, one pre-serialized request, closed loop, ``c`` calls in
flight), one process per point, with ``peers.py``'s clean-run rule: per point the CPU used by
every process other than the ones measured and the load generator is recorded, and a point
where others used more than 0.1 of a core is measured again, then reported as noisy. CPU per
request is utime+stime of the measured processes over the window (for a gateway: the gateway's
own, and the worker's beside it). Rounds alternate the order of the servers.

Reported per point: req/s, p50/p99, CPU ms per request, others' cores. Derived: echo / floor
CPU ratio at each concurrency, the gateway's added p50 at c=1 (gateway minus direct worker, same
tree, same round) and its CPU per request, TLS CPU per request against the base.

Usage: python tools/bench/server_layer.py --base /tmp/base [--rounds 2] [--duration 3]
           [--parts echo,worker,gateway,tls] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))

from peers import (  # noqa: E402  (the peer benchmark's servers and clean-run helpers)
    NOISY_CORES,
    PY,
    RETRIES,
    Server,
    build_repositories,
    cpu_seconds,
    echo_server,
    floor_server,
    free_port,
    load_average,
    machine_busy_seconds,
    pin,
    worker_server,
)

SMALL, LARGE = "1,16", "1,3,224,224"


def make_pki(d: pathlib.Path) -> pathlib.Path:
    """A throwaway CA and a server certificate for 127.0.0.1 (``openssl``)."""
    d.mkdir(parents=True, exist_ok=True)
    if (d / "server.pem").exists():
        return d

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", *key, "-keyout", "ca.key", "-subj", "/CN=bench ca", "-x509", "-out", "ca.pem",
        "-days", "2", "-addext", "basicConstraints=critical,CA:TRUE")  # fmt: skip
    run("req", *key, "-keyout", "server.key", "-subj", "/CN=127.0.0.1", "-out", "server.csr")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext")  # fmt: skip
    return d


def gateway_server(label: str, worker: Server, tree: pathlib.Path) -> Server:
    port, metrics = free_port(), free_port()
    g = "KSERVE_TRIO_GATEWAY_"
    env = {
        "PYTHONPATH": str(tree),
        g + "WORKERS": worker.url,
        g + "LISTEN_GRPC": f"127.0.0.1:{port}",
        g + "LISTEN_METRICS": f"127.0.0.1:{metrics}",
        g + "LOGGING_LEVEL": "warning",
    }
    cmd = [PY, "-m", "kserve_trio", "gateway"]
    return Server(label, "gateway", cmd, env, tree, port=port)


def point(
    target: Server,
    measured: list[Server],
    model: str,
    shape: str,
    conc: int,
    duration: float,
    ca: str = "",
) -> dict:
    """One clean point (the module docstring's rule)."""
    for _ in range(RETRIES + 1):
        result = _once(target, measured, model, shape, conc, duration, ca)
        if result["others_cores"] <= NOISY_CORES:
            return result
        print(f"  noisy: others {result['others_cores']} cores, again", flush=True)
    result["noisy"] = True
    return result


def _once(target, measured, model, shape, conc, duration, ca) -> dict:
    output = "INPUT0" if model == "echo" else "OUTPUT0"
    cmd = [
        *pin(1), PY, str(BENCH / "raw_load.py"), "--url", target.url, "--model", model,
        "--input", "INPUT0", "--output", output, "--shape", shape, "--concurrency", str(conc),
        "--duration", str(duration), "--warmup", "1", "--expect", "identity",
    ]  # fmt: skip
    if ca:
        cmd += ["--ca", ca]
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    pids = [s.proc.pid for s in measured]
    c0 = c1 = [0.0] * len(pids)
    g0 = g1 = b0 = b1 = t0 = t1 = 0.0
    result = None
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            t0, b0, g0 = time.monotonic(), machine_busy_seconds(), cpu_seconds(gen.pid)
            c0 = [cpu_seconds(p) for p in pids]
        elif line.startswith("WINDOW_END"):
            c1 = [cpu_seconds(p) for p in pids]
            t1, b1, g1 = time.monotonic(), machine_busy_seconds(), cpu_seconds(gen.pid)
        elif line.startswith("{"):
            result = json.loads(line)
    gen.wait()
    if result is None:
        raise RuntimeError(f"load failed: {target.label} {shape} c={conc}")
    n = max(result["requests"], 1)
    used = [b - a for a, b in zip(c0, c1, strict=True)]
    result["cpu_ms"] = [round(u / n * 1e3, 4) for u in used]
    others = (b1 - b0) - sum(used) - (g1 - g0)
    result["others_cores"] = round(max(0.0, others) / max(t1 - t0, 1e-9), 3)
    result["load"] = load_average()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="a worktree of the commit to compare with")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--parts", default="echo,worker,gateway,tls")
    p.add_argument("--build", default=str(ROOT / "build" / "bench-peers"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    base = pathlib.Path(args.base).resolve()
    repos = build_repositories(pathlib.Path(args.build))
    pki = make_pki(pathlib.Path(args.build) / "pki")
    tls_env = {
        "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE": str(pki / "server.pem"),
        "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE": str(pki / "server.key"),
    }
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    base_commit = subprocess.run(
        ["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    servers: list[Server] = []
    # (group, label, target, measured, model, shape, concurrencies, ca)
    plan: list[tuple[str, str, Server, list[Server], str, str, tuple[int, ...], str]] = []
    try:
        if "echo" in parts:
            floor = floor_server()
            echo = echo_server("echo", ROOT, {})
            echo_base = echo_server(f"echo@{base_commit}", base, {})
            servers += [floor, echo, echo_base]
            for s in (floor, echo, echo_base):
                plan.append(("echo [1,16]", s.label, s, [s], "echo", SMALL, (1, 8, 32), ""))
            for s in (echo, echo_base):
                plan.append(("echo [1,3,224,224]", s.label, s, [s], "echo", LARGE, (1, 8), ""))
        if parts & {"worker", "gateway"}:
            w16 = worker_server("worker", repos["r16"], ROOT, {})
            w16b = worker_server(f"worker@{base_commit}", repos["r16"], base, {})
            w224 = worker_server("worker", repos["r224"], ROOT, {})
            w224b = worker_server(f"worker@{base_commit}", repos["r224"], base, {})
            servers += [w16, w16b, w224, w224b]
            if "worker" in parts:
                for s in (w16, w16b):
                    plan.append(
                        ("worker [1,16]", s.label, s, [s], "identity", SMALL, (1, 8, 32), "")
                    )
                for s in (w224, w224b):
                    plan.append(
                        ("worker [1,3,224,224]", s.label, s, [s], "identity", LARGE, (1, 8, 32), "")
                    )
            if "gateway" in parts:
                for s in (w16, w16b):
                    s.wait_ready()
                g = gateway_server("gateway", w16, ROOT)
                gb = gateway_server(f"gateway@{base_commit}", w16b, base)
                servers += [g, gb]
                for gw, w in ((g, w16), (gb, w16b)):
                    plan.append(
                        ("gateway [1,16]", gw.label, gw, [gw, w], "identity", SMALL, (1, 8, 32), "")
                    )
                    plan.append(
                        ("gateway [1,16]", "direct " + w.label, w, [w], "identity", SMALL, (1,), "")
                    )
        if "tls" in parts:
            t = worker_server("worker tls", repos["r224"], ROOT, tls_env)
            tb = worker_server(f"worker tls@{base_commit}", repos["r224"], base, tls_env)
            servers += [t, tb]
            for s in (t, tb):
                plan.append(
                    (
                        "tls [1,3,224,224]",
                        s.label,
                        s,
                        [s],
                        "identity",
                        LARGE,
                        (1, 8),
                        str(pki / "ca.pem"),
                    )
                )
        tls_servers = {id(t[2]) for t in plan if t[7]}
        for s in servers:
            s.wait_ready(ca=str(pki / "ca.pem") if id(s) in tls_servers else "")
        runs: dict[tuple[str, str, int], list[dict]] = {}
        for r in range(args.rounds):
            order = plan if r % 2 == 0 else plan[::-1]
            for group, label, target, measured, model, shape, concs, ca in order:
                for conc in concs:
                    res = point(target, measured, model, shape, conc, args.duration, ca)
                    runs.setdefault((group, label, conc), []).append(res)
                    print(
                        f"round {r + 1} {group} c={conc} {label}: {res['rps']} req/s p50 "
                        f"{res['p50_ms']} p99 {res['p99_ms']} ms cpu {res['cpu_ms']} ms/req "
                        f"others {res['others_cores']} load {res['load']}"
                        + (" NOISY" if res.get("noisy") else "")
                        + (f" errors {res['errors']}" if res["errors"] else ""),
                        flush=True,
                    )
    finally:
        for s in servers:
            s.stop()
    rows = []
    for (group, label, conc), results in runs.items():
        cpus = list(zip(*[x["cpu_ms"] for x in results], strict=True))
        rows.append(
            {
                "group": group,
                "server": label,
                "c": conc,
                "rps": statistics.median(x["rps"] for x in results),
                "p50_ms": statistics.median(x["p50_ms"] for x in results),
                "p99_ms": statistics.median(x["p99_ms"] for x in results),
                "cpu_ms": [round(statistics.median(c), 4) for c in cpus],
                "others_cores": max(x["others_cores"] for x in results),
                "noisy": any(x.get("noisy") for x in results),
            }
        )
    print(
        f"\n# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit {commit} "
        f"(base {base_commit}), medians of {args.rounds} rounds, {args.duration:g} s windows"
    )
    print("| group | server | c | req/s | p50 ms | p99 ms | CPU ms/req | others' cores (max) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cpu = " + ".join(f"{c:.3f}" for c in row["cpu_ms"])
        print(
            f"| {row['group']} | {row['server']} | {row['c']} | {row['rps']:,.0f} | "
            f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {cpu} | "
            f"{row['others_cores']:.3f}{' noisy' if row['noisy'] else ''} |"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
