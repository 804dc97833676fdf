"""The single exception tree of jobmesh, grouped by what the caller must do."""

from __future__ import annotations


class JobmeshError(Exception):
    """Base of every error jobmesh raises on purpose."""


class ConfigError(JobmeshError):
    """Bad command-line flags or values: report on stderr, exit 2."""


class BadAddress(ConfigError, ValueError):
    """A coordinator address that is not HOST:PORT: a ConfigError on the command line, a
    ValueError to a library caller."""


class ProtocolError(JobmeshError):
    """A bad frame or message: answer a best-effort ERROR and close that connection only."""


class PeriodicError(ProtocolError):
    """A bad Periodic frame or packet (bad magic or CRC, too large, undecodable body or
    handshake), or a value that cannot be put on the Periodic wire: close that connection."""


class PayloadError(JobmeshError):
    """Unknown task type or a payload outside its bounds: ERROR reply, no job created."""


class IllegalTransition(JobmeshError):
    """A job state change the state machine forbids. Always a jobmesh bug."""


class ClientError(JobmeshError):
    """Raised by the client library."""


class CoordinatorUnavailable(ClientError):
    """Connecting failed, or the connection was lost mid-request.

    The outcome of the request is unknown (a submit may have created a job), so this is
    never retried automatically.
    """


class InvalidRequest(ClientError):
    """The request cannot be sent as it stands (nothing was sent): it holds text that is
    not valid Unicode, or it does not fit in one frame (``RequestTooLarge``)."""


class RequestTooLarge(InvalidRequest):
    """The encoded request exceeds the 1 MiB frame limit; nothing was sent."""


class RequestFailed(ClientError):
    """The coordinator answered ERROR; ``message`` is its reason."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SubmitRejected(ClientError):
    """The coordinator is at its active-job limit: back off and resubmit."""

    def __init__(self, reason: str, active_count: int, limit: int, retryable: bool = True):
        super().__init__("%s (active %d, limit %d)" % (reason, active_count, limit))
        self.reason = reason
        self.active_count = active_count
        self.limit = limit
        self.retryable = retryable
