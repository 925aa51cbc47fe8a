"""REST through the gateway: forwarding to the worker's REST port against translating to gRPC.

One worker (gRPC and REST ports) and two gateway CLIs in front of it, in one run: ``forward``
has ``KSERVE_TRIO_GATEWAY_WORKER_HTTP_ENDPOINTS`` (REST requests go to the worker's REST port as
they came), ``translate`` has none (each REST request is translated to a ModelInfer and sent over
gRPC). The worker's own REST port is measured too (``direct``). Cases, load generator and CPU
accounting are tools/bench/rest_peer.py's: identity [1,16] JSON and binary, [1,3,224,224]
binary, c=1 and 8, rounds alternating the servers' order; CPU is the measured process's own
(the gateway's for the gateway rows).

``--clients`` instead measures HTTP clients for the forwarding (the project's own
``serving.http.HttpClient``, httpx, h11 on an anyio stream, and aiohttp, the former choice, when
it is installed: it is no longer a dependency) against the project's own HTTP server answering
with the request body: client CPU and wall time per sequential keep-alive POST, 200 B and 0.6 MB.

Each point (a level, or a client's timed run) applies the clean-run rule of tools/bench/noise.py
(others' CPU and the load average over the window, sampled at the load generator's
``WINDOW_START``/``WINDOW_END`` lines; a point where others used over ``NOISY_CORES`` is measured
again, and reported as noisy).

Usage: python tools/bench/rest_forward.py [--duration 3] [--rounds 2] [--json FILE]
       python tools/bench/rest_forward.py --clients [--requests 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
PY = sys.executable
sys.path.insert(0, str(BENCH))

from gateway import build_repository  # noqa: E402  (the identity bundles)
from noise import Window, clean_point  # noqa: E402
from rest_peer import CASES, run_level, start_rest_worker, wait_http  # noqa: E402
from run import free_port  # noqa: E402

G = "KSERVE_TRIO_GATEWAY_"


# --------------------------------------------------------------------------- client candidates


def _echo_server(port: int) -> None:
    import anyio

    from kserve_trio.serving.http import HttpResponse, serve_app

    async def app(request):
        return HttpResponse(200, request.body or b"{}", "application/json")

    async def main() -> None:
        await serve_app("127.0.0.1", port, app, max_body_bytes=1 << 30)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})


def _client_run(name: str, port: int, n: int, size: int) -> tuple[float, float]:
    import anyio

    body = b"x" * size
    url = f"http://127.0.0.1:{port}/v2/models/m/infer"
    headers = {"content-type": "application/json", "inference-header-content-length": "5"}
    items = list(headers.items())

    async def timed(one) -> tuple[float, float]:
        for _ in range(100):
            await one()
        print("WINDOW_START", flush=True)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            await one()
        out = (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n
        print("WINDOW_END", flush=True)
        return out

    async def with_ours():
        from kserve_trio.serving.http import HttpClient

        async with HttpClient(per_host=1) as client:

            async def one():
                r = await client.request(
                    "127.0.0.1", port, "POST", "/v2/models/m/infer", headers=items, body=body
                )
                return r.status, r.headers, r.body

            return await timed(one)

    async def with_aiohttp():
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        skip = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
        async with aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=skip
        ) as s:

            async def one():
                async with s.post(url, data=body, headers=headers) as r:
                    return r.status, r.raw_headers, await r.read()

            return await timed(one)

    async def with_httpx():
        import httpx

        async with httpx.AsyncClient() as s:

            async def one():
                r = await s.post(url, content=body, headers=headers)
                return r.status_code, r.headers, r.content

            return await timed(one)

    async def with_h11():
        import h11

        stream = await anyio.connect_tcp("127.0.0.1", port)
        conn = h11.Connection(h11.CLIENT)
        head = [("host", "w"), ("content-length", str(len(body))), *headers.items()]

        async def one():
            request = h11.Request(method="POST", target="/v2/models/m/infer", headers=head)
            await stream.send(
                conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            )
            parts, status = [], 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive(1 << 20))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            conn.start_next_cycle()
            return status, b"".join(parts)

        return await timed(one)

    fn = {"ours": with_ours, "aiohttp": with_aiohttp, "httpx": with_httpx, "h11": with_h11}[name]
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": True})


def _window_run(cmd: list[str], pids: list[int]) -> tuple[Window, str]:
    """Run ``cmd`` (a load generator), the noise window sampled at its WINDOW_START/END lines.

    ``pids`` (the processes under test) and the load generator are not "others". Returns the
    window and the rest of its stdout; a failed run raises ``CalledProcessError``.
    """
    gen = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert gen.stdout is not None
    window = Window([*dict.fromkeys(pids), gen.pid])
    lines = []
    for line in gen.stdout:
        if line.startswith("WINDOW_START"):
            window.start()
        elif line.startswith("WINDOW_END"):
            window.stop()
        else:
            lines.append(line)
    if gen.wait():
        raise subprocess.CalledProcessError(gen.returncode, cmd)
    return window, "".join(lines)


def _client_point(name: str, port: int, count: int, size: int, server_pid: int) -> dict:
    cmd = [PY, __file__, "--client", name, str(port), str(count), str(size)]
    window, out = _window_run(cmd, [server_pid])
    cpu, wall = json.loads(out.strip().splitlines()[-1])
    return window.record({"cpu": cpu, "wall": wall})


def clients(n: int) -> None:
    port = free_port()
    server = subprocess.Popen([PY, __file__, "--echo-server", str(port)])
    try:
        time.sleep(2.0)
        for size, count in ((200, n), (602112, max(n // 10, 50))):
            for name in ("ours", "httpx", "h11", "aiohttp"):
                if name == "aiohttp" and importlib.util.find_spec("aiohttp") is None:
                    print("aiohttp  not installed (no longer a dependency): skipped")
                    continue
                r = clean_point(
                    lambda name=name, count=count, size=size: _client_point(
                        name, port, count, size, server.pid
                    ),
                    f"{name} {size} B",
                )
                print(
                    f"{name:8s} {size:>7d} B  cpu {r['cpu'] * 1e6:6.0f} us/req  "
                    f"wall {r['wall'] * 1e6:6.0f}  others {r['others_cores']:.3f} cores, "
                    f"load {r['load']}" + (" NOISY" if r.get("noisy") else "")
                )
    finally:
        server.terminate()
        server.wait(10)


# ---------------------------------------------------------------------------- forward vs translate


def _gateway(worker_grpc: int, http_port: int, rest: str | None) -> subprocess.Popen:
    env = {
        **os.environ,
        G + "WORKERS": f"127.0.0.1:{worker_grpc}",
        G + "LISTEN_GRPC": f"127.0.0.1:{free_port()}",
        G + "LISTEN_METRICS": f"127.0.0.1:{free_port()}",
        G + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
        G + "STARTUP_WAIT_SECONDS": "60",
    }
    if rest:
        env[G + "WORKER_HTTP_ENDPOINTS"] = rest
    argv = [PY, "-m", "kserve_trio", "gateway", "--log-level", "warning"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)


def ab(args: argparse.Namespace) -> None:
    repo = build_repository(pathlib.Path(args.repo))
    w_http, w_grpc, fwd_http, tr_http = free_port(), free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    try:
        worker = start_rest_worker(repo, w_grpc, w_http)
        procs.append(worker)
        wait_http(w_http, "/v2/health/ready", worker, "worker")
        forward = _gateway(w_grpc, fwd_http, f"127.0.0.1:{w_http}")
        translate = _gateway(w_grpc, tr_http, None)
        procs += [forward, translate]
        wait_http(fwd_http, "/v2/health/ready", forward, "forwarding gateway")
        wait_http(tr_http, "/v2/health/ready", translate, "translating gateway")
        base = {
            "input": "input_0",
            "output": "output",
            "path": lambda s: f"/v2/models/{'identity16' if len(s) == 2 else 'identity224'}/infer",
        }
        servers = [
            {**base, "label": "direct", "proc": worker, "port": w_http},
            {**base, "label": "forward", "proc": forward, "port": fwd_http},
            {**base, "label": "translate", "proc": translate, "port": tr_http},
        ]
        rows = []
        for case in CASES:
            runs: dict[str, list[dict]] = {s["label"]: [] for s in servers}
            for r in range(args.rounds):
                for server in servers if r % 2 == 0 else servers[::-1]:
                    runs[server["label"]].append(
                        run_level(server, case, args.duration, (worker.pid,))
                    )
            row: dict = {"case": case[0], "concurrency": case[3]}
            for label, results in runs.items():
                row[label] = {
                    k: statistics.median(x[k] for x in results)
                    for k in ("rps", "p50_ms", "p99_ms", "server_cpu_us")
                }
                row[label]["errors"] = sum(x["errors"] for x in results)
                row[label]["others_cores"] = max(x["others_cores"] for x in results)
                row[label]["noisy"] = any(x.get("noisy") for x in results)
            rows.append(row)
            others = max(row[s]["others_cores"] for s in ("direct", "forward", "translate"))
            noisy = any(row[s]["noisy"] for s in ("direct", "forward", "translate"))
            print(
                f"| {row['case']} | {row['concurrency']} | "
                + " | ".join(f"{row[s]['rps']:,.0f}" for s in ("direct", "forward", "translate"))
                + " | "
                + " | ".join(
                    f"{row[s]['p50_ms']:.2f} / {row[s]['p99_ms']:.1f}"
                    for s in ("forward", "translate")
                )
                + " | "
                + " | ".join(f"{row[s]['server_cpu_us']:.0f}" for s in ("forward", "translate"))
                + " | "
                + str(sum(row[s]["errors"] for s in ("direct", "forward", "translate")))
                + f" | {others:.3f}{' noisy' if noisy else ''} |",
                flush=True,
            )
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="")
    p.add_argument("--repo", default=str(ROOT / "build" / "bench-gateway-models"))
    p.add_argument("--clients", action="store_true", help="measure the HTTP client candidates")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--echo-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_server:
        _echo_server(args.echo_server)
    elif args.client:
        name, port, n, size = args.client
        print(json.dumps(_client_run(name, int(port), int(n), int(size))))
    elif args.clients:
        clients(args.requests)
    else:
        ab(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
