"""Client-side TLS: the ``ssl.SSLContext`` a secure endpoint is reached with.

A ``grpcs://`` target (or ``secure=True``) needs a context that verifies the server against a
CA bundle, optionally presents a client certificate (mutual TLS), and negotiates HTTP/2 through
ALPN. ``client_ssl_context`` builds it from the same three PEM inputs gRPC clients take
(``root_certificates``, ``certificate_chain``, ``private_key``), each given as PEM bytes or as a
file path. The h2 transport takes the context as is.

Rules (``client_ssl_context``):
1. No ``root_certificates``: the system's default CA store. Given: only that bundle is trusted.
2. ``certificate_chain`` and ``private_key`` come together or not at all (``ValueError``);
   ``private_key`` may be omitted when the chain file also holds the key.
3. TLS 1.2 is the floor; hostname checking and certificate verification are on (the server's
   certificate must name the endpoint's host, a DNS name or an IP address).
4. ALPN offers ``h2`` only: gRPC is HTTP/2.
PEM given as bytes is loaded from memory (the CA bundle) or from a private temporary file that
is removed at once (the certificate chain and key: ``ssl`` loads those from files only).
"""

from __future__ import annotations

import os
import ssl
import tempfile

PemSource = bytes | str | os.PathLike
"""PEM content (``bytes``) or the path of a PEM file (``str`` / path-like)."""

ALPN_PROTOCOLS = ("h2",)


def _read_pem(source: PemSource, what: str) -> bytes:
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
    elif isinstance(source, str | os.PathLike):
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read {what} from {os.fspath(source)!r}: {exc}") from None
    else:
        raise TypeError(f"{what} must be PEM bytes or a file path, got {type(source).__name__}")
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} is not PEM data (no '-----BEGIN' line)")
    return data


def _is_pem_bytes(source: object) -> bool:
    return isinstance(source, bytes | bytearray | memoryview)


def _load_chain(ctx: ssl.SSLContext, chain: PemSource, key: PemSource | None) -> None:
    """Load the client certificate chain (and key): straight from the files when paths are
    given, else through a private temporary directory removed before returning."""
    chain_pem = _read_pem(chain, "certificate_chain")  # checked first: ssl's errors are terse
    key_pem = None if key is None else _read_pem(key, "private_key")
    try:
        if not _is_pem_bytes(chain) and not _is_pem_bytes(key):
            ctx.load_cert_chain(os.fspath(chain), None if key is None else os.fspath(key))
            return
        with tempfile.TemporaryDirectory(prefix="kserve_trio_tls_") as tmp:
            paths = []
            for name, data in (("chain.pem", chain_pem), ("key.pem", key_pem)):
                if data is None:
                    paths.append(None)
                    continue
                path = os.path.join(tmp, name)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                paths.append(path)
            ctx.load_cert_chain(paths[0], paths[1])
    except ssl.SSLError as exc:
        raise ValueError(f"cannot load the client certificate and key: {exc}") from None


def client_ssl_context(
    root_certificates: PemSource | None = None,
    certificate_chain: PemSource | None = None,
    private_key: PemSource | None = None,
) -> ssl.SSLContext:
    """A verifying client context for gRPC over TLS; see the module docstring for the rules."""
    if private_key is not None and certificate_chain is None:
        raise ValueError("private_key was given without certificate_chain")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if root_certificates is not None:
        # Only the given bundle is trusted: a fresh context without the system store.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        pem = _read_pem(root_certificates, "root_certificates")
        try:
            ctx.load_verify_locations(cadata=pem.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot load root_certificates: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if certificate_chain is not None:
        _load_chain(ctx, certificate_chain, private_key)
    ctx.set_alpn_protocols(list(ALPN_PROTOCOLS))
    return ctx


def handshake_error_message(address: str, exc: BaseException) -> str:
    """The text of the UNAVAILABLE error a failed TLS handshake becomes (one wording for every
    transport, so callers and tests can rely on it)."""
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__
    detail = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or cause
    return f"TLS handshake with {address} failed: {detail}"


__all__ = [
    "ALPN_PROTOCOLS",
    "PemSource",
    "client_ssl_context",
    "handshake_error_message",
]
