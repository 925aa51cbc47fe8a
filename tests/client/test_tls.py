"""TLS everywhere: client contexts, the worker's server context, and calls over TLS.

A throwaway CA is made at test time with the ``openssl`` command: CA -> server certificate for
``localhost`` / ``127.0.0.1`` -> client certificate; a second, unrelated CA signs an impostor
client certificate and a server certificate for another name. Acceptance (both anyio
backends): a client with the CA succeeds; without it the handshake fails; with mutual TLS a
client without a certificate (or with one from another CA) is refused; inference over TLS is
numerically correct (``mlp`` against ``tests/e2e/reference.py``), also through tritonclient.
"""

from __future__ import annotations

import pathlib
import shutil
import ssl
import subprocess

import numpy as np
import pytest

from kserve_trio.client import (
    H2Transport,
    InferInput,
    InferOutput,
    KServeModel,
    RpcError,
    client_ssl_context,
    infer_sync,
)
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import ConfigError, StatusCode
from kserve_trio.core.process.config import TlsConfig
from kserve_trio.serving.tls import server_ssl_context
from kserve_trio.worker.server import serve, stop
from tests.client.echo_server import EchoServer, Raw
from tests.e2e import reference as ref

ECHO = "/test.Echo/Echo"


# --------------------------------------------------------------------------------------------
# The throwaway PKI


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: pathlib.Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN=kserve_trio test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: pathlib.Path, name: str, ca: str, ext: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


SERVER_EXT = (
    "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
    "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
)
CLIENT_EXT = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> pathlib.Path:
    """``ca``, ``server``, ``client`` (signed by ca); ``other`` CA with ``impostor`` (client)
    and ``elsewhere`` (a server certificate for another name). ``<name>.pem`` / ``.key``."""
    assert shutil.which("openssl"), "the TLS tests need the openssl command"
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "other")
    _leaf(d, "server", "ca", SERVER_EXT)
    _leaf(d, "client", "ca", CLIENT_EXT)
    _leaf(d, "impostor", "other", CLIENT_EXT)
    _leaf(d, "elsewhere", "ca", SERVER_EXT.replace("DNS:localhost,IP:127.0.0.1", "DNS:a.test"))
    return d


def tls_config(pki: pathlib.Path, *, mutual: bool = False, cert: str = "server") -> TlsConfig:
    return TlsConfig(
        str(pki / f"{cert}.pem"),
        str(pki / f"{cert}.key"),
        str(pki / "ca.pem") if mutual else "",
    )


# --------------------------------------------------------------------------------------------
# Contexts (pure)


def test_client_context_verifies_and_offers_h2_only(pki):
    ctx = client_ssl_context(pki / "ca.pem")
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert len(ctx.get_ca_certs()) == 1  # only the given bundle, not the system store
    from_bytes = client_ssl_context((pki / "ca.pem").read_bytes())
    assert from_bytes.get_ca_certs() == ctx.get_ca_certs()


def test_client_context_loads_a_client_certificate_from_paths_or_bytes(pki):
    client_ssl_context(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    client_ssl_context(
        str(pki / "ca.pem"), (pki / "client.pem").read_bytes(), (pki / "client.key").read_bytes()
    )


def test_client_context_input_errors(pki, tmp_path):
    with pytest.raises(ValueError, match=r"^private_key was given without certificate_chain$"):
        client_ssl_context(pki / "ca.pem", private_key=pki / "client.key")
    with pytest.raises(ValueError, match=r"^root_certificates is not PEM data \(no '-----BEGIN"):
        client_ssl_context(b"garbage")
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=f"^cannot read root_certificates from '{missing}'"):
        client_ssl_context(str(missing))
    with pytest.raises(ValueError, match=r"^cannot load the client certificate and key: "):
        client_ssl_context(pki / "ca.pem", pki / "client.pem", pki / "impostor.key")
    with pytest.raises(TypeError, match=r"^certificate_chain must be PEM bytes or a file path"):
        client_ssl_context(pki / "ca.pem", 42)


def test_server_context_from_config(pki):
    assert server_ssl_context(TlsConfig()) is None
    plain = server_ssl_context(tls_config(pki))
    assert plain is not None and plain.verify_mode is ssl.CERT_NONE
    mutual = server_ssl_context(tls_config(pki, mutual=True))
    assert mutual is not None and mutual.verify_mode is ssl.CERT_REQUIRED
    assert len(mutual.get_ca_certs()) == 1


def test_server_context_reports_unloadable_files_by_key(pki):
    with pytest.raises(ConfigError) as info:
        server_ssl_context(TlsConfig(str(pki / "server.pem"), str(pki / "client.key")))
    assert info.value.path == "endpoints.tls.cert_file"
    assert info.value.message.startswith(
        f"cannot load the certificate chain {pki / 'server.pem'} with key {pki / 'client.key'}: "
    )
    with pytest.raises(ConfigError) as info:
        server_ssl_context(
            TlsConfig(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "server.csr"))
        )
    assert info.value.path == "endpoints.tls.client_ca_file"
    assert info.value.message.startswith(f"cannot load the client CA bundle {pki / 'server.csr'}: ")


def test_kserve_model_tls_options(pki):
    m = KServeModel("grpcs://127.0.0.1:9", "m", root_certificates=pki / "ca.pem")
    assert m.secure and m.url == "grpcs://127.0.0.1:9"
    assert m.endpoint.ssl_context.get_ca_certs()
    implied = KServeModel("127.0.0.1:9", "m", root_certificates=pki / "ca.pem")
    assert implied.secure  # a CA bundle means TLS
    ctx = client_ssl_context(pki / "ca.pem")
    assert KServeModel("h", 9, "m", ssl_context=ctx).endpoint.ssl_context is ctx
    assert KServeModel("grpc://h:9", "m").endpoint.ssl_context is None
    assert KServeModel("grpcs://h:9", "m").endpoint.ssl_context is not None  # system CAs
    with pytest.raises(ValueError, match=r"^pass either ssl_context or root_certificates"):
        KServeModel("h:9", "m", ssl_context=ctx, root_certificates=pki / "ca.pem")
    with pytest.raises(TypeError, match=r"^ssl_context must be an ssl.SSLContext"):
        KServeModel("h:9", "m", ssl_context="yes")


# --------------------------------------------------------------------------------------------
# Calls over TLS (echo server; both anyio backends)


@pytest.fixture(scope="module")
def tls_echo(pki):
    with EchoServer(ssl_context=server_ssl_context(tls_config(pki))) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_echo(pki):
    with EchoServer(ssl_context=server_ssl_context(tls_config(pki, mutual=True))) as server:
        yield server


def h2(port: int, ctx: ssl.SSLContext | None, host: str = "127.0.0.1") -> H2Transport:
    return H2Transport(Endpoint(host, port, True, ssl_context=ctx))


async def _refused(transport) -> RpcError:
    with pytest.raises(RpcError) as info:
        async with transport as t:
            await t.unary(ECHO, b"x", Raw, timeout=5)
    assert info.value.status is StatusCode.UNAVAILABLE
    return info.value


@pytest.mark.anyio
async def test_a_client_with_the_ca_succeeds(pki, tls_echo):
    ctx = client_ssl_context(pki / "ca.pem")
    for host in ("127.0.0.1", "localhost"):
        async with h2(tls_echo.port, ctx, host) as t:
            assert await t.unary(ECHO, b"secret", Raw, timeout=5) == b"secret"
            big = bytes(range(256)) * 40_000
            assert await t.unary(ECHO, big, Raw, timeout=30) == big


@pytest.mark.anyio
async def test_without_the_ca_the_handshake_fails(tls_echo):
    err = await _refused(h2(tls_echo.port, client_ssl_context()))  # system CAs only
    assert err.message == (
        f"TLS handshake with 127.0.0.1:{tls_echo.port} failed: "
        "unable to get local issuer certificate"
    )


@pytest.mark.anyio
async def test_a_certificate_for_another_name_is_refused(pki):
    ctx = server_ssl_context(tls_config(pki, cert="elsewhere"))
    with EchoServer(ssl_context=ctx) as server:
        err = await _refused(h2(server.port, client_ssl_context(pki / "ca.pem")))
    assert err.message.startswith(f"TLS handshake with 127.0.0.1:{server.port} failed: ")
    assert "mismatch" in err.message


@pytest.mark.anyio
async def test_a_plaintext_client_gets_no_reply_from_a_tls_port(tls_echo):
    async with H2Transport(Endpoint("127.0.0.1", tls_echo.port)) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=3)
    assert info.value.status in (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.anyio
async def test_mutual_tls_accepts_a_client_certificate_from_the_ca(pki, mtls_echo):
    ctx = client_ssl_context(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    async with h2(mtls_echo.port, ctx) as t:
        assert await t.unary(ECHO, b"mutual", Raw, timeout=5) == b"mutual"


@pytest.mark.anyio
@pytest.mark.parametrize("client", [None, "impostor"])
async def test_mutual_tls_refuses_a_client_without_a_valid_certificate(pki, mtls_echo, client):
    if client is None:
        ctx = client_ssl_context(pki / "ca.pem")
    else:
        ctx = client_ssl_context(pki / "ca.pem", pki / f"{client}.pem", pki / f"{client}.key")
    calls = mtls_echo.service.calls
    err = await _refused(h2(mtls_echo.port, ctx))
    # TLS 1.3: the client's side of the handshake completes first; the server then drops it
    assert err.message.startswith(f"connection to 127.0.0.1:{mtls_echo.port} ")
    assert mtls_echo.service.calls == calls  # the request never reached the service


# --------------------------------------------------------------------------------------------
# A worker serving over mutual TLS


@pytest.fixture(scope="module")
def tls_worker(demo_repo, pki):
    tls = tls_config(pki, mutual=True)
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        models_include=["mlp"],
        endpoints={
            "port": 0,
            "tls": {
                "cert_file": tls.cert_file,
                "key_file": tls.key_file,
                "client_ca_file": tls.client_ca_file,
            },
        },
    )
    yield running
    stop(running)


@pytest.mark.anyio
async def test_inference_over_mutual_tls_is_numerically_correct(tls_worker, demo_repo, pki):
    x = np.random.default_rng(7).standard_normal((6, 16), dtype=np.float32)
    want = ref.mlp(x, ref.weights(demo_repo, "mlp"))
    async with KServeModel(
        f"grpcs://localhost:{tls_worker.port}",
        "mlp",
        root_certificates=pki / "ca.pem",
        certificate_chain=pki / "client.pem",
        private_key=pki / "client.key",
        shared_memory="off",
    ) as m:
        assert await m.server_ready()
        response = await m.infer([InferInput("input_0", x)])
    np.testing.assert_allclose(InferOutput("output", response), want, rtol=1e-5, atol=1e-5)


@pytest.mark.anyio
async def test_the_worker_refuses_a_client_without_a_certificate(tls_worker, pki):
    async with KServeModel(
        f"grpcs://127.0.0.1:{tls_worker.port}", "mlp", root_certificates=pki / "ca.pem"
    ) as m:
        with pytest.raises(RpcError) as info:
            await m.server_live()
    assert info.value.status is StatusCode.UNAVAILABLE


def test_infer_sync_over_tls(tls_worker, demo_repo, pki):
    x = np.random.default_rng(8).standard_normal((3, 16), dtype=np.float32)
    m = KServeModel(
        "localhost",
        tls_worker.port,
        "mlp",
        secure=True,
        root_certificates=(pki / "ca.pem").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
    )
    with m:
        response = infer_sync(m, [InferInput("input_0", x)])
    want = ref.mlp(x, ref.weights(demo_repo, "mlp"))
    np.testing.assert_allclose(InferOutput("output", response), want, rtol=1e-5, atol=1e-5)


def test_tritonclient_over_mutual_tls(tls_worker, demo_repo, pki):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(
        f"localhost:{tls_worker.port}",
        ssl=True,
        root_certificates=str(pki / "ca.pem"),
        certificate_chain=str(pki / "client.pem"),
        private_key=str(pki / "client.key"),
    )
    x = np.random.default_rng(9).standard_normal((2, 16), dtype=np.float32)
    inp = tc.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp", [inp])
    want = ref.mlp(x, ref.weights(demo_repo, "mlp"))
    np.testing.assert_allclose(result.as_numpy("output"), want, rtol=1e-5, atol=1e-5)
    client.close()
