"""The gateway's TLS contexts, exercised by real handshakes over loopback: the public port's
server context (TLS and mutual TLS) and the worker-side client context (CA, client certificate)."""

from __future__ import annotations

import ssl

import anyio
import anyio.streams.tls
import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config import TlsConfig
from kserve_trio.gateway.config import WorkerTlsConfig
from kserve_trio.gateway.tls import public_ssl_context, worker_ssl_context

pytestmark = pytest.mark.anyio


async def exchange(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, hostname: str):
    """One TLS connection: the server says ``hello`` once the handshake is done. Returns
    ``(bytes received or the client's exception, the ALPN protocol the client saw)``."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    outcome: list[object] = []

    async def serve_one() -> None:
        stream = await listener.listeners[0].accept()
        try:
            tls = await anyio.streams.tls.TLSStream.wrap(
                stream, server_side=True, ssl_context=server_ctx, standard_compatible=False
            )
            await tls.send(b"hello")
            await tls.aclose()
        except Exception:  # the client was refused: what it sees is the assertion
            await anyio.aclose_forcefully(stream)

    alpn = None
    with anyio.fail_after(10):
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(serve_one)
            stream = await anyio.connect_tcp("127.0.0.1", port)
            try:
                tls = await anyio.streams.tls.TLSStream.wrap(
                    stream, hostname=hostname, ssl_context=client_ctx, standard_compatible=False
                )
                alpn = tls.extra(anyio.streams.tls.TLSAttribute.alpn_protocol)
                outcome.append(await tls.receive())
            except Exception as exc:
                outcome.append(exc)
            finally:
                await anyio.aclose_forcefully(stream)
    return outcome[0], alpn


def server(pki, *, mutual: bool = False) -> ssl.SSLContext:
    ca = str(pki / "ca.pem") if mutual else ""
    ctx = public_ssl_context(TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), ca))
    assert ctx is not None
    return ctx


def client(pki, *, ca: bool = True, cert: str = "") -> ssl.SSLContext:
    tls = WorkerTlsConfig(
        ca_file=str(pki / "ca.pem") if ca else "",
        cert_file=str(pki / f"{cert}.pem") if cert else "",
        key_file=str(pki / f"{cert}.key") if cert else "",
    )
    ctx = worker_ssl_context(tls)
    assert ctx is not None
    return ctx


async def test_tls_with_the_ca_succeeds_over_h2(pki):
    got, alpn = await exchange(server(pki), client(pki), "worker.test")
    assert got == b"hello" and alpn == "h2"


async def test_without_the_ca_the_handshake_fails(pki):
    got, _ = await exchange(server(pki), client(pki, ca=False, cert="client"), "worker.test")
    assert isinstance(got, ssl.SSLCertVerificationError | anyio.BrokenResourceError), got


async def test_the_certificate_is_checked_against_the_host_name(pki):
    got, _ = await exchange(server(pki), client(pki), "not-the-worker.test")
    assert isinstance(got, ssl.SSLCertVerificationError | anyio.BrokenResourceError), got


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki):
    got, _ = await exchange(server(pki, mutual=True), client(pki), "worker.test")
    assert not isinstance(got, bytes), got


async def test_mutual_tls_refuses_a_certificate_from_another_ca(pki):
    got, _ = await exchange(server(pki, mutual=True), client(pki, cert="impostor"), "localhost")
    assert not isinstance(got, bytes), got


async def test_mutual_tls_accepts_the_client_certificate(pki):
    got, _ = await exchange(server(pki, mutual=True), client(pki, cert="client"), "127.0.0.1")
    assert got == b"hello"


def test_no_tls_configured_means_no_context():
    assert public_ssl_context(TlsConfig()) is None
    assert worker_ssl_context(WorkerTlsConfig()) is None
    assert WorkerTlsConfig(cert_file="c", key_file="k").enabled


def test_files_that_cannot_be_loaded_name_the_gateway_keys(pki, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError) as info:
        public_ssl_context(TlsConfig(str(junk), str(pki / "server.key")))
    assert info.value.path == "tls.cert_file"
    with pytest.raises(ConfigError) as info:
        public_ssl_context(TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), str(junk)))
    assert info.value.path == "tls.client_ca_file"
    with pytest.raises(ConfigError) as info:
        worker_ssl_context(WorkerTlsConfig(ca_file=str(junk)))
    assert info.value.path == "worker_client.tls.ca_file"
    assert "not PEM data" in info.value.message
    with pytest.raises(ConfigError) as info:
        worker_ssl_context(
            WorkerTlsConfig(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "server.key"))
        )
    assert info.value.path == "worker_client.tls.cert_file"
