"""A hostile REST client and the process measurements the REST edge tests assert on.

Real sockets on loopback against a CLI worker's or gateway's REST port: one request per call
(``Connection: close``), an endless chunked body, a decompression bomb, an endless chunk
extension, raw HTTP/1.1 edge cases and ``curl --http2``; and the server process's resident
memory from ``/proc/<pid>/status`` with its peak reset before each attack
(``/proc/<pid>/clear_refs``), so each test measures its own peak, and its CPU time from
``/proc/<pid>/stat``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import time
import urllib.request
import zlib

import numpy as np

from tests.edge.limited_procs import counter
from tests.gateway.procs import Worker
from tests.ports import free_port

MIB = 1 << 20
GZIP_WBITS = 31


class RestWorker(Worker):
    """A CLI worker (static mode, the demo ``mlp``) that also serves REST (``--http-port``)."""

    def __init__(self, *args, **kw) -> None:
        self.http_port = free_port()
        super().__init__(*args, **kw)

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--http-port", str(self.http_port)]


def metric(text: str, name: str, reason: str) -> float:
    """The value of ``name{reason="..."}`` in a Prometheus exposition (0 when absent)."""
    return counter(text, name, reason=reason)


def worker_metrics(worker: Worker) -> str:
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def read_reply(sock: socket.socket, deadline: float) -> tuple[int, bytes]:
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            piece = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not piece:
            break
        data += piece
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(body) >= length:
                return int(head.split()[1]), body[:length]
    raise AssertionError(f"no complete HTTP reply (got {data[:200]!r})")


def request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict | bytes]:
    """One request on its own connection: (status, the JSON body parsed, or the raw bytes)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        status, data = read_reply(sock, time.monotonic() + timeout)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def endless_chunked(
    port: int, path: str, give_up_bytes: int, timeout: float = 60.0
) -> tuple[int, dict | bytes, int]:
    """POST a chunked body that never ends (64 KiB chunks) until the server answers or
    ``give_up_bytes`` were sent: (status, body, bytes sent)."""
    chunk = b"[" * (64 << 10)
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        sock.settimeout(5.0)
        try:
            while sent < give_up_bytes:
                if select.select([sock], [], [], 0)[0]:
                    break  # the answer has arrived: stop sending
                sock.sendall(frame)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server answered and closed, or stopped reading
        status, data = read_reply(sock, time.monotonic() + timeout)
    return status, json.loads(data), sent


def gzip_bomb(inflated_bytes: int) -> bytes:
    """A gzip body of ``inflated_bytes`` zeros (about a thousandth of that compressed)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, GZIP_WBITS, 9, zlib.Z_RLE)  # fast on zeros
    block = bytes(MIB)
    pieces = [packer.compress(block) for _ in range(inflated_bytes // MIB)]
    return b"".join([*pieces, packer.flush()])


def gzip(data: bytes) -> bytes:
    packer = zlib.compressobj(6, zlib.DEFLATED, GZIP_WBITS)
    return packer.compress(data) + packer.flush()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def deep_infer_body(depth: int) -> bytes:
    """An inference body whose one input's data nests ``depth`` deep."""
    return (
        b'{"inputs":[{"name":"input_0","shape":[1,16],"datatype":"FP32","data":'
        + nested(depth)
        + b"}]}"
    )


def number_list_body(count: int, shape: list[int], number: bytes = b"0.5") -> bytes:
    """An FP32 inference body with ``count`` copies of ``number`` as its data, declaring
    ``shape``."""
    data = b",".join([number] * count)
    head = json.dumps({"name": "input_0", "shape": shape, "datatype": "FP32"})[:-1].encode()
    return b'{"inputs":[' + head + b',"data":[' + data + b"]}]}"


def good_infer_body() -> bytes:
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    doc = {
        "inputs": [{"name": "input_0", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}]
    }
    return json.dumps(doc).encode()


def served(port: int) -> bool:
    """A well-behaved REST inference succeeds (200, the mlp's [1, 8] output)."""
    status, body = request(port, "POST", "/v2/models/mlp/infer", good_infer_body())
    assert status == 200, (status, body)
    assert isinstance(body, dict) and body["outputs"][0]["shape"] == [1, 8], body
    return True


# ------------------------------------------------------------ HTTP/1.1 framing and strictness

CHUNK_EXTENSION_ERROR = (
    "malformed HTTP request: more than 16384 bytes of chunk extensions in one request body"
)
CURL_H2C = (
    "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)
"""What ``curl --http2`` adds to a request to an http:// URL."""


def cpu_seconds(*pids: int) -> float:
    """The CPU time (user and system, every thread) the processes have used, in seconds."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


Reply = tuple[int, dict[str, str], bytes]


def split_replies(data: bytes) -> tuple[list[Reply], bytes]:
    """The whole replies at the start of ``data`` (status, headers, body) and what follows."""
    replies: list[Reply] = []
    while True:
        top, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            return replies, data
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        length = int(headers.get("content-length", "0"))
        if len(rest) < length:
            return replies, data
        replies.append((int(lines[0].split()[1]), headers, rest[:length]))
        data = rest[length:]


def exchange(
    port: int, data: bytes, count: int = 1, timeout: float = 30.0
) -> tuple[list[Reply], bool]:
    """Send ``data`` on a new connection: the first ``count`` replies, and whether the server
    then closed the connection with nothing more (read to its end when the last reply says
    ``connection: close``)."""
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        while len(split_replies(received)[0]) < count:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            piece = sock.recv(1 << 16)
            assert piece, f"closed after {received[:300]!r}"
            received += piece
        replies, left = split_replies(received)
        assert len(replies) == count and not left, received[:300]
        if replies[-1][1].get("connection") != "close":
            return replies, False
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            more = sock.recv(1 << 16)
        except ConnectionResetError:
            more = b""
        return replies, more == b""


def endless_extension(port: int, seconds: float) -> tuple[Reply, int, float]:
    """POST an inference whose chunk extension never ends, for ``seconds`` or until the server
    ends the connection, reading what it answers meanwhile: (its reply, the bytes sent before
    the reply arrived, the seconds it took to arrive)."""
    head = (
        b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5;name="
    )
    block = b"e" * (64 << 10)
    sent, received, answered = 0, b"", None
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        sock.settimeout(1.0)
        try:
            while time.monotonic() - start < seconds:
                if select.select([sock], [], [], 0)[0]:
                    piece = sock.recv(1 << 16)
                    if not piece:
                        break
                    received += piece
                    if answered is None and split_replies(received)[0]:
                        answered = (sent, time.monotonic() - start)
                sock.sendall(block)
                sent += len(block)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # answered and closed, or not reading
        if answered is None:  # the reply may have come with the end of the connection
            sock.settimeout(10)
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                while not split_replies(received)[0] and (piece := sock.recv(1 << 16)):
                    received += piece
            answered = (sent, time.monotonic() - start)
    replies, _ = split_replies(received)
    assert replies, f"no reply after {sent} bytes sent: {received[:200]!r}"
    return replies[0], *answered


def chunked(body: bytes, piece: int = 100, extension: bytes = b";x=y") -> bytes:
    """``body`` as chunks of ``piece`` bytes, each with ``extension``, and the last chunk."""
    chunks = [body[i : i + piece] for i in range(0, len(body), piece)]
    return b"".join(b"%x%s\r\n%s\r\n" % (len(c), extension, c) for c in chunks) + b"0\r\n\r\n"


def infer_head(extra: str = "", framing: str = "") -> bytes:
    return (
        "POST /v2/models/mlp/infer HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"{extra}{framing}\r\n"
    ).encode()


def mlp_answer(reply: Reply) -> None:
    """``reply`` is the mlp's inference answer (200, its [1, 8] output)."""
    assert reply[0] == 200, reply
    assert json.loads(reply[2])["outputs"][0]["shape"] == [1, 8], reply


def chunk_extensions_are_bounded(port: int, pids: list[int], seconds: float = 3.0) -> None:
    """Against a REST port served by ``pids``: an inference whose chunk extension never ends,
    sent for ``seconds``, is answered 400 at once (a few MiB of it sent at most: what the
    sockets buffer) and costs the server little CPU (reading it on would cost a core for the
    whole time); a 100 KB extension is 400; an inference in chunks with extensions is served."""
    before = cpu_seconds(*pids)
    (status, _, body), sent, took = endless_extension(port, seconds)
    spent = cpu_seconds(*pids) - before
    assert (status, json.loads(body)) == (400, {"error": CHUNK_EXTENSION_ERROR})
    assert sent < 32 * MIB and took < seconds, (sent, took)
    assert spent < 0.25 * seconds, f"{spent:.2f} s of CPU in {seconds} s"
    a_100_kb_extension_is_refused(port)
    (reply,), _ = exchange(
        port, infer_head(framing="Transfer-Encoding: chunked\r\n") + chunked(good_infer_body())
    )
    mlp_answer(reply)


def a_100_kb_extension_is_refused(port: int) -> None:
    body = b"5;x=" + b"v" * (100 << 10) + b"\r\nhello\r\n0\r\n\r\n"
    (reply,), closed = exchange(port, infer_head(framing="Transfer-Encoding: chunked\r\n") + body)
    assert (reply[0], json.loads(reply[2])["error"], closed) == (400, CHUNK_EXTENSION_ERROR, True)


def http11_rules_hold(port: int) -> None:
    """Against a REST port: an h2c upgrade (curl's, with and without a body) is answered in
    HTTP/1.1 on a connection that stays usable; an HTTP/1.1 request without exactly one Host
    is 400 and an HTTP/1.0 one needs none; an absolute-form target is served by its path; an
    inference followed in one write by a malformed request is run and answered, then 400;
    bytes after ``Connection: close`` end the connection with the first answer; and, where
    curl is installed, ``curl --http2`` gets its answers in HTTP/1.1."""
    body = good_infer_body()
    ready = f"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
    upgrade_get = ready + f"User-Agent: curl/7.88.1\r\nAccept: */*\r\n{CURL_H2C}\r\n".encode()
    upgrade_post = infer_head(CURL_H2C, f"Content-Length: {len(body)}\r\n") + body
    replies, _ = exchange(port, upgrade_get + upgrade_post + ready + b"\r\n", count=3)
    assert [r[0] for r in replies] == [200, 200, 200], replies
    mlp_answer(replies[1])
    assert all("upgrade" not in r[1] and "connection" not in r[1] for r in replies), replies

    for head, status in (
        (b"GET /v2/health/ready HTTP/1.1\r\n\r\n", 400),
        (b"GET /v2/health/ready HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /v2/health/ready HTTP/1.0\r\n\r\n", 200),
        (f"GET http://127.0.0.1:{port}/v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n".encode(), 200),
    ):
        (reply,), _ = exchange(port, head)
        assert reply[0] == status, (head, reply)
        if status == 400:
            assert "Host header" in json.loads(reply[2])["error"], reply
    (reply,), _ = exchange(port, b"GET http://localhost/v2/models/mlp HTTP/1.1\r\nHost: t\r\n\r\n")
    assert reply[0] == 200 and json.loads(reply[2])["name"] == "mlp", reply

    valid = infer_head(framing=f"Content-Length: {len(body)}\r\n") + body
    (first, second), closed = exchange(port, valid + b"NOT HTTP AT ALL\r\n\r\n", count=2)
    mlp_answer(first)  # it ran
    assert second[0] == 400 and closed, second
    assert json.loads(second[2])["error"].startswith("malformed HTTP request: ")
    closing = ready + b"Connection: close\r\n\r\n"
    (reply,), closed = exchange(port, closing + ready + b"\r\n" + b"trailing bytes")
    assert reply[0] == 200 and reply[1]["connection"] == "close" and closed, reply

    if shutil.which("curl") is None:
        return
    base = f"http://127.0.0.1:{port}"
    for extra in ([], ["-H", "Content-Type: application/json", "--data-binary", body.decode()]):
        path = "/v2/models/mlp/infer" if extra else "/v2/health/ready"
        done = subprocess.run(
            [
                "curl",
                "-sS",
                "--http2",
                "--max-time",
                "20",
                "-w",
                "\n%{http_code} %{http_version}",
                *extra,
                base + path,
            ],
            capture_output=True,
            timeout=30,
        )
        answer, _, said = done.stdout.decode().rpartition("\n")
        assert said == "200 1.1", done
        if extra:
            assert json.loads(answer)["outputs"][0]["shape"] == [1, 8], answer
