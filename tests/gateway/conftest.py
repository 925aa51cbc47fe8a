"""Gateway test wiring: a throwaway PKI (made with the ``openssl`` command) for the TLS tests."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest


def _openssl(d: pathlib.Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)


def _key_and_csr(d: pathlib.Path, name: str, subject: str, *extra: str) -> list[str]:
    return [
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-subj", subject, *extra,
    ]  # fmt: skip


def _make_ca(d: pathlib.Path, name: str) -> None:
    _openssl(
        d, *_key_and_csr(d, name, f"/CN=gateway test {name}"),
        "-x509", "-out", f"{name}.pem", "-days", "2",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def _make_leaf(d: pathlib.Path, name: str, ca: str, ext: str) -> None:
    _openssl(d, *_key_and_csr(d, name, f"/CN={name}"), "-out", f"{name}.csr")
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
    )  # fmt: skip


_SERVER = (
    "subjectAltName=DNS:worker.test,DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
    "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
)
_CLIENT = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> pathlib.Path:
    """``ca`` signs ``server`` (for worker.test, localhost, 127.0.0.1), ``named`` (for
    worker.test only: no address) and ``client``; an unrelated ``other`` CA signs ``impostor``
    (a client certificate). ``<name>.pem``/``.key``."""
    assert shutil.which("openssl"), "the TLS tests need the openssl command"
    d = tmp_path_factory.mktemp("gateway_pki")
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _make_leaf(d, "server", "ca", _SERVER)
    _make_leaf(d, "named", "ca", _SERVER.replace(",DNS:localhost,IP:127.0.0.1", ""))
    _make_leaf(d, "client", "ca", _CLIENT)
    _make_leaf(d, "impostor", "other", _CLIENT)
    return d
