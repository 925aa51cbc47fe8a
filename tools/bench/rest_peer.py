"""kserve_trio's REST endpoint against KServe's Python model server's, side by side in one run.

Both serve an identity model over the KServe V2 REST protocol with Triton's binary extension:
kserve_trio a compiled identity bundle (tools/bench/gateway.py builds them), KServe
``tools/bench/kserve_peer.py`` from ``.venv-kserve`` (tools/bench/setup_kserve.sh). Cases:
[1,16] with JSON data both ways, [1,16] binary and [1,3,224,224] (0.6 MB) binary both ways, each
at concurrency 1 and 8.

The load generator (this file with ``--load``, its own process) keeps ``c`` keep-alive
connections, each with one request in flight, sending a request body built once by
tritonclient.http (``generate_request_body``) on raw asyncio streams, so the client costs as
little of the machine as possible. Before each measured level one reply is checked with
tritonclient.http's own reader (identity: equal values, shape and dtype). Reported per server:
req/s, p50 and p99 latency, and the server's CPU time per request (utime+stime of its process
from /proc over the measured window). Rounds alternate the servers' order.

With ``--gateway`` a gateway CLI (``listen.http``) in front of the same worker is measured too;
its CPU column is the gateway process's own. Each point applies the clean-run rule of noise.py
(others' CPU and the load average recorded, measured again while others used over 0.1 core).

Usage: python tools/bench/rest_peer.py [--duration 4] [--rounds 2] [--gateway] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
PY = sys.executable
KSERVE_PY = ROOT / ".venv-kserve" / "bin" / "python"
sys.path.insert(0, str(BENCH))

from gateway import build_repository  # noqa: E402  (the identity bundles)
from noise import Window, clean_point  # noqa: E402  (the clean-run rule)
from run import cpu_seconds, free_port  # noqa: E402

CASES = [  # name, shape, binary, concurrency
    ("[1,16] JSON", (1, 16), False, 1),
    ("[1,16] JSON", (1, 16), False, 8),
    ("[1,16] binary", (1, 16), True, 1),
    ("[1,16] binary", (1, 16), True, 8),
    ("[1,3,224,224] binary", (1, 3, 224, 224), True, 1),
    ("[1,3,224,224] binary", (1, 3, 224, 224), True, 8),
]


# ------------------------------------------------------------------------------ load generator


class _Reply:
    """httptools' callbacks: when the reply in flight is complete."""

    def __init__(self) -> None:
        self.done = False

    def on_message_complete(self) -> None:
        self.done = True


async def _conn(port: int, request: bytes, stop_at: float, lat: list[float]) -> int:
    """One keep-alive connection, one request in flight; replies parsed by httptools (KServe
    answers binary replies chunked, kserve_trio with a Content-Length)."""
    import httptools

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reply = _Reply()
    parser = httptools.HttpResponseParser(reply)
    errors = 0
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            reply.done = False
            while not reply.done:
                data = await reader.read(1 << 20)
                if not data:
                    raise ConnectionError("the server closed the connection")
                parser.feed_data(data)
            if parser.get_status_code() != 200:
                errors += 1
            lat.append(time.perf_counter() - t0)
    finally:
        writer.close()
    return errors


async def _load(port: int, path: str, body: bytes, header_length, conc: int, seconds: float):
    headers = [f"POST {path} HTTP/1.1", "Host: bench", f"Content-Length: {len(body)}"]
    if header_length is not None:
        headers.append("Content-Type: application/octet-stream")
        headers.append(f"Inference-Header-Content-Length: {header_length}")
    else:
        headers.append("Content-Type: application/json")
    request = ("\r\n".join(headers) + "\r\n\r\n").encode() + body
    warm: list[float] = []
    await asyncio.gather(
        *(_conn(port, request, time.perf_counter() + 1, warm) for _ in range(conc))
    )
    lat: list[float] = []
    print("WINDOW_START", flush=True)
    t0 = time.perf_counter()
    errors = await asyncio.gather(*(_conn(port, request, t0 + seconds, lat) for _ in range(conc)))
    wall = time.perf_counter() - t0
    print("WINDOW_END", flush=True)
    lat.sort()
    n = len(lat)
    return {
        "requests": n,
        "rps": n / wall,
        "p50_ms": lat[n // 2] * 1e3 if n else 0.0,
        "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3 if n else 0.0,
        "errors": sum(errors),
    }


def request_body(input_name: str, shape, binary: bool) -> tuple[bytes, int | None, np.ndarray]:
    import tritonclient.http as httpclient

    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    inp = httpclient.InferInput(input_name, list(shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    # With no outputs named tritonclient asks for every output binary (binary_data_output).
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        [inp], request_id="bench-1"
    )
    if not binary:  # the JSON case asks for JSON outputs
        doc = json.loads(body)
        doc.pop("parameters", None)
        body = json.dumps(doc)
    body = body.encode() if isinstance(body, str) else body
    return body, json_size, x


def check_reply(url: str, body: bytes, header_length, x: np.ndarray, output: str) -> None:
    """One request; the reply read by tritonclient.http must be the input."""
    import tritonclient.http as httpclient

    headers = {"Content-Type": "application/json"}
    if header_length is not None:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_length),
        }
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data, length = r.read(), r.headers.get("Inference-Header-Content-Length")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url} answered {exc.code}: {exc.read()[:300]!r}") from None
    result = httpclient.InferenceServerClient.parse_response_body(
        data, header_length=int(length) if length else None
    )
    got = result.as_numpy(output)
    assert got is not None and got.shape == x.shape and got.dtype == x.dtype, (got, x.shape)
    np.testing.assert_array_equal(got, x)


# ------------------------------------------------------------------------------------- driver


def start_rest_worker(repo: pathlib.Path, grpc_port: int, http_port: int) -> subprocess.Popen:
    """The CLI worker serving ``repo`` statically on ``grpc_port`` with REST on ``http_port``."""
    return subprocess.Popen(
        [
            PY, "-m", "kserve_trio", "worker", "--model-repo", str(repo),
            "--port", str(grpc_port), "--http-port", str(http_port),
            "--model-control-mode", "static", "--log-level", "warning",
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def wait_http(port: int, path: str, proc: subprocess.Popen, what: str, timeout=300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready on {port}")


def run_level(server: dict, case, duration: float, also: tuple[int, ...] = ()) -> dict:
    """One clean point (``noise.clean_point``): ``also`` are more pids under test (a worker
    behind the server measured), kept out of the others' CPU."""
    return clean_point(
        lambda: _run_level_once(server, case, duration, also),
        f"{case[0]} c={case[3]} {server['label']}",
    )


def _run_level_once(server: dict, case, duration: float, also: tuple[int, ...]) -> dict:
    name, shape, binary, conc = case
    body, header_length, x = request_body(server["input"], shape, binary)
    path = server["path"](shape)
    check_reply(
        f"http://127.0.0.1:{server['port']}{path}", body, header_length, x, server["output"]
    )
    body_file = pathlib.Path(f"/tmp/kserve_trio_rest_bench_{os.getpid()}.bin")
    body_file.write_bytes(body)
    cmd = [
        PY, __file__, "--load", str(server["port"]), path, str(body_file),
        "" if header_length is None else str(header_length), str(conc), str(duration),
    ]  # fmt: skip
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    pid = server["proc"].pid
    window = Window([*dict.fromkeys([pid, *also]), gen.pid])
    cpu0 = cpu1 = 0.0
    result = None
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            window.start()
            cpu0 = cpu_seconds(pid)
        elif line.startswith("WINDOW_END"):
            cpu1 = cpu_seconds(pid)
            window.stop()
        elif line.startswith("{"):
            result = json.loads(line)
    gen.wait()
    body_file.unlink(missing_ok=True)
    if result is None:
        raise RuntimeError(f"the load generator failed ({name} c={conc} on {server['label']})")
    result["server_cpu_us"] = (cpu1 - cpu0) / max(result["requests"], 1) * 1e6
    return window.record(result)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", nargs=6, metavar=("PORT", "PATH", "BODY", "HLEN", "C", "SECONDS"))
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="")
    p.add_argument(
        "--gateway",
        action="store_true",
        help="also measure kserve_trio's REST through a gateway in front of the same worker",
    )
    p.add_argument("--repo", default=str(ROOT / "build" / "bench-gateway-models"))
    args = p.parse_args()
    if args.load:
        port, path, body_file, hlen, conc, seconds = args.load
        body = pathlib.Path(body_file).read_bytes()
        out = asyncio.run(
            _load(int(port), path, body, int(hlen) if hlen else None, int(conc), float(seconds))
        )
        print(json.dumps(out), flush=True)
        return 0
    if not KSERVE_PY.exists():
        raise SystemExit("no .venv-kserve: run tools/bench/setup_kserve.sh first")
    repo = build_repository(pathlib.Path(args.repo))
    ours_port, ours_grpc, ks_http, ks_grpc = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    try:
        ours = start_rest_worker(repo, ours_grpc, ours_port)
        procs.append(ours)
        ks = subprocess.Popen(
            [
                str(KSERVE_PY), str(BENCH / "kserve_peer.py"), "--http_port", str(ks_http),
                "--grpc_port", str(ks_grpc), "--enable_latency_logging", "false",
            ],
            env={**os.environ, "KSERVE_LOGLEVEL": "WARNING"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(ks)
        wait_http(ours_port, "/v2/health/ready", ours, "kserve_trio worker")
        wait_http(ks_http, "/v2/health/ready", ks, "KServe model server")
        gw = None
        gw_http = free_port()
        if args.gateway:
            g = "KSERVE_TRIO_GATEWAY_"
            gw = subprocess.Popen(
                [PY, "-m", "kserve_trio", "gateway", "--log-level", "warning"],
                env={
                    **os.environ,
                    g + "WORKERS": f"127.0.0.1:{ours_grpc}",
                    g + "LISTEN_GRPC": f"127.0.0.1:{free_port()}",
                    g + "LISTEN_METRICS": f"127.0.0.1:{free_port()}",
                    g + "LISTEN_HTTP": f"127.0.0.1:{gw_http}",
                    g + "STARTUP_WAIT_SECONDS": "60",
                },
                stdout=subprocess.DEVNULL,
            )
            procs.append(gw)
            wait_http(gw_http, "/v2/health/ready", gw, "kserve_trio gateway")
        servers = [
            {
                "label": "kserve_trio",
                "proc": ours,
                "port": ours_port,
                "input": "input_0",
                "output": "output",
                "path": lambda s: (
                    f"/v2/models/{'identity16' if len(s) == 2 else 'identity224'}/infer"
                ),
            },
            {
                "label": "KServe",
                "proc": ks,
                "port": ks_http,
                "input": "INPUT0",
                "output": "OUTPUT0",
                "path": lambda s: "/v2/models/identity/infer",
            },
        ]
        if gw is not None:
            servers.append({**servers[0], "label": "gateway", "proc": gw, "port": gw_http})
        rows = []
        for case in CASES:
            runs: dict[str, list[dict]] = {s["label"]: [] for s in servers}
            for r in range(args.rounds):
                order = servers if r % 2 == 0 else servers[::-1]
                for server in order:
                    runs[server["label"]].append(run_level(server, case, args.duration))
            row = {"case": case[0], "concurrency": case[3]}
            for label, results in runs.items():
                row[label] = {
                    k: statistics.median(x[k] for x in results)
                    for k in ("rps", "p50_ms", "p99_ms", "server_cpu_us")
                }
                row[label]["errors"] = sum(x["errors"] for x in results)
            rows.append(row)
            print_row(row)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print()
    print(
        "| case | c | kserve_trio req/s | KServe req/s | kserve_trio p50 / p99 ms | KServe p50 / p99 ms | kserve_trio CPU us/req | KServe CPU us/req |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        a, b = row["kserve_trio"], row["KServe"]
        print(
            f"| {row['case']} | {row['concurrency']} | {a['rps']:,.0f} | {b['rps']:,.0f} | "
            f"{a['p50_ms']:.2f} / {a['p99_ms']:.2f} | {b['p50_ms']:.2f} / {b['p99_ms']:.2f} | "
            f"{a['server_cpu_us']:.0f} | {b['server_cpu_us']:.0f} |"
        )
    if args.gateway:
        print()
        print(
            "| case | c | direct req/s | via gateway req/s | direct p50 / p99 ms | via gateway p50 / p99 ms | gateway CPU us/req |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            a, g = row["kserve_trio"], row["gateway"]
            print(
                f"| {row['case']} | {row['concurrency']} | {a['rps']:,.0f} | {g['rps']:,.0f} | "
                f"{a['p50_ms']:.2f} / {a['p99_ms']:.2f} | {g['p50_ms']:.2f} / {g['p99_ms']:.2f} | "
                f"{g['server_cpu_us']:.0f} |"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def print_row(row: dict) -> None:
    parts = [f"{row['case']} c={row['concurrency']}:"]
    for label in [k for k in row if k not in ("case", "concurrency")]:
        r = row[label]
        parts.append(
            f"{label} {r['rps']:,.0f} req/s p50 {r['p50_ms']:.2f} ms cpu {r['server_cpu_us']:.0f} us"
            + (f" errors {r['errors']}" if r["errors"] else "")
        )
    print("  ".join(parts), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
