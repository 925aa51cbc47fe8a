"""A hostile REST client and the process measurements the REST edge tests assert on.

Real sockets on loopback against a CLI worker's or gateway's REST port: one request per call
(``Connection: close``), an endless chunked body, a decompression bomb; and the server
process's resident memory from ``/proc/<pid>/status`` with its peak reset before each attack
(``/proc/<pid>/clear_refs``), so each test measures its own peak.
"""

from __future__ import annotations

import json
import select
import socket
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
