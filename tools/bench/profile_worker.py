"""Where the worker's CPU goes under load: a py-spy profile of ``python -m kserve_trio worker``,
summarised as the frames with the largest self share and the share of each component.

The worker (the peers' bundles, ``peers.build_repositories``; ``--http2-engine`` as asked) runs
on CPU 0 and ``raw_load.py`` (raw ``grpc.aio``, closed loop, ``--concurrency`` calls in flight)
on CPU 1, as in ``engines.py``. Once the load's warm-up is over, ``py-spy record -r RATE -d
DURATION -f raw --threads --full-filenames -p PID`` samples the worker (idle threads left out,
py-spy's default), with the worker's CPU per request and req/s over the same window (both
raised a little by the sampling). Compiled code (ngh2's Cython, libnghttp2, numpy, XLA) has no
Python frame: its time is charged to the Python frame that called it (``Ngh2Engine.receive``
in ``kserve_trio/http2``) unless ``--native`` asks py-spy for the C frames too. The summary
charges each sample to its innermost frame:

- top frames: function and file, share of the samples (self time);
- components: the same samples grouped by where the innermost frame's file lives (HTTP/2
  engine, our gRPC layer, codec, worker, execution, event loop, ...; ``COMPONENTS``);
- threads: the samples of each thread (the event loop's, the device thread, ...).

The raw profile (one line per stack: ``frame;frame;... count``, flamegraph.pl reads it) and the
summary (``.md``, ready for docs/benchmarks.md) are written beside ``--out``; ``--summarise
FILE`` summarises an existing raw profile instead.

Usage: .venv/bin/python tools/bench/profile_worker.py [--engine ngh2|h2] [--concurrency 8]
           [--duration 8] [--rate 250] [--model identity] [--shape 1,16] [--top 25]
           [--native] [--out build/bench-profile/worker-ngh2-c8]
       .venv/bin/python tools/bench/profile_worker.py --summarise FILE.txt [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import peers  # noqa: E402
from engines import worker  # noqa: E402
from noise import cpu_seconds, load_average, machine_busy_seconds  # noqa: E402

ROOT, PY = peers.ROOT, peers.PY
PY_SPY = shutil.which("py-spy", path=str(pathlib.Path(PY).parent)) or "py-spy"

# component: substrings of the innermost frame's file, first match wins
COMPONENTS = [
    ("h2 + hpack + hyperframe (pure-Python HTTP/2)", ("/h2/", "/hpack/", "/hyperframe/")),
    ("ngh2 (libnghttp2 binding; native frames only with --native)", ("ngh2", "nghttp2")),
    ("HTTP/2 engine seam (kserve_trio/http2)", ("kserve_trio/http2/",)),
    ("our gRPC layer (serving/grpc)", ("kserve_trio/serving/grpc/",)),
    ("codec and wire (core/protocol/codec, infer_wire, grpc_wire)", ("kserve_trio/core/protocol/codec",
     "kserve_trio/core/protocol/infer_wire", "kserve_trio/core/protocol/grpc_wire", "kserve_trio/core/protocol/wire")),
    ("validation and request bounds", ("kserve_trio/worker/validation",
     "kserve_trio/core/protocol/request_bounds")),
    ("observer and metrics", ("kserve_trio/worker/observer", "kserve_trio/worker/metrics",
     "prometheus_client")),
    ("worker: scheduler, dispatch, model state, inference core", ("kserve_trio/worker/",)),
    ("execution (runtime, jax, XLA)", ("kserve_trio/runtime/", "/jax/", "/jaxlib/", "xla")),
    ("protobuf", ("/google/protobuf/",)),
    ("anyio", ("/anyio/",)),
    ("event loop (asyncio, uvloop)", ("/asyncio/", "/uvloop/")),
    ("threading and queues", ("/threading.py", "/queue.py", "/concurrent/")),
    ("other kserve_trio", ("kserve_trio/",)),
]  # fmt: skip
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")


def short_file(path: str) -> str:
    """``path`` from its package on (site-packages, the stdlib and this tree left out)."""
    for marker in ("site-packages/", "/lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker.startswith("/lib") and "/" in tail else tail
    root = str(ROOT) + "/"
    return path[len(root) :] if path.startswith(root) else path


def component(path: str) -> str:
    for name, needles in COMPONENTS:
        if any(n in path for n in needles):
            return name
    return "other (interpreter, numpy, stdlib)"


def summarise(raw: str, top: int) -> dict:
    """Self shares of a py-spy raw profile (module docstring)."""
    frames: collections.Counter[str] = collections.Counter()
    parts: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        items = stack.split(";")
        thread = items[0] if items[0].startswith("thread (") else ""
        if thread:
            items = items[1:]
            name = thread.split(":", 1)[1].strip() if ":" in thread else thread
            threads[name] += n
        if not items:
            continue
        m = _FRAME.match(items[-1])
        func, path = (m.group("func"), m.group("file")) if m else (items[-1], "")
        frames[f"{func} ({short_file(path)})"] += n
        parts[component(path)] += n
        total += n

    def shares(counter: collections.Counter[str], k: int | None = None) -> list[list]:
        return [[key, n, round(100 * n / max(total, 1), 1)] for key, n in counter.most_common(k)]

    return {
        "samples": total,
        "top_frames": shares(frames, top),
        "components": shares(parts),
        "threads": shares(threads),
    }


def markdown(summary: dict, header: str) -> str:
    lines = [header, "", f"{summary['samples']} samples (idle threads left out).", ""]
    for title, key in (("component", "components"), ("thread", "threads"), ("frame", "top_frames")):
        if not summary[key]:
            continue
        lines += [f"| {title} | samples | self share |", "|---|---|---|"]
        lines += [f"| {name} | {n} | {share}% |" for name, n, share in summary[key]]
        lines.append("")
    return "\n".join(lines)


def profile(args: argparse.Namespace, out: pathlib.Path) -> dict:
    repos = peers.build_repositories(pathlib.Path(args.build))
    repo = repos["r224" if args.shape.count(",") > 1 else "r16"]
    server = worker(f"worker {args.engine}", repo, args.engine)
    seconds = max(1, round(args.duration))  # py-spy takes whole seconds
    try:
        server.wait_ready()
        cmd = [
            *peers.pin(1), PY, str(BENCH / "raw_load.py"), "--url", server.url,
            "--model", args.model, "--input", "INPUT0", "--output", "OUTPUT0",
            "--shape", args.shape, "--concurrency", str(args.concurrency),
            "--duration", str(seconds + 2), "--warmup", "1", "--expect", args.model,
        ]  # fmt: skip
        gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert gen.stdout is not None
        pid = server.proc.pid
        for line in gen.stdout:
            if line.startswith("WINDOW_START"):
                break
        t0, busy0, cpu0 = time.monotonic(), machine_busy_seconds(), cpu_seconds(pid)
        gen0 = cpu_seconds(gen.pid)
        spy_cmd = [
            PY_SPY, "record", "-r", str(args.rate), "-d", str(seconds), "-f", "raw",
            "--threads", "--full-filenames", "-p", str(pid), "-o", str(out) + ".txt",
        ]  # fmt: skip
        if args.native:
            spy_cmd.append("--native")
        spy = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        spy_err = spy.communicate()[1].decode(errors="replace")
        t1, busy1, cpu1 = time.monotonic(), machine_busy_seconds(), cpu_seconds(pid)
        gen1 = cpu_seconds(gen.pid)
        result = next((json.loads(x) for x in gen.stdout if x.startswith("{")), None)
        gen.wait()
        if spy.returncode != 0 or result is None:
            raise RuntimeError(f"py-spy ({spy.returncode}): {spy_err.strip()[-500:]}")
    finally:
        server.stop()
    t = max(t1 - t0, 1e-9)
    served = result["rps"] * t
    others = (busy1 - busy0) - (cpu1 - cpu0) - (gen1 - gen0)
    return {
        "rps": result["rps"],
        "p50_ms": result["p50_ms"],
        "cpu_ms": round((cpu1 - cpu0) / max(served, 1) * 1e3, 3),
        "worker_cores": round((cpu1 - cpu0) / t, 2),
        "others_cores": round(max(0.0, others) / t, 3),
        "load": load_average(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("ngh2", "h2"), default="ngh2")
    p.add_argument("--model", choices=("identity", "sum"), default="identity")
    p.add_argument("--shape", default="1,16", help="1,16 or 1,3,224,224")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=int, default=8, help="seconds sampled")
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too")
    p.add_argument("--out", default="", help="PATH: writes PATH.txt (raw), .md and .json")
    p.add_argument("--build", default=str(ROOT / "build" / "bench-peers"))
    p.add_argument("--summarise", default="", help="a raw py-spy profile to summarise instead")
    args = p.parse_args()
    if args.summarise:
        summary = summarise(pathlib.Path(args.summarise).read_text(), args.top)
        print(markdown(summary, f"py-spy profile {args.summarise}"))
        return 0
    name = f"worker-{args.engine}-{args.model}-{args.shape.replace(',', 'x')}-c{args.concurrency}"
    out = pathlib.Path(args.out or ROOT / "build" / "bench-profile" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    window = profile(args, out)
    summary = summarise(pathlib.Path(str(out) + ".txt").read_text(), args.top)
    header = (
        f"`py-spy record -r {args.rate} -d {args.duration} -f raw{' --native' if args.native else ''}`"
        " on the worker "
        f"(`--http2-engine {args.engine}`, CPU 0) under `raw_load.py` (CPU 1), {args.model} "
        f"FP32 [{args.shape}] at c={args.concurrency}, {date}, commit {commit}: "
        f"{window['rps']:,.0f} req/s, p50 {window['p50_ms']:.2f} ms, worker CPU "
        f"{window['cpu_ms']:.3f} ms/req ({window['worker_cores']} cores) while profiled; other "
        f"processes {window['others_cores']} cores"
        + (" (NOISY: above 0.1, profile again)" if window["others_cores"] > 0.1 else "")
        + "."
    )
    text = markdown(summary, header)
    pathlib.Path(str(out) + ".md").write_text(text)
    doc = {"command": sys.argv, "commit": commit, "date": date, "window": window, **summary}
    pathlib.Path(str(out) + ".json").write_text(json.dumps(doc, indent=1))
    print(text)
    print(f"written: {out}.txt {out}.md {out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
