"""Our client's CPU per request against tritonclient's, the clean-run way.

``python -m kserve_trio bench`` (``mlp`` batch 1, inline, closed loop) with ``--client
kserve_trio`` on each HTTP/2 engine (``--http2-engine ngh2`` and ``h2``) and ``--client
tritonclient``, at c=1, 8 and 32, one fresh process per (client, concurrency) pinned to
CPU 1, against one worker on CPU 0 serving ``build/bench-peers/r16`` (``tools/bench/peers.py``
builds it), 3 rounds. Over each process's run the CPU every other process used is recorded
(machine busy time minus the worker and the client); a point above ``NOISY_CORES`` is measured
again, up to twice. Prints one line per point, then a Markdown table of medians.

``--repository build/bench-peers/r224 --model identity`` measures a [1,3,224,224] tensor
instead; ``--shm`` adds our client's shared-memory transport (the streaming driver's path:
tensors through system shared memory, items per second) beside the inline one.

Usage: python tools/bench/client_vs_tritonclient.py [--repository DIR --model M] [--shm]
           [--levels 1,8,32]
"""

import argparse
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tritonclient.grpc as grpcclient
from noise import NOISY_CORES, cpu_seconds, machine_busy_seconds

ROOT = pathlib.Path(__file__).resolve().parents[2]
PORT = 18961
PY = sys.executable
_args = argparse.ArgumentParser(description="our client against tritonclient")
_args.add_argument("--repository", default="build/bench-peers/r16")
_args.add_argument("--model", default="mlp")
_args.add_argument("--shm", action="store_true", help="also our client over shared memory")
_args.add_argument("--levels", default="1,8,32")
ARGS = _args.parse_args()
LEVELS = [int(level) for level in ARGS.levels.split(",")]
CLIENTS = ["kserve_trio-ngh2", "kserve_trio-h2", "tritonclient"]
if ARGS.shm:
    CLIENTS += ["kserve_trio-ngh2-shm", "kserve_trio-h2-shm"]
w = subprocess.Popen(
    [
        "taskset",
        "-c",
        "0",
        PY,
        "-m",
        "kserve_trio",
        "worker",
        "--model-repo",
        ARGS.repository,
        "--port",
        str(PORT),
        "--model-control-mode",
        "static",
        "--log-level",
        "warning",
    ],
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)
c = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT}")
while True:
    try:
        if c.is_server_ready():
            break
    except Exception:
        pass
    time.sleep(0.3)
rows = {}
try:
    for r in range(3):
        for client in CLIENTS:
            library, _, rest = client.partition("-")
            engine, _, transport = rest.partition("-")
            flags = ["--http2-engine", engine] if engine else []
            flags += ["--transport", transport or "inline"]
            for conc in LEVELS:
                for _ in range(3):  # the first try and two re-measurements
                    out = f"{tempfile.gettempdir()}/client_vs_tritonclient_{client}_{conc}_{r}.json"
                    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    b0, w0, t0 = machine_busy_seconds(), cpu_seconds(w.pid), time.monotonic()
                    subprocess.run(
                        [
                            "taskset",
                            "-c",
                            "1",
                            PY,
                            "-m",
                            "kserve_trio",
                            "bench",
                            "--url",
                            f"127.0.0.1:{PORT}",
                            "--model",
                            ARGS.model,
                            "--batch",
                            "1",
                            "--concurrency",
                            str(conc),
                            "--duration",
                            "5",
                            "--warmup",
                            "1",
                            "--client",
                            library,
                            *flags,
                            "--no-progress",
                            "--json",
                            out,
                        ],
                        cwd=ROOT,
                        stdout=subprocess.DEVNULL,
                        check=True,
                    )
                    b1, w1, t1 = machine_busy_seconds(), cpu_seconds(w.pid), time.monotonic()
                    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                    gen = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
                    others = max(0.0, (b1 - b0) - (w1 - w0) - gen) / (t1 - t0)
                    lvl = json.load(open(out))["levels"][0]
                    res = (lvl["cpu_per_request_us"], lvl["requests_per_s"], round(others, 3))
                    print(r, client, conc, res, flush=True)
                    if others <= NOISY_CORES:
                        break
                rows.setdefault((client, conc), []).append(res)
finally:
    w.terminate()
    w.wait()
for (client, conc), v in sorted(rows.items()):
    cpu = [x[0] for x in v]
    print(
        f"| {client} | c={conc} | {statistics.median(cpu):.0f} [{min(cpu):.0f}-{max(cpu):.0f}] | rps {statistics.median(x[1] for x in v):.0f} | others max {max(x[2] for x in v):.3f} |"
    )
