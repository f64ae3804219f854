"""The TLS context of the router's `/wss` listener, from PEM files.

Agents whose network lets out only HTTPS (or only a proxy that inspects plain HTTP)
reach the router over WebSocket inside TLS. The certificate is for the name or address
agents dial; Noise inside still authenticates the router by its peer ID, so TLS here
is for the path, not for trust in the router.
"""

from __future__ import annotations

import ssl


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context with the certificate chain and key; ValueError names the file
    and what is wrong with it."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except FileNotFoundError as exc:
        raise ValueError(f"TLS file not found: {exc.filename}") from None
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--tls-cert-file {cert_file} / --tls-key-file {key_file}: not a PEM certificate "
            f"chain and its private key ({exc})"
        ) from None
    return context
