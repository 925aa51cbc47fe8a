"""The gateway's two TLS contexts: the public port's server context (``tls:``) and the client
context its worker connections use (``worker_client.tls``).

The server context is the serving layer's (``serving.tls.server_ssl_context``, the one the
worker uses too), with its errors re-pointed at the gateway's own key paths. The worker-side
context is the client library's (``client.tls.client_ssl_context``): it verifies each worker
against ``ca_file`` (or the system's CAs) and presents ``cert_file``/``key_file`` to workers that
require mutual TLS. A worker's certificate is checked against the host name written in
``endpoints`` (not the address it resolved to), which is the name a cluster certificate carries.
"""

from __future__ import annotations

import ssl

from kserve_trio.client.tls import client_ssl_context
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import TlsConfig
from kserve_trio.gateway.config import WorkerTlsConfig
from kserve_trio.serving.tls import server_ssl_context

_SERVING_PREFIX = "endpoints.tls."


def public_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The gateway port's server context (``None``: plaintext h2c). With ``client_ca_file``
    every client must present a certificate that chains to it (mutual TLS)."""
    try:
        return server_ssl_context(tls)
    except ConfigError as exc:
        path = exc.path
        if path.startswith(_SERVING_PREFIX):
            path = "tls." + path[len(_SERVING_PREFIX) :]
        raise ConfigError(exc.message, path) from None


def worker_ssl_context(tls: WorkerTlsConfig) -> ssl.SSLContext | None:
    """The context the gateway reaches its workers with (``None``: plaintext)."""
    if not tls.enabled:
        return None
    try:
        return client_ssl_context(
            root_certificates=tls.ca_file or None,
            certificate_chain=tls.cert_file or None,
            private_key=tls.key_file or None,
        )
    except ValueError as exc:
        text = str(exc)
        key = "ca_file" if "root_certificates" in text else "cert_file"
        raise ConfigError(text, f"worker_client.tls.{key}") from None


__all__ = ["public_ssl_context", "worker_ssl_context"]
