"""What tracing costs the worker (the tracing issue, item 9): CPU per request at identity FP32
[1,16], c=1 and c=8, on four servers built from two trees.

- ``baseline``: the tree before tracing (commit ``BASELINE``, a ``git worktree`` made under
  ``--build``/baseline when absent, run with its own ``PYTHONPATH`` and working directory);
- ``off``: this tree, ``tracing.level`` off (the default), with the ``tracing`` extra
  (OpenTelemetry) installed in the environment;
- ``rate100``: this tree, ``--trace-level timestamps --trace-rate 100``;
- ``rate1``: the same, ``--trace-rate 1`` (every request traced).

The traced servers export OTLP/HTTP to a sink started here (this script's ``--serve-sink``, its
own process beside the load on CPU 1): it answers 200 to ``POST /v1/traces`` and counts requests
and bytes without decoding them. Its CPU is not the worker's; it is reported beside the point.

Each server is ``python -m kserve_trio worker`` on the peers' identity bundle on [n,16]
(``peers.build_repositories``, under ``build/bench-peers/r16``), static control mode, pinned to
CPU 0; the load is ``raw_load.py`` (a raw ``grpc.aio`` channel, closed loop, ``c`` calls in
flight) on CPU 1, one process per point, as ``engines.py`` runs them. Rounds alternate the
servers' order; the table gives medians over rounds.

Per point: req/s, p50/p99, the worker's CPU per request (utime+stime of its process and its
descendants over the measured window, ``noise.cpu_seconds``), the sink's CPU and the posts it
took, and the CPU every other process used (``noise.py``'s rule: a point above
``noise.NOISY_CORES`` is measured again up to ``noise.RETRIES`` times, then marked noisy).

Verdicts: ``off`` within 2% of ``baseline`` (its CPU per request at most 1.02 times the
baseline's) per c; the cost of ``rate1`` (and ``rate100``) over ``off`` stated per c.

Usage: .venv/bin/python tools/bench/tracing.py [--rounds 3] [--duration 4] [--warmup 1]
           [--json build/bench-tracing/tracing.json]
Smoke: .venv/bin/python tools/bench/tracing.py --rounds 1 --duration 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402  (servers, bundles, pinning)
from noise import (  # noqa: E402
    NOISY_CORES,
    RETRIES,
    cpu_seconds,
    load_average,
    machine_busy_seconds,
    read_window,
)

ROOT, PY = peers.ROOT, peers.PY
BASELINE = "e469341"  # the tree before the tracing issue
SERVERS = ("baseline", "off", "rate100", "rate1")
CONCS = (1, 8)
SHAPE = "1,16"
OFF_BOUND = 1.02  # off's CPU per request over the baseline's, at most
START_SECONDS = 1.0  # a load generator's start and its reply check, roughly, per point


# --------------------------------------------------------------------------------------- sink


class _SinkHandler(BaseHTTPRequestHandler):
    """``POST /v1/traces``: read the body, count it, answer 200; ``GET /count``: the counts."""

    protocol_version = "HTTP/1.1"  # keep-alive: the exporter reuses its connection
    posts = 0
    received = 0

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        cls = type(self)
        cls.posts += 1
        cls.received += n
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        body = json.dumps({"posts": self.posts, "bytes": self.received}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_sink(port: int) -> None:
    """The OTLP/HTTP sink (module docstring), until terminated."""
    ThreadingHTTPServer(("127.0.0.1", port), _SinkHandler).serve_forever()


@dataclass
class Sink:
    """The sink's process (on CPU 1 beside the load) and its port."""

    proc: subprocess.Popen
    port: int

    @classmethod
    def start(cls) -> Sink:
        port = peers.free_port()
        cmd = [*peers.pin(1), PY, str(pathlib.Path(__file__).resolve()), "--serve-sink", str(port)]
        sink = cls(subprocess.Popen(cmd), port)
        deadline = time.monotonic() + 30
        while True:
            try:
                sink.counts()
                return sink
            except OSError:
                if sink.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the OTLP sink did not start") from None
                time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def counts(self) -> tuple[int, int]:
        """Posts and bytes received so far."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/count", timeout=5) as r:
            got = json.loads(r.read())
        return got["posts"], got["bytes"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------------ servers


def baseline_tree(build: pathlib.Path) -> pathlib.Path:
    """A worktree of ``BASELINE`` under ``build``, added when absent."""
    tree = build / "baseline"
    if not (tree / "kserve_trio").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "prune"], check=True)
        subprocess.run([*git, "add", "--detach", str(tree), BASELINE], check=True)
    return tree


def worker(label: str, repo: pathlib.Path, tree: pathlib.Path, *extra: str) -> peers.Server:
    """``python -m kserve_trio worker`` from ``tree`` on CPU 0."""
    port, metrics = peers.free_port(), peers.free_port()
    cmd = [
        PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(port),
        "--metrics-port", str(metrics), "--model-control-mode", "static",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    return peers.Server(label, "worker", cmd, {"PYTHONPATH": str(tree)}, tree, metrics)


def start_servers(args: argparse.Namespace, sink: Sink, servers: dict[str, peers.Server]) -> None:
    """The four servers (module docstring) into ``servers``, each as soon as it is started."""
    repo = peers.build_repositories(pathlib.Path(args.peers_build))["r16"]
    base = baseline_tree(pathlib.Path(args.build))
    traced = ("--trace-level", "timestamps", "--trace-endpoint", sink.endpoint)
    servers["baseline"] = worker("baseline", repo, base)
    servers["off"] = worker("off", repo, ROOT)
    servers["rate100"] = worker("rate100", repo, ROOT, *traced, "--trace-rate", "100")
    servers["rate1"] = worker("rate1", repo, ROOT, *traced, "--trace-rate", "1")


# ---------------------------------------------------------------------------------- measuring


def measure(
    server: peers.Server, conc: int, args: argparse.Namespace, sink: Sink, pids: list[int]
) -> dict:
    """One clean point: measured again while others used over ``NOISY_CORES``."""
    result: dict = {}
    for attempt in range(RETRIES + 1):
        result = _once(server, conc, args, sink, pids)
        result["attempts"] = attempt + 1
        if result["others_cores"] <= NOISY_CORES:
            return result
        print(
            f"  noisy: others used {result['others_cores']} cores (load {result['load']}), "
            "measuring again",
            flush=True,
        )
    result["noisy"] = True
    return result


def _once(
    server: peers.Server, conc: int, args: argparse.Namespace, sink: Sink, pids: list[int]
) -> dict:
    cmd = [
        *peers.pin(1), PY, str(BENCH / "raw_load.py"), "--url", server.url, "--model", "identity",
        "--input", "INPUT0", "--output", "OUTPUT0", "--shape", SHAPE,
        "--concurrency", str(conc), "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--expect", "identity",
    ]  # fmt: skip
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    siblings = [pid for pid in pids if pid != server.proc.pid]  # the other workers
    sink_pid = sink.proc.pid

    def sample() -> tuple[float, float, float, float, float, float, tuple[int, int]]:
        return (
            time.monotonic(),
            machine_busy_seconds(),
            cpu_seconds(gen.pid),
            cpu_seconds(server.proc.pid),
            sum(cpu_seconds(pid) for pid in siblings),
            cpu_seconds(sink_pid),
            sink.counts(),
        )

    result, s0, s1 = read_window(gen.stdout, sample)
    gen.wait()
    if result is None:
        raise RuntimeError(f"the load generator failed: {server.label} c={conc}")
    n = max(result["requests"], 1)
    t = max(s1[0] - s0[0], 1e-9)
    gen_cpu, own, sib, sink_cpu = (s1[i] - s0[i] for i in (2, 3, 4, 5))
    result["cpu_us"] = round(own / n * 1e6, 1)
    result["sink_cores"] = round(sink_cpu / t, 3)
    result["sink_posts"] = s1[6][0] - s0[6][0]
    result["sink_bytes"] = s1[6][1] - s0[6][1]
    others = (s1[1] - s0[1]) - own - sib - sink_cpu - gen_cpu
    result["others_cores"] = round(max(0.0, others) / t, 3)
    result["load"] = load_average()
    return result


def run(args: argparse.Namespace, runs: dict[tuple[str, int], list[dict]]) -> None:
    """Start the sink and the servers, measure every point ``--rounds`` times, stop them."""
    sink = Sink.start()
    servers: dict[str, peers.Server] = {}
    try:
        start_servers(args, sink, servers)
        for s in servers.values():
            s.wait_ready()
        pids = [s.proc.pid for s in servers.values()]
        for r in range(args.rounds):
            for name in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                for conc in CONCS:
                    res = measure(servers[name], conc, args, sink, pids)
                    res["round"] = r
                    runs.setdefault((name, conc), []).append(res)
                    print(
                        f"round {r + 1} c={conc} {name}: {res['rps']} req/s p50 {res['p50_ms']} "
                        f"p99 {res['p99_ms']} ms cpu {res['cpu_us']} us/req sink "
                        f"{res['sink_posts']} posts {res['sink_bytes'] / 1e3:.1f} kB "
                        f"{res['sink_cores']} cores others {res['others_cores']} "
                        f"load {res['load']}"
                        + (" NOISY" if res.get("noisy") else "")
                        + (f" errors {res['errors']}" if res["errors"] else ""),
                        flush=True,
                    )
    finally:
        for s in servers.values():
            s.stop()
        sink.stop()


# ------------------------------------------------------------------------------------ report


def summarize(runs: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """One row per server and c: medians over rounds, CPU per request also over the baseline's."""
    med = statistics.median
    rows = []
    for conc in CONCS:
        for name in SERVERS:
            results = runs.get((name, conc))
            if not results:
                continue
            rows.append(
                {
                    "server": name,
                    "c": conc,
                    "cpu_us": round(med(x["cpu_us"] for x in results), 1),
                    "rps": round(med(x["rps"] for x in results), 1),
                    "p50_ms": round(med(x["p50_ms"] for x in results), 3),
                    "p99_ms": round(med(x["p99_ms"] for x in results), 3),
                    "sink_posts": med(x["sink_posts"] for x in results),
                    "sink_cores": round(med(x["sink_cores"] for x in results), 3),
                    "errors": sum(sum(x["errors"].values()) for x in results),
                    "others_cores": max(x["others_cores"] for x in results),
                    "remeasured": sum(x["attempts"] > 1 for x in results),
                    "noisy": any(x.get("noisy") for x in results),
                    "rounds": results,
                }
            )
    by = {(r["server"], r["c"]): r for r in rows}
    for r in rows:
        base = by.get(("baseline", r["c"]))
        r["vs_baseline"] = round(r["cpu_us"] / base["cpu_us"], 3) if base else None
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Off within 2% of the baseline, and what tracing on costs over off, per c."""
    by = {(r["server"], r["c"]): r for r in rows}
    out = []
    for conc in CONCS:
        base, off = by.get(("baseline", conc)), by.get(("off", conc))
        if base and off:
            ratio = off["cpu_us"] / base["cpu_us"]
            noisy = (
                " (a noisy point: re-run before trusting it)"
                if base["noisy"] or off["noisy"]
                else ""
            )
            out.append(
                f"off within 2% of baseline, c={conc}: {'yes' if ratio <= OFF_BOUND else 'no'} "
                f"({off['cpu_us']:.1f} vs {base['cpu_us']:.1f} us/req, x{ratio:.3f}){noisy}"
            )
        for name in ("rate100", "rate1"):
            on = by.get((name, conc))
            if off and on:
                cost = on["cpu_us"] - off["cpu_us"]
                out.append(
                    f"{name} costs {cost:+.1f} us/req over off, c={conc} "
                    f"({cost / off['cpu_us']:+.1%}; {on['cpu_us']:.1f} us/req)"
                    + (" (noisy)" if on["noisy"] or off["noisy"] else "")
                )
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| server | c | CPU us/req | / baseline | req/s | p50 ms | p99 ms | sink cores | "
        "others' cores (max) | noisy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}"
        lines.append(
            f"| {r['server']} | {r['c']} | {r['cpu_us']:.1f} | {ratio} | {r['rps']:,.0f} | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['sink_cores']:.3f} | "
            f"{r['others_cores']:.3f} | {'noisy' if r['noisy'] else ''}"
            f"{' errors ' + str(r['errors']) if r['errors'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per point")
    p.add_argument("--json", default="", help="where the points go (default under --build)")
    p.add_argument("--build", default=str(ROOT / "build" / "bench-tracing"))
    p.add_argument("--peers-build", default=str(ROOT / "build" / "bench-peers"))
    p.add_argument("--serve-sink", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_sink:
        serve_sink(args.serve_sink)
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = pathlib.Path(args.json or pathlib.Path(args.build) / f"tracing-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    points = len(SERVERS) * len(CONCS) * args.rounds
    minutes = points * (args.duration + args.warmup + START_SECONDS) / 60
    print(f"{points} points, about {minutes:.0f} min", flush=True)
    doc: dict = {
        "command": shlex.join([".venv/bin/python", "tools/bench/tracing.py", *sys.argv[1:]]),
        "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout else ""),
        "baseline": BASELINE,
        "start": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_before": load_average(),
        "rounds": args.rounds,
        "duration": args.duration,
        "warmup": args.warmup,
        "pinned": peers.PINNED,
    }
    runs: dict[tuple[str, int], list[dict]] = {}
    run(args, runs)
    doc["end"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    doc["rows"] = summarize(runs)
    doc["verdicts"] = verdicts(doc["rows"])
    out.write_text(json.dumps(doc, indent=1))
    print(
        f"\nCommand: `{doc['command']}` at {doc['commit']} against {BASELINE}; medians of "
        f"{args.rounds} round{'s' if args.rounds != 1 else ''}, {args.duration:g} s windows; "
        f"workers on CPU 0, load and sink on CPU 1{'' if peers.PINNED else ' (not pinned)'}.\n"
    )
    print(markdown(doc["rows"]))
    print("\n".join(doc["verdicts"]))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
