"""TLS contexts for the daemon (certificate + key) and its clients (CA to
verify the daemon against). TLS runs on the daemon's one port: with
--tls-cert/--tls-key every connection must start with a TLS handshake.

Both sides require TLS 1.2 or newer. The client verifies the daemon's
certificate chain against `ca` and the endpoint's host (name or IP address)
against the certificate's subjectAltName, as any TLS client does.
"""
from __future__ import annotations

import ssl


class TlsConfigError(ValueError):
    """A certificate, key or CA file that cannot be loaded."""


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


def client_context(ca: str) -> ssl.SSLContext:
    """Verifies the daemon's certificate against the CA bundle (PEM) in `ca`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(f"cannot load TLS CA file {ca}: {exc}") from None
    return ctx
