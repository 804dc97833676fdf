"""One frozen dataclass per message type, and the codec between them and wire dicts.

Every message is a JSON object whose ``type`` names the class. ``decode(obj, allowed)``
checks the type is known and legal on that port, that required fields are present and
that every field has the right JSON type; anything else raises ``ProtocolError``.
Unknown fields are ignored (forward compatibility). Semantic checks (task payload
bounds, priority names, capacity range) belong to the receiver, which answers ERROR
without necessarily closing the connection.

Field kinds: ``str``, ``int`` (never a bool), ``bool``, ``obj`` (JSON object), ``list``;
a trailing ``?`` allows null. A field with a default may be absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from jobmesh.errors import ProtocolError

_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# kind (without the "?") -> whether a non-null value has it
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "obj": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


class Message:
    """Base class. Subclasses set TYPE and FIELDS = ((attr, wireName, kind, default), ...)."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[tuple[str, str, str, Any], ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.TYPE}
        for attr, wire, _kind, _default in self.FIELDS:
            out[wire] = getattr(self, attr)
        return out

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> "Message":
        spec = cls.__dict__.get("_SPEC")
        if spec is None:  # compiled once per class: (attr, wire, check, nullable, default, kind)
            spec = tuple(
                (attr, wire, _CHECKS[kind.rstrip("?")], kind.endswith("?"), default, kind)
                for attr, wire, kind, default in cls.FIELDS
            )
            cls._SPEC = spec
        kwargs = {}
        for attr, wire, check, nullable, default, kind in spec:
            value = obj.get(wire, _MISSING)
            if value is _MISSING:
                if default is _MISSING:
                    raise ProtocolError("%s is missing field %r" % (cls.TYPE, wire))
                value = default
            elif not (check(value) if value is not None else nullable):
                raise ProtocolError(
                    "%s field %r must be %s, got %s"
                    % (cls.TYPE, wire, _KIND_NAMES[kind], _json_type(value))
                )
            kwargs[attr] = value
        return cls(**kwargs)


_KIND_NAMES = {
    "str": "a string", "str?": "a string or null", "int": "an integer", "int?": "an integer or null",
    "bool": "a boolean", "obj": "an object", "obj?": "an object or null", "list": "an array",
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---- worker port -------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRegister(Message):
    TYPE = "WORKER_REGISTER"
    FIELDS = (("worker_id", "workerId", "str", _MISSING), ("capacity", "capacity", "int", _MISSING))
    worker_id: str
    capacity: int


@dataclass(frozen=True)
class WorkerRegistered(Message):
    TYPE = "WORKER_REGISTERED"
    FIELDS = (("worker_id", "workerId", "str", _MISSING),)
    worker_id: str


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE = "HEARTBEAT"
    FIELDS = (("worker_id", "workerId", "str", _MISSING),)
    worker_id: str


@dataclass(frozen=True)
class TaskAssign(Message):
    TYPE = "TASK_ASSIGN"
    FIELDS = (
        ("job_id", "jobId", "str", _MISSING),
        ("attempt_id", "attemptId", "str", _MISSING),
        ("attempt_number", "attemptNumber", "int", _MISSING),
        ("task_type", "taskType", "str", _MISSING),
        ("payload", "payload", "obj", _MISSING),
    )
    job_id: str
    attempt_id: str
    attempt_number: int
    task_type: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class TaskCancel(Message):
    TYPE = "TASK_CANCEL"
    FIELDS = (("job_id", "jobId", "str", _MISSING), ("attempt_id", "attemptId", "str", _MISSING))
    job_id: str
    attempt_id: str


@dataclass(frozen=True)
class TaskResult(Message):
    TYPE = "TASK_RESULT"
    FIELDS = (
        ("worker_id", "workerId", "str", _MISSING),
        ("job_id", "jobId", "str", _MISSING),
        ("attempt_id", "attemptId", "str", _MISSING),
        ("success", "success", "bool", _MISSING),
        ("result", "result", "obj?", None),
        ("error", "error", "str?", None),
    )
    worker_id: str
    job_id: str
    attempt_id: str
    success: bool
    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class Error(Message):
    TYPE = "ERROR"
    FIELDS = (("message", "message", "str", _MISSING),)
    message: str


# ---- client port -------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitJob(Message):
    TYPE = "SUBMIT_JOB"
    FIELDS = (
        ("task_type", "taskType", "str", _MISSING),
        ("payload", "payload", "obj", _MISSING),
        ("max_attempts", "maxAttempts", "int", 0),
        ("idempotency_key", "idempotencyKey", "str?", None),
        ("priority", "priority", "str?", None),
    )
    task_type: str
    payload: dict[str, Any]
    max_attempts: int = 0
    idempotency_key: str | None = None
    priority: str | None = None


@dataclass(frozen=True)
class JobSubmitted(Message):
    TYPE = "JOB_SUBMITTED"
    FIELDS = (("job_id", "jobId", "str", _MISSING),)
    job_id: str


@dataclass(frozen=True)
class SubmitRejected(Message):
    TYPE = "SUBMIT_REJECTED"
    FIELDS = (
        ("reason", "reason", "str", _MISSING),
        ("active_count", "activeCount", "int", _MISSING),
        ("limit", "limit", "int", _MISSING),
        ("retryable", "retryable", "bool", True),
    )
    reason: str
    active_count: int
    limit: int
    retryable: bool = True


@dataclass(frozen=True)
class GetJobStatus(Message):
    TYPE = "GET_JOB_STATUS"
    FIELDS = (("job_id", "jobId", "str", _MISSING),)
    job_id: str


@dataclass(frozen=True)
class JobStatus(Message):
    TYPE = "JOB_STATUS"
    FIELDS = (("job", "job", "obj", _MISSING),)
    job: dict[str, Any]


@dataclass(frozen=True)
class ListJobs(Message):
    TYPE = "LIST_JOBS"
    FIELDS = (
        ("limit", "limit", "int?", None),
        ("state", "state", "str?", None),
        ("cursor", "cursor", "str?", None),
    )
    limit: int | None = None
    state: str | None = None
    cursor: str | None = None


@dataclass(frozen=True)
class JobList(Message):
    TYPE = "JOB_LIST"
    FIELDS = (("jobs", "jobs", "list", _MISSING), ("next_cursor", "nextCursor", "str?", None))
    jobs: list[dict[str, Any]] = field(default_factory=list)
    next_cursor: str | None = None


@dataclass(frozen=True)
class ListWorkers(Message):
    TYPE = "LIST_WORKERS"
    FIELDS = ()


@dataclass(frozen=True)
class WorkerList(Message):
    TYPE = "WORKER_LIST"
    FIELDS = (("workers", "workers", "list", _MISSING),)
    workers: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class CancelJob(Message):
    TYPE = "CANCEL_JOB"
    FIELDS = (("job_id", "jobId", "str", _MISSING),)
    job_id: str


@dataclass(frozen=True)
class JobCancel(Message):
    TYPE = "JOB_CANCEL"
    FIELDS = (("cancelled", "cancelled", "bool", _MISSING), ("job", "job", "obj", _MISSING))
    cancelled: bool
    job: dict[str, Any]


ALL_MESSAGES: tuple[type[Message], ...] = (
    WorkerRegister, WorkerRegistered, Heartbeat, TaskAssign, TaskCancel, TaskResult, Error,
    SubmitJob, JobSubmitted, SubmitRejected, GetJobStatus, JobStatus, ListJobs, JobList,
    ListWorkers, WorkerList, CancelJob, JobCancel,
)
BY_TYPE: dict[str, type[Message]] = {cls.TYPE: cls for cls in ALL_MESSAGES}

# What each side may legally receive.
WORKER_PORT_REQUESTS = frozenset({"WORKER_REGISTER", "HEARTBEAT", "TASK_RESULT"})
CLIENT_PORT_REQUESTS = frozenset({"SUBMIT_JOB", "GET_JOB_STATUS", "LIST_JOBS", "LIST_WORKERS", "CANCEL_JOB"})
TO_WORKER = frozenset({"WORKER_REGISTERED", "TASK_ASSIGN", "TASK_CANCEL", "ERROR"})
TO_CLIENT = frozenset({"JOB_SUBMITTED", "SUBMIT_REJECTED", "JOB_STATUS", "JOB_LIST", "WORKER_LIST", "JOB_CANCEL", "ERROR"})


def decode(obj: dict[str, Any], allowed: frozenset[str] | None = None) -> Message:
    """Turn a wire dict into its message object; ``ProtocolError`` on anything invalid."""
    kind = obj.get("type", _MISSING)
    if kind is _MISSING:
        raise ProtocolError("message has no 'type' field")
    if not isinstance(kind, str):
        raise ProtocolError("message 'type' must be a string")
    cls = BY_TYPE.get(kind)
    if cls is None or (allowed is not None and kind not in allowed):
        raise ProtocolError("unknown or unexpected message type %r" % kind)
    return cls.from_wire(obj)
