"""What both client libraries share, whatever moves the bytes: the blocking
``CoordinatorClient`` (jobmesh/client/api.py) and asyncio's ``AsyncClient``
(jobmesh/aio.py).

- ``encode_request``: a request checked and framed, or the error that says why it cannot
  be sent (nothing is sent then);
- ``read_reply``: a reply frame as the message the caller expects, or the error it means;
- the failures that decide whether a request goes again (``ClosedUnanswered``,
  ``NotConnected``) and why a TLS handshake failed (``TlsFailed``, ``tls_reason``).

No sockets and no clock here: each client keeps its own connections.
"""

from __future__ import annotations

import ssl
from typing import Any

from jobmesh.errors import (CoordinatorUnavailable, InvalidRequest, ProtocolError, RequestFailed, RequestTooLarge,
                            SubmitRejected)
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame


class ClosedUnanswered(CoordinatorUnavailable):
    """The coordinator closed the connection without answering the request (EOF, or a
    reset or broken pipe: what a closed peer answers data with). ``at_once``: on a
    connection that had answered nothing, right after the request was sent. ``address``:
    the coordinator's that closed it."""

    def __init__(self, message: str, at_once: bool, address: Any = None):
        super().__init__(message)
        self.at_once = at_once
        self.address = address


class NotConnected(CoordinatorUnavailable):
    """No address took the connection: nothing was sent."""


class BadReply(CoordinatorUnavailable):
    """A reply that made no sense (undecodable, or of a type the request does not get): the
    connection it came on is no longer to be trusted."""


class TlsFailed(Exception):
    """A TLS handshake with one address failed (the next address is tried)."""


def encode_request(request: m.Message) -> bytes:
    """The request's frame; ``TypeError`` naming the argument whose type the coordinator would
    refuse, ``InvalidRequest`` (``RequestTooLarge``) if it cannot be one."""
    request.check_types()
    try:
        return encode_frame(request.to_wire())
    except ProtocolError as exc:
        if isinstance(exc.__cause__, UnicodeError):
            raise InvalidRequest("%s cannot be sent: it holds text that is not valid Unicode" % request.TYPE) from exc
        raise RequestTooLarge("%s is too large to send: %s" % (request.TYPE, exc)) from exc
    except (ValueError, OverflowError, TypeError) as exc:  # e.g. a payload holding something JSON cannot
        raise InvalidRequest("%s cannot be encoded as JSON: %s" % (request.TYPE, exc)) from exc


def read_reply(request: m.Message, obj: dict[str, Any], expect: type, where: object) -> Any:
    """The reply ``obj`` (from ``where``) to ``request`` if it is an ``expect``; else
    ``RequestFailed`` (ERROR), ``SubmitRejected``, or ``BadReply`` (also for a TLS port's
    refusal of a plaintext peer: the coordinator is unreachable this way, not refusing)."""
    try:
        reply = m.decode(obj, m.TO_CLIENT)
    except ProtocolError as exc:
        raise BadReply("unintelligible reply from %s: %s" % (where, exc)) from exc
    if isinstance(reply, expect):
        return reply
    if isinstance(reply, m.Error):
        if reply.message == m.TLS_PORT_REFUSAL:  # said in plaintext by a TLS port, which then closes
            raise BadReply("%s: %s" % (where, reply.message))
        raise RequestFailed(reply.message)
    if isinstance(reply, m.SubmitRejected):
        raise SubmitRejected(reply.reason, reply.active_count, reply.limit, reply.retryable)
    raise BadReply("unexpected %s reply to %s" % (reply.TYPE, request.TYPE))


def tls_reason(exc: OSError) -> str:
    """Why a handshake failed, in words a user can act on."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "%s (the certificate must be signed by a trusted CA, --tls-ca, and carry the host name)" % (
            exc.verify_message or exc)
    if isinstance(exc, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(exc):
        return "the coordinator does not speak TLS on this port"
    return str(exc) or type(exc).__name__
