"""The HTTP/2 engines (issue 38, item 7) in one run: the floors, our echo server, the worker
against KServe, the gateway, the worker's front ends and TLS, each on ngh2 and on h2.

Groups (``--only`` takes their names; each group's servers run only while it is measured):

- ``floors``: the minimal gRPC echo on each engine, [1,16], c=1/8/32: ``ngh2_floor.py``
  (libnghttp2), ``h2_floor.py --lean`` (h2 with its header validation off, as issue 38's outside
  measurement ran it), ``h2_floor.py`` (h2 validating, as an engine must) and
  ``grpcio_floor.py`` (grpc.aio's C core);
- ``echo``: ``echo_server.py --http2-engine ngh2`` and ``h2`` (our gRPC layer and codec, no
  scheduler), [1,16], c=1/8/32;
- ``worker``: ``python -m kserve_trio worker --http2-engine ngh2`` and ``h2`` against KServe
  0.21's Python server (``kserve_peer.py`` from ``.venv-kserve``, set up by
  ``setup_kserve.sh``) on identity and sum FP32 [1,16] and identity FP32 [1,3,224,224], c=1/8/32
  (the peers' bundles, ``peers.build_repositories``, built once under ``--build``);
- ``gateway``: the gateway on ngh2 and on h2 in front of one worker on ngh2, identity [1,16] at
  c=1/8, and the same worker straight; reported: the gateway's added p50 at c=1 (through it
  minus straight, per round, median) and its own CPU per request (the worker's beside it);
- ``frontends``: the worker (ngh2) with ``--frontend-processes 1`` and ``2``, identity [1,16],
  c=1 (the target: p50 of 2 within 0.2 ms of 1);
- ``tls``: the worker with a throwaway CA's certificate (``server_layer.make_pki``, openssl) on
  each engine, identity [1,3,224,224], c=1/8.

Load: ``raw_load.py`` (a raw ``grpc.aio`` channel sending one pre-serialized ModelInfer, closed
loop, ``c`` calls in flight, reply checked before the load), one fresh process per point.
Placement on a machine with 2 or more CPUs: in ``floors``, ``echo``, ``worker`` and ``tls`` the
server runs on CPU 0 and the load on CPU 1 (``taskset``); in ``gateway`` and ``frontends``
nothing is pinned (two server processes on one core preempt each other on every hop, see
``gateway.py``). Rounds alternate the order of a group's servers; the table gives medians over
rounds.

Per point: req/s, p50/p99, the CPU per request (utime+stime over the measured window, from
/proc, of each measured server process and its descendants: for a gateway its own, then its
worker's) and the CPU every *other* process used (the machine's busy time from /proc/stat minus
this group's servers and the load generator: the rule of ``noise.py``, which ``quiet.py``
applies to a whole command). A point where others used more than ``noise.NOISY_CORES`` (0.10 of
a core) is measured again up to ``noise.RETRIES`` times and, if still above, marked ``noisy``
in the table and the JSON, so it can be re-run (``--only GROUP``). The targets of issue 38 are
checked at the end (no verdict on a noisy point).

Output: the points as they are measured, then a Markdown section (command, date, commit,
versions, placement, the table, the checks) ready for docs/benchmarks.md, written to
``--out`` (``.md``) with the JSON of every point (``.json``, rewritten after each group).

Usage: .venv/bin/python tools/bench/engines.py [--rounds 3] [--duration 4]
           [--only floors,echo,worker,gateway,frontends,tls] [--out build/bench-engines/run]
Smoke: .venv/bin/python tools/bench/engines.py --rounds 1 --duration 0.5 --warmup 0.3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402  (servers, bundles, KServe)
from gateway import wait_routed  # noqa: E402
from noise import (  # noqa: E402
    NOISY_CORES,
    RETRIES,
    cpu_seconds,
    load_average,
    machine_busy_seconds,
    read_window,
)
from server_layer import make_pki  # noqa: E402

ROOT, PY = peers.ROOT, peers.PY
ENGINES = ("ngh2", "h2")
SMALL, LARGE = "1,16", "1,3,224,224"
GROUPS = ("floors", "echo", "worker", "gateway", "frontends", "tls")
START_SECONDS = 1.0  # a load generator's start and its reply check, roughly, per point


@dataclass
class Point:
    """One server measured in a group: ``target`` takes the load; ``measured`` get a CPU per
    request figure each (the first is the row's own)."""

    group: str
    label: str
    target: peers.Server
    measured: list[peers.Server]
    model: str
    output: str
    shape: str
    concs: tuple[int, ...]
    expect: str = "identity"
    ca: str = ""
    load_cpu: int | None = 1  # None: not pinned


@dataclass
class Group:
    servers: list[peers.Server] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)
    ready: list[Callable[[], None]] = field(default_factory=list)  # after ServerReady
    ca: str = ""


# ------------------------------------------------------------------------------------ servers


def script(label: str, name: str, *flags: str) -> peers.Server:
    """A server script of this directory (a floor, the echo server) on CPU 0."""
    cmd = [PY, str(BENCH / name), "--port", str(peers.free_port()), *flags]
    return peers.Server(label, "floor", cmd, {"PYTHONPATH": str(ROOT)}, ROOT)


def worker(
    label: str,
    repo: pathlib.Path,
    engine: str,
    *extra: str,
    env: dict[str, str] | None = None,
    cpu: int | None = 0,
) -> peers.Server:
    port, metrics = peers.free_port(), peers.free_port()
    cmd = [
        PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo), "--port", str(port),
        "--metrics-port", str(metrics), "--model-control-mode", "static",
        "--log-level", "warning", "--log-format", "json", "--http2-engine", engine, *extra,
    ]  # fmt: skip
    env = {"PYTHONPATH": str(ROOT), **(env or {})}
    return peers.Server(label, "worker", cmd, env, ROOT, metrics, cpu=cpu)


def gateway(label: str, upstream: peers.Server, engine: str) -> tuple[peers.Server, int]:
    """A gateway on ``engine`` in front of ``upstream`` (not pinned), and its admin port."""
    port, admin = peers.free_port(), peers.free_port()
    g = "KSERVE_TRIO_GATEWAY_"
    env = {
        "PYTHONPATH": str(ROOT),
        g + "WORKERS": upstream.url,
        g + "LISTEN_GRPC": f"127.0.0.1:{port}",
        g + "LISTEN_METRICS": f"127.0.0.1:{admin}",
        g + "STARTUP_WAIT_SECONDS": "60",
    }
    cmd = [PY, "-m", "kserve_trio", "gateway", "--log-level", "warning", "--http2-engine", engine]
    return peers.Server(label, "gateway", cmd, env, ROOT, port=port, cpu=None), admin


def point(
    group: str, server: peers.Server, model: str, shape: str, concs: tuple[int, ...], **kw
) -> Point:
    """A ``Point`` on ``server`` (its own label and CPU unless ``label`` / ``measured`` say)."""
    kw.setdefault("label", server.label)
    kw.setdefault("measured", [server])
    kw.setdefault("output", "INPUT0" if model == "echo" else "OUTPUT0")
    return Point(group=group, target=server, model=model, shape=shape, concs=concs, **kw)


def build_group(name: str, args: argparse.Namespace, g: Group) -> None:
    """Start ``name``'s servers into ``g`` (module docstring) and say what to measure on them."""
    build = pathlib.Path(args.build)
    repos = peers.build_repositories(build) if name not in ("floors", "echo") else {}
    if name == "floors":
        g.servers += [
            script("ngh2 floor", "ngh2_floor.py"),
            script("h2 floor (lean)", "h2_floor.py", "--lean"),
            script("h2 floor (validating)", "h2_floor.py"),
            script("grpcio floor", "grpcio_floor.py"),
        ]
        g.points += [point("floor [1,16]", s, "echo", SMALL, (1, 8, 32)) for s in g.servers]
    elif name == "echo":
        for engine in ENGINES:
            g.servers.append(script(f"echo {engine}", "echo_server.py", "--http2-engine", engine))
        g.points += [point("echo [1,16]", s, "echo", SMALL, (1, 8, 32)) for s in g.servers]
    elif name == "worker":
        r16 = [worker(f"worker {e}", repos["r16"], e) for e in ENGINES]
        r224 = [worker(f"worker {e}", repos["r224"], e) for e in ENGINES]
        g.servers += r16 + r224
        if not args.no_kserve:  # one KServe serves both shapes
            kserve = peers.kserve_server(pathlib.Path(args.kserve_venv))
            kserve.label = "KServe 0.21"
            g.servers.append(kserve)
            r16, r224 = [*r16, kserve], [*r224, kserve]
        for group, model, servers, shape in (
            ("identity [1,16]", "identity", r16, SMALL),
            ("sum [1,16]", "sum", r16, SMALL),
            ("identity [1,3,224,224]", "identity", r224, LARGE),
        ):
            g.points += [point(group, s, model, shape, (1, 8, 32), expect=model) for s in servers]
    elif name == "gateway":
        w = worker("worker ngh2", repos["r16"], "ngh2", cpu=None)
        g.servers.append(w)
        label = "straight to worker ngh2"
        g.points.append(
            point("gateway [1,16]", w, "identity", SMALL, (1, 8), label=label, load_cpu=None)
        )
        for engine in ENGINES:
            gw, admin = gateway(f"gateway {engine} -> worker ngh2", w, engine)
            g.servers.append(gw)
            g.ready.append(lambda admin=admin: wait_routed(admin, "identity", 1))
            g.points.append(
                point(
                    "gateway [1,16]", gw, "identity", SMALL, (1, 8), measured=[gw, w], load_cpu=None
                )
            )
    elif name == "frontends":
        for n in (1, 2):
            label = f"worker ngh2, {n} front end{'s' if n > 1 else ''}"
            frontends = ("--frontend-processes", str(n))
            g.servers.append(worker(label, repos["r16"], "ngh2", *frontends, cpu=None))
        g.points += [
            point("front ends [1,16]", s, "identity", SMALL, (1,), load_cpu=None) for s in g.servers
        ]
    elif name == "tls":
        pki = make_pki(build / "pki")
        env = {
            "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE": str(pki / "server.pem"),
            "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE": str(pki / "server.key"),
        }
        g.ca = str(pki / "ca.pem")
        g.servers += [worker(f"worker {e} tls", repos["r224"], e, env=env) for e in ENGINES]
        group = "tls identity [1,3,224,224]"
        g.points += [point(group, s, "identity", LARGE, (1, 8), ca=g.ca) for s in g.servers]
    else:
        raise ValueError(name)


# ---------------------------------------------------------------------------------- measuring


def measure(p: Point, conc: int, args: argparse.Namespace, group_pids: list[int]) -> dict:
    """One clean point: measured again while others used over ``NOISY_CORES``."""
    result: dict = {}
    for attempt in range(RETRIES + 1):
        result = _once(p, conc, args, group_pids)
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


def _once(p: Point, conc: int, args: argparse.Namespace, group_pids: list[int]) -> dict:
    cmd = [
        *(peers.pin(p.load_cpu) if p.load_cpu is not None else []),
        PY, str(BENCH / "raw_load.py"), "--url", p.target.url, "--model", p.model,
        "--input", "INPUT0", "--output", p.output, "--shape", p.shape,
        "--concurrency", str(conc), "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--expect", p.expect,
    ]  # fmt: skip
    if p.ca:
        cmd += ["--ca", p.ca]
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    measured = [s.proc.pid for s in p.measured]
    siblings = [pid for pid in group_pids if pid not in measured]

    def sample() -> tuple[float, float, float, list[float], float]:
        return (
            time.monotonic(),
            machine_busy_seconds(),
            cpu_seconds(gen.pid),
            [cpu_seconds(pid) for pid in measured],
            sum(cpu_seconds(pid) for pid in siblings),
        )

    result, s0, s1 = read_window(gen.stdout, sample)
    gen.wait()
    if result is None:
        raise RuntimeError(f"the load generator failed: {p.group} {p.label} c={conc}")
    n = max(result["requests"], 1)
    t = max(s1[0] - s0[0], 1e-9)
    used = [b - a for a, b in zip(s0[3], s1[3], strict=True)]
    result["cpu_ms"] = [round(u / n * 1e3, 4) for u in used]
    result["siblings_cores"] = round((s1[4] - s0[4]) / t, 3)
    others = (s1[1] - s0[1]) - sum(used) - (s1[4] - s0[4]) - (s1[2] - s0[2])
    result["others_cores"] = round(max(0.0, others) / t, 3)
    result["load"] = load_average()
    return result


def run_group(name: str, args: argparse.Namespace, runs: dict) -> None:
    """Start the group's servers, measure every point ``--rounds`` times, stop them."""
    g = Group()
    try:
        build_group(name, args, g)
        for s in g.servers:
            s.wait_ready(ca=g.ca if any(p.ca and p.target is s for p in g.points) else "")
        for wait in g.ready:
            wait()
        pids = [s.proc.pid for s in g.servers]
        for r in range(args.rounds):
            for p in g.points if r % 2 == 0 else g.points[::-1]:
                for conc in p.concs:
                    res = measure(p, conc, args, pids)
                    res["round"] = r
                    runs.setdefault((name, p.group, p.label, conc), []).append(res)
                    cpu = " + ".join(f"{c:.3f}" for c in res["cpu_ms"])
                    print(
                        f"round {r + 1} {p.group} c={conc} {p.label}: {res['rps']} req/s "
                        f"p50 {res['p50_ms']} p99 {res['p99_ms']} ms cpu {cpu} ms/req "
                        f"others {res['others_cores']} load {res['load']}"
                        + (" NOISY" if res.get("noisy") else "")
                        + (f" errors {res['errors']}" if res["errors"] else ""),
                        flush=True,
                    )
    finally:
        for s in g.servers:
            s.stop()


# ------------------------------------------------------------------------------------ report


def summarize(runs: dict) -> list[dict]:
    med = statistics.median
    rows = []
    for (part, group, label, conc), results in runs.items():
        cpus = list(zip(*[x["cpu_ms"] for x in results], strict=True))
        rows.append(
            {
                "part": part,
                "group": group,
                "server": label,
                "c": conc,
                "rps": round(med(x["rps"] for x in results), 1),
                "p50_ms": round(med(x["p50_ms"] for x in results), 3),
                "p99_ms": round(med(x["p99_ms"] for x in results), 3),
                "cpu_ms": [round(med(c), 4) for c in cpus],
                "errors": sum(sum(x["errors"].values()) for x in results),
                "others_cores": max(x["others_cores"] for x in results),
                "remeasured": sum(x["attempts"] > 1 for x in results),
                "noisy": any(x.get("noisy") for x in results),
                "rounds": results,
            }
        )
    return rows


def checks(rows: list[dict], runs: dict) -> list[dict]:
    """Issue 38's targets (and the derived figures it asks for) from the rows."""
    by = {(r["group"], r["server"], r["c"]): r for r in rows}
    out: list[dict] = []

    def check(text: str, value: float, bound: float | None, used: list[dict], le: bool = True):
        noisy = any(r["noisy"] for r in used)
        if bound is None:
            verdict = ""
        elif noisy:
            verdict = "noisy, no verdict"
        else:
            verdict = "met" if (value <= bound if le else value >= bound) else "NOT met"
        out.append({"check": text, "value": round(value, 3), "bound": bound, "verdict": verdict})

    for floor in ("h2 floor (lean)", "h2 floor (validating)"):
        for engine in ENGINES:
            for c in (1, 8, 32):
                h2 = by.get(("floor [1,16]", floor, c))
                echo = by.get(("echo [1,16]", f"echo {engine}", c))
                if h2 and echo:
                    ratio = echo["cpu_ms"][0] / h2["cpu_ms"][0]
                    check(f"echo {engine} CPU/req / {floor}'s, c={c}", ratio, 0.5, [echo, h2])
        for other in ("ngh2 floor", "grpcio floor"):
            for c in (1, 8, 32):
                h2, o = by.get(("floor [1,16]", floor, c)), by.get(("floor [1,16]", other, c))
                if h2 and o:
                    ratio = o["cpu_ms"][0] / h2["cpu_ms"][0]
                    check(f"{other} CPU/req / {floor}'s, c={c}", ratio, None, [o, h2])
    for group in ("identity [1,16]", "sum [1,16]", "identity [1,3,224,224]"):
        for engine in ENGINES:
            for c in (1, 8, 32):
                ours, ks = by.get((group, f"worker {engine}", c)), by.get((group, "KServe 0.21", c))
                if not (ours and ks):
                    continue
                cpu = ours["cpu_ms"][0] / ks["cpu_ms"][0]
                if group.endswith("224,224]"):
                    check(
                        f"{group} worker {engine} CPU/req / KServe's, c={c}", cpu, 0.8, [ours, ks]
                    )
                    continue
                check(
                    f"{group} worker {engine} CPU/req / KServe's, c={c}",
                    cpu,
                    0.8 if c == 1 else 0.6,
                    [ours, ks],
                )
                check(
                    f"{group} worker {engine} req/s / KServe's, c={c}",
                    ours["rps"] / ks["rps"],
                    1.0 if c == 1 else 1.2,
                    [ours, ks],
                    le=False,
                )
                if c == 32:
                    check(
                        f"{group} worker {engine} p99 - KServe's p99 (ms), c=32",
                        ours["p99_ms"] - ks["p99_ms"],
                        0.0,
                        [ours, ks],
                    )
    straight = runs.get(("gateway", "gateway [1,16]", "straight to worker ngh2", 1))
    for engine in ENGINES:
        label = f"gateway {engine} -> worker ngh2"
        through = runs.get(("gateway", "gateway [1,16]", label, 1))
        if straight and through:
            direct = {x["round"]: x["p50_ms"] for x in straight}
            added = [x["p50_ms"] - direct[x["round"]] for x in through if x["round"] in direct]
            used = [
                by[("gateway [1,16]", "straight to worker ngh2", 1)],
                by[("gateway [1,16]", label, 1)],
            ]
            check(
                f"gateway {engine}: added p50 (ms), c=1 (per round, median)",
                statistics.median(added),
                None,
                used,
            )
        for c in (1, 8):
            row = by.get(("gateway [1,16]", label, c))
            if row:
                check(
                    f"gateway {engine}: its own CPU/req (ms), c={c}", row["cpu_ms"][0], None, [row]
                )
    one = by.get(("front ends [1,16]", "worker ngh2, 1 front end", 1))
    two = by.get(("front ends [1,16]", "worker ngh2, 2 front ends", 1))
    if one and two:
        check(
            "front ends: p50 with 2 - p50 with 1 (ms), c=1",
            two["p50_ms"] - one["p50_ms"],
            0.2,
            [one, two],
        )
    return out


def versions(parts: list[str], kserve_venv: str) -> dict[str, str]:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    out["cpus"] = str(os.cpu_count())
    for dist in ("ngh2", "h2", "grpcio", "uvloop", "anyio", "protobuf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    if "worker" in parts and (pathlib.Path(kserve_venv) / "bin" / "python").exists():
        code = "import importlib.metadata as m; print(m.version('kserve'))"
        kpy = str(pathlib.Path(kserve_venv) / "bin" / "python")
        out["kserve"] = subprocess.run(
            [kpy, "-c", code], capture_output=True, text=True
        ).stdout.strip()
    return out


def markdown(doc: dict) -> str:
    v = doc["versions"]
    rows, checks_ = doc["rows"], doc["checks"]
    remeasured = sum(r["remeasured"] for r in rows)
    noisy = [r for r in rows if r["noisy"]]
    lines = [
        f"Command: `{doc['command']}`",
        "",
        f"{doc['start']}-{doc['end'][11:]} UTC, commit {doc['commit']}, {v['cpus']} CPUs "
        f"({v['machine']}, Python {v['python']}, ngh2 {v['ngh2']}, h2 {v['h2']}, grpcio "
        f"{v['grpcio']}, uvloop {v['uvloop']}, anyio {v['anyio']}"
        + (f", kserve {v['kserve']}" if "kserve" in v else "")
        + f"), load average {doc['load_before']} before the run. Medians of {doc['rounds']} "
        f"round{'s' if doc['rounds'] != 1 else ''}, {doc['duration']:g} s windows after {doc['warmup']:g} s of warm-up. Load: "
        "`raw_load.py` in its own process; floors, echo, worker and TLS: server on CPU 0, load "
        'on CPU 1; gateway and front ends: nothing pinned. "CPU ms/req": the server process\'s '
        "utime+stime (with its descendants) per request; for a gateway its own, then its "
        "worker's. Last column: the CPU every other process used over the window (maximum over "
        f"the rounds); {remeasured} measurements were taken again above {NOISY_CORES} of a core, "
        f"{len(noisy)} rows stayed above and are marked noisy.",
        "",
        "| group | server | c | req/s | p50 ms | p99 ms | CPU ms/req | others' cores (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = " + ".join(f"{c:.3f}" for c in r["cpu_ms"])
        lines.append(
            f"| {r['group']} | {r['server']} | {r['c']} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {cpu} | {r['others_cores']:.3f}"
            f"{' noisy' if r['noisy'] else ''}"
            f"{' errors ' + str(r['errors']) if r['errors'] else ''} |"
        )
    if checks_:
        lines += ["", "| check | value | target | verdict |", "|---|---|---|---|"]
        for c in checks_:
            bound = "" if c["bound"] is None else f"{c['bound']:g}"
            lines.append(f"| {c['check']} | {c['value']:.3f} | {bound} | {c['verdict']} |")
    if noisy:
        lines += [
            "",
            "Noisy rows (re-run with `--only` the part named): "
            + "; ".join(f"{r['part']}: {r['group']} {r['server']} c={r['c']}" for r in noisy),
        ]
    return "\n".join(lines) + "\n"


def estimate(parts: list[str], args: argparse.Namespace) -> float:
    per_round = {
        "floors": 12,
        "echo": 6,
        "worker": 18 + (0 if args.no_kserve else 9),
        "gateway": 6,
        "frontends": 2,
        "tls": 4,
    }
    points = sum(per_round[p] for p in parts) * args.rounds
    return points * (args.duration + args.warmup + START_SECONDS) + 15 * len(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(GROUPS), help=",".join(GROUPS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per point")
    p.add_argument("--out", default="", help="PATH: writes PATH.json and PATH.md")
    p.add_argument("--build", default=str(ROOT / "build" / "bench-peers"))
    p.add_argument("--no-kserve", action="store_true")
    p.add_argument("--kserve-venv", default=str(ROOT / ".venv-kserve"))
    args = p.parse_args()
    parts = [x for x in args.only.split(",") if x]
    unknown = [x for x in parts if x not in GROUPS]
    if unknown:
        p.error(f"unknown groups {unknown}; known: {', '.join(GROUPS)}")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = pathlib.Path(args.out or ROOT / "build" / "bench-engines" / f"engines-{stamp}")
    out.parent.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    doc: dict = {
        "command": shlex.join([".venv/bin/python", "tools/bench/engines.py", *sys.argv[1:]]),
        "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout else ""),
        "start": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_before": load_average(),
        "rounds": args.rounds,
        "duration": args.duration,
        "warmup": args.warmup,
        "versions": versions(parts, args.kserve_venv),
    }
    print(f"{len(parts)} groups, about {estimate(parts, args) / 60:.0f} min", flush=True)
    runs: dict = {}

    def write() -> None:
        doc["end"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        doc["rows"] = summarize(runs)
        doc["checks"] = checks(doc["rows"], runs)
        pathlib.Path(f"{out}.json").write_text(json.dumps(doc, indent=1))

    for part in parts:
        run_group(part, args, runs)
        write()
    text = markdown(doc)
    pathlib.Path(f"{out}.md").write_text(text)
    print("\n" + text)
    print(f"written: {out.with_suffix('.md')} {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
