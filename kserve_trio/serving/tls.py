"""Server-side TLS: the ``ssl.SSLContext`` our gRPC servers (worker or gateway) listen with.

Built from ``endpoints.tls`` (``core.process.config.TlsConfig``): no certificate means plaintext (no
context); a certificate and key give TLS; a client CA bundle on top requires every client to
present a certificate that chains to it (mutual TLS: a client without one fails the handshake).
The context negotiates HTTP/2 through ALPN, since gRPC clients (tritonclient's C-core among
them) insist on ``h2``. A file that cannot be loaded is a ``ConfigError`` naming its key, raised
before the server binds its port.
"""

from __future__ import annotations

import ssl

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import TlsConfig


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The server context for ``tls``, or ``None`` when TLS is off."""
    if not tls.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the certificate chain {tls.cert_file} with key {tls.key_file}: {exc}",
            "endpoints.tls.cert_file",
        ) from None
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"cannot load the client CA bundle {tls.client_ca_file}: {exc}",
                "endpoints.tls.client_ca_file",
            ) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    return ctx


__all__ = ["server_ssl_context"]
