"""TLS settings: the coordinator's server context and the client context of workers,
client commands and the library. Standard library ``ssl`` only.

The coordinator (``--tls-cert``/``--tls-key``, optionally ``--tls-client-ca``) speaks TLS
on its worker, client and metrics ports; the Periodic port keeps its own handshake.
A client or worker turns TLS on with ``--tls`` (trust the system's CAs) or
``--tls-ca=PEM`` (trust these), and presents a certificate of its own with
``--tls-cert``/``--tls-key`` when the coordinator asks for one.

Names: a client checks that the coordinator's certificate carries the HOST it connects
to (``--coordinator=HOST:PORT``), as a DNS name or, for an address, as an IP address
in its subjectAltName. A CA file may hold the coordinator's own certificate (a
self-signed one, or a leaf pinned as the only trust anchor: partial chains are accepted).

A context is built once per process (or per ``CoordinatorClient``), so certificate files
are read once; a file that cannot be read or does not fit is a ``ConfigError`` naming
it. ``factory`` is the ``SSLContext`` class: gevent's (``gevent.ssl.SSLContext``) where
sockets are gevent's, so the handshake and every read yield to the hub.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass
from typing import Any

from jobmesh.errors import ConfigError

HANDSHAKE_SECONDS = 10.0  # the coordinator closes a connection whose handshake takes longer


@dataclass(frozen=True)
class ClientTls:
    """How a client or worker speaks TLS: ``ca`` a PEM file of trusted certificates (None:
    the system's), ``cert``/``key`` its own certificate, when the coordinator asks for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def client_tls(enabled: bool, ca: str | None, cert: str | None, key: str | None) -> ClientTls | None:
    """The client's TLS settings from its flags (None: plaintext). ``ConfigError`` when
    only one of cert and key is given."""
    ca, cert, key = (value or None for value in (ca, cert, key))
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together (a client certificate and its private key)")
    if not (enabled or ca or cert):
        return None
    return ClientTls(ca, cert, key)


def _load_chain(context: ssl.SSLContext, cert: str, key: str, cert_flag: str, key_flag: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ConfigError("%s/%s: cannot read %s: %s" % (cert_flag, key_flag, exc.filename, exc.strerror)) from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError("%s=%s / %s=%s: not a PEM certificate and its matching private key (%s)"
                          % (cert_flag, cert, key_flag, key, exc)) from None


def _load_ca(context: ssl.SSLContext, path: str, flag: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except FileNotFoundError as exc:
        raise ConfigError("%s: cannot read %s: %s" % (flag, path, exc.strerror)) from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError("%s=%s: not a PEM file of certificates (%s)" % (flag, path, exc)) from None


def server_context(cert: str, key: str, client_ca: str | None = None,
                   factory: type[ssl.SSLContext] = ssl.SSLContext) -> ssl.SSLContext:
    """The coordinator's context: TLS 1.2 or later, its certificate chain; with
    ``client_ca``, a client must present a certificate that CA signed."""
    context = factory(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, cert, key, "--tls-cert", "--tls-key")
    if client_ca:
        _load_ca(context, client_ca, "--tls-client-ca")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(settings: ClientTls, factory: type[ssl.SSLContext] = ssl.SSLContext) -> ssl.SSLContext:
    """A client's context: the coordinator's certificate is verified (chain and name)
    against ``settings.ca`` or the system's CAs."""
    context = factory(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.ca:
        _load_ca(context, settings.ca, "--tls-ca")
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a pinned leaf is a trust anchor
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if settings.cert and settings.key:
        _load_chain(context, settings.cert, settings.key, "--tls-cert", "--tls-key")
    return context


def secure(sock: socket.socket, context: Any, host: str) -> Any:
    """``sock`` itself, or with a TLS ``context`` the TLS socket after the handshake (under
    the socket's timeout); the coordinator's certificate must carry ``host``. The socket
    is closed if the handshake fails, and what it raised is raised."""
    if context is None:
        return sock
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
