"""Which HTTP/1.1 server library the project's REST and admin endpoints stand on, by measurement.

Each candidate serves the same tiny handler (``GET /v2/health/ready`` -> 200, an empty body;
``POST /echo`` -> the request body back) inside an ``anyio.run`` task tree on the asyncio
backend with uvloop, the way the worker runs. Candidates:

- ``h11``: h11's sans-io parser driven by our own loop on anyio TCP streams;
- ``httptools``: httptools' parser (llhttp, what uvicorn uses) driven by our own loop on anyio
  TCP streams, the status line and headers of a reply written directly;
- ``serving.http``: the project's own server as chosen (httptools on anyio, with its caps,
  keep-alive rules and JSON errors), serving the same handler as an ``App``;
- ``uvicorn-httptools`` / ``uvicorn-h11``: uvicorn's ``Server.serve()`` (its two parsers) on an
  ASGI app, started inside the task tree;
- ``hypercorn``: hypercorn's asyncio ``serve`` on the same ASGI app.

The load generator runs in this process: ``--concurrency`` keep-alive connections, each with one
request in flight (a closed loop on raw asyncio streams, so the client costs as little of the
two cores as possible). Rounds interleave the candidates. Reported per candidate and case: the
median req/s over rounds and the server's CPU time per request (utime+stime of the server
process over the measured window, from /proc). Each point applies the clean-run rule of
tools/bench/noise.py (others' CPU and the load average over the window; a point where others used
over ``NOISY_CORES`` is measured again, and reported as noisy).

Usage: python tools/bench/http_stacks.py [--seconds 3] [--rounds 3] [--concurrency 1,8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import Window, clean_point

STACKS = ("h11", "httptools", "serving.http", "uvicorn-httptools", "uvicorn-h11", "hypercorn")
CLK_TCK = os.sysconf("SC_CLK_TCK")
ECHO_BYTES = 1024
ERRORS: list[str] = []


# ---------------------------------------------------------------------------------- servers


async def _asgi_app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    if scope["method"] == "POST":
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _serve_h11(port: int) -> None:
    import anyio
    import h11

    async def handle(stream) -> None:
        try:
            await serve_one(stream)
        except Exception as exc:
            print("h11 connection failed:", repr(exc), file=sys.stderr)

    async def serve_one(stream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    try:
                        data = await stream.receive(65536)
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    body = bytearray()
                    while True:
                        ev = conn.next_event()
                        if ev is h11.NEED_DATA:
                            conn.receive_data(await stream.receive(65536))
                        elif isinstance(ev, h11.Data):
                            body += ev.data
                        elif isinstance(ev, h11.EndOfMessage):
                            break
                    out = conn.send(
                        h11.Response(status_code=200, headers=[("content-length", str(len(body)))])
                    )
                    out += conn.send(h11.Data(data=bytes(body))) if body else b""
                    out += conn.send(h11.EndOfMessage())
                    await stream.send(out)
                    if conn.our_state is h11.MUST_CLOSE:
                        return
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    return

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    await listener.serve(handle)


async def _serve_httptools(port: int) -> None:
    import anyio
    import httptools

    class Conn:
        def __init__(self) -> None:
            self.done: list[bytes] = []
            self.body = bytearray()

        def on_body(self, data: bytes) -> None:
            self.body += data

        def on_message_complete(self) -> None:
            self.done.append(bytes(self.body))
            self.body = bytearray()

    async def handle(stream) -> None:
        conn = Conn()
        parser = httptools.HttpRequestParser(conn)
        async with stream:
            while True:
                try:
                    data = await stream.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                parser.feed_data(data)
                while conn.done:
                    body = conn.done.pop(0)
                    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
                    await stream.send(head + body)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    await listener.serve(handle)


async def _serve_project(port: int) -> None:
    from kserve_trio.serving.http import HttpResponse, serve_app

    async def app(request):
        return HttpResponse(200, request.body if request.method == "POST" else b"")

    await serve_app("127.0.0.1", port, app, max_body_bytes=1 << 20)


async def _serve_uvicorn(port: int, http: str) -> None:
    import uvicorn

    config = uvicorn.Config(
        _asgi_app,
        host="127.0.0.1",
        port=port,
        http=http,
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    await server.serve()


async def _serve_hypercorn(port: int) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    await serve(_asgi_app, config)


def serve(stack: str, port: int) -> None:
    import anyio

    if stack == "h11":
        main = _serve_h11(port)
    elif stack == "httptools":
        main = _serve_httptools(port)
    elif stack == "serving.http":
        main = _serve_project(port)
    elif stack == "uvicorn-httptools":
        main = _serve_uvicorn(port, "httptools")
    elif stack == "uvicorn-h11":
        main = _serve_uvicorn(port, "h11")
    elif stack == "hypercorn":
        main = _serve_hypercorn(port)
    else:
        raise SystemExit(f"unknown stack {stack}")

    async def run() -> None:
        await main

    anyio.run(run, backend="asyncio", backend_options={"use_uvloop": True})


# ---------------------------------------------------------------------------------- client


def _request(kind: str) -> bytes:
    if kind == "get":
        return b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"x" * ECHO_BYTES
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    return head + body


async def _one_conn(port: int, request: bytes, stop_at: float, counts: list[int]) -> None:
    n = 0
    while time.perf_counter() < stop_at:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            ERRORS.append(repr(exc))
        finally:
            writer.close()
    counts.append(n)


async def _load(port: int, kind: str, concurrency: int, seconds: float) -> int:
    counts: list[int] = []
    stop_at = time.perf_counter() + seconds
    request = _request(kind)
    await asyncio.gather(*(_one_conn(port, request, stop_at, counts) for _ in range(concurrency)))
    return sum(counts)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server on {port} did not start")


def _point(pid: int, port: int, kind: str, c: int, seconds: float) -> dict:
    """One window of load: req/s and the server's CPU us per request, with the noise record.

    The load generator is this process; the server is its child, so ``include_self`` (this
    process and its live descendants) covers both.
    """
    window = Window([], include_self=True)
    window.start()
    cpu0, t0 = _cpu(pid), time.perf_counter()
    n = asyncio.run(_load(port, kind, c, seconds))
    wall, cpu = time.perf_counter() - t0, _cpu(pid) - cpu0
    window.stop()
    return window.record({"rps": n / wall, "cpu_us": cpu / max(n, 1) * 1e6})


def measure(stack: str, cases, seconds: float) -> dict[str, dict]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, str(port)])
    try:
        _wait(port)
        asyncio.run(_load(port, "get", 1, 0.5))  # warm up
        out = {}
        for kind, c in cases:
            point = clean_point(
                lambda kind=kind, c=c: _point(proc.pid, port, kind, c, seconds),
                f"{stack} {kind} c={c}",
            )
            out[f"{kind} c={c}"] = point
            print(
                f"{stack} {kind} c={c}: {point['rps']:,.0f} req/s, {point['cpu_us']:.0f} us CPU, "
                f"others {point['others_cores']:.3f} cores, load {point['load']}"
                + (" NOISY" if point.get("noisy") else ""),
                flush=True,
            )
            if ERRORS:
                print(f"{stack} {kind} c={c}: {len(ERRORS)} dropped connections", ERRORS[0])
                ERRORS.clear()
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", nargs=2, metavar=("STACK", "PORT"))
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    cases = [(kind, c) for kind in ("get", "post") for c in levels]
    stacks = args.stacks.split(",")
    results: dict[str, dict[str, list[dict]]] = {s: {} for s in stacks}
    for _ in range(args.rounds):
        for stack in stacks:
            for case, figures in measure(stack, cases, args.seconds).items():
                results[stack].setdefault(case, []).append(figures)
    print(f"| stack | {' | '.join(f'{k} c={c}' for k, c in cases)} |")
    print("|---|" + "---|" * len(cases))
    summary = {}
    for stack in stacks:
        cells = []
        for kind, c in cases:
            rows = results[stack][f"{kind} c={c}"]
            rps = statistics.median(r["rps"] for r in rows)
            cpu = statistics.median(r["cpu_us"] for r in rows)
            others = max(r["others_cores"] for r in rows)
            noisy = any(r.get("noisy") for r in rows)
            cells.append(
                f"{rps:,.0f} req/s, {cpu:.0f} us CPU, others {others:.3f}"
                + (" noisy" if noisy else "")
            )
            summary.setdefault(stack, {})[f"{kind} c={c}"] = {
                "rps": rps,
                "cpu_us": cpu,
                "others_cores": others,
                "noisy": noisy,
            }
        print(f"| {stack} | {' | '.join(cells)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
