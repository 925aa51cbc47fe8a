"""A TCP relay in front of a worker's REST port, for tests that must see what reaches it.

Every byte a client sends through the relay goes on to the target unchanged and is kept
(``sent``), so a test can count the requests that reached a worker's REST port and read their
headers; ``connections`` counts the client connections it accepted (keep-alive reuse shows as
few connections for many requests). ``close`` stops listening and drops every connection: the
port is down, as a crashed REST listener would leave it.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    """``127.0.0.1:port`` relayed to ``127.0.0.1:target`` (see the module docstring)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sent = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if record:
                    with self._lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def requests(self, line: bytes) -> int:
        """How many times ``line`` (a request line, ``b"POST /v2/... HTTP/1.1\\r\\n"``)
        reached the target."""
        with self._lock:
            return bytes(self.sent).count(line)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
