"""One frozen dataclass per message type, and the codec between them and wire dicts.

Every message is a JSON object whose ``type`` names the class. ``decode(obj, allowed)``
checks the type is known and legal on that port, that required fields are present and
that every field has the right JSON type; anything else raises ``ProtocolError``.
Unknown fields are ignored (forward compatibility). Semantic checks (task payload
bounds, priority names, capacity range) belong to the receiver, which answers ERROR
without necessarily closing the connection.

Error texts that quote what a peer sent go through ``quote``, which shows at most
``QUOTE_CHARS`` characters of any value, and an ``Error``'s message is cut to
``MAX_ERROR_CHARS``: an ERROR always fits in a frame, whatever the request held.

Each field is declared once, as a dataclass field made by ``wire(name, kind, default)``:
the dataclass gives the constructor, equality and typing; the codec reads the wire name
and kind from the field's metadata. Field kinds: ``str``, ``int`` (never a bool),
``bool``, ``num`` (an integer or a float, never a bool), ``obj`` (JSON object), ``list``;
a trailing ``?`` allows null. A field with a
default may be absent; one declared with ``omit=True`` is also left out of the frames
that carry its default, so a frame that does not use it is the frame it was before.

A field made by ``local()`` is not on the wire at all: the receiver fills it in (the
coordinator's handler sets ``submitted_by`` from the connection's token), so a peer
can never send it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import ujson

from jobmesh.errors import ProtocolError

_MISSING: Any = dataclasses.MISSING

QUOTE_CHARS = 200  # characters of one quoted value an error message shows at most
MAX_ERROR_CHARS = 4096  # an ERROR's message is cut to this many characters
DEFAULT_WORKER_PORT = 7070
DEFAULT_CLIENT_PORT = 7071


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` as an error message quotes it: ``repr`` of a string, compact JSON of
    anything else, showing at most ``limit`` characters of it and then
    ``… (N characters)``. Control characters and lone surrogates come out escaped, so
    the text is printable and always encodes; the result is at most about 10 × ``limit``
    characters long (the longest escape of one character is 10 characters)."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return "%r… (%d characters)" % (value[:limit], len(value))
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() <= 3 * limit:  # at most ~0.9 × limit digits
            return str(value)
        return "an integer of about %d digits" % (value.bit_length() * 0.30103 + 1)
    try:
        text = ujson.dumps(value, ensure_ascii=True, escape_forward_slashes=False)
    except (ValueError, OverflowError, TypeError, UnicodeError, RecursionError):
        return _json_type(value)
    if len(text) <= limit:
        return text
    return "%s… (%d characters)" % (text[:limit], len(text))


def _bounded_message(text: str) -> str:
    """An ERROR message cut to ``MAX_ERROR_CHARS``, with any lone surrogate escaped."""
    if len(text) > MAX_ERROR_CHARS:
        text = "%s… (%d characters)" % (text[:MAX_ERROR_CHARS], len(text))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # escaping makes it longer: cut again
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        if len(text) > MAX_ERROR_CHARS:
            text = "%s…" % text[:MAX_ERROR_CHARS]
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# kind (without the "?") -> whether a non-null value has it
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "num": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "obj": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


def wire(name: str, kind: str, default: Any = _MISSING, omit: bool = False) -> Any:
    """Declare a message field: its wire name, its kind, and its default (none: required);
    ``omit``: encoded only when it differs from the default."""
    if kind.rstrip("?") not in _CHECKS:
        raise ValueError("unknown field kind %r" % kind)
    if omit and default is _MISSING:
        raise ValueError("only a field with a default may be omitted")
    metadata = {"wire": name, "kind": kind, "omit": omit}
    if isinstance(default, (list, dict)):
        factory: Callable[[], Any] = type(default)
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def local() -> Any:
    """A field that is never on the wire (default None): set by the receiver, not the sender."""
    return dataclasses.field(default=None, compare=False)


# One compiled entry per field: (attr, wire name, check, nullable, default, kind).
_Spec = tuple[tuple[str, str, Callable[[Any], bool], bool, Any, str], ...]


class Message:
    """Base class. Subclasses are frozen dataclasses with a TYPE and ``wire(...)`` fields."""

    TYPE: ClassVar[str] = ""

    @classmethod
    def spec(cls) -> _Spec:
        """The fields as the codec uses them, compiled once per class from the dataclass."""
        spec: _Spec | None = cls.__dict__.get("_SPEC")
        if spec is None:
            entries = []
            for f in dataclasses.fields(cls):  # type: ignore[arg-type]
                if "wire" not in f.metadata:
                    continue  # a local() field
                kind = f.metadata["kind"]
                factory: Any = f.default_factory
                default = f.default if factory is _MISSING else factory()
                entries.append((f.name, f.metadata["wire"], _CHECKS[kind.rstrip("?")], kind.endswith("?"),
                                default, kind))
            spec = tuple(entries)
            setattr(cls, "_SPEC", spec)
        return spec

    def to_wire(self) -> dict[str, Any]:
        return _codec(type(self))[1](self)

    def check_types(self) -> None:
        """``TypeError`` naming the first field (by its Python name) whose value the receiver
        would refuse as a protocol violation; a sender calls it before sending."""
        for attr, _name, check, nullable, _default, kind in self.spec():
            value = getattr(self, attr)
            if not (check(value) if value is not None else nullable):
                raise TypeError("%s must be %s, got %s" % (attr, _PYTHON_KIND_NAMES[kind], _python_type(value)))

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> "Message":
        return _codec(cls)[0](obj)


# A check written inline in the compiled decoders, by kind (``v``: the value); the same
# tests as ``_CHECKS``, without a call.
_INLINE_CHECKS = {
    "str": "isinstance(v, str)",
    "int": "(isinstance(v, int) and v is not True and v is not False)",
    "bool": "(v is True or v is False)",
    "num": "(isinstance(v, (int, float)) and v is not True and v is not False)",
    "obj": "isinstance(v, dict)",
    "list": "isinstance(v, list)",
}


def _codec(cls: type[Message]) -> tuple[Callable[[dict[str, Any]], Message], Callable[[Message], dict[str, Any]]]:
    """The class's decoder (wire dict -> message) and encoder (message -> wire dict),
    compiled once per class from ``spec()``: the same checks and errors as a loop over the
    spec would make, without its per-field calls (three messages a job cross the hot path
    each way). The decoder builds the frozen instance by filling its ``__dict__`` (every
    dataclass field, ``local()`` ones with None) and then runs ``__post_init__`` if the
    class has one, which is what the dataclass constructor does, at a third of its cost."""
    codec = cls.__dict__.get("_CODEC")
    if codec is not None:
        return codec
    spec = cls.spec()
    names = {"cls": cls, "_MISSING": _MISSING, "_missing": _missing_field, "_bad": _bad_field, "_new": object.__new__}
    lines = ["def decode(obj):", "    get = obj.get", "    new = _new(cls)", "    d = new.__dict__"]
    for i, (attr, name, _check, nullable, default, kind) in enumerate(spec):
        names["_default%d" % i] = default
        lines.append("    v = get(%r, _MISSING)" % name)
        lines.append("    if v is _MISSING:")
        lines.append("        v = _default%d" % i if default is not _MISSING else "        raise _missing(cls, %r)" % name)
        test = _INLINE_CHECKS[kind.rstrip("?")]
        lines.append("    elif not %s:" % ("(v is None or %s)" % test if nullable else test))
        lines.append("        raise _bad(cls, %r, %r, v)" % (name, kind))
        lines.append("    d[%r] = v" % attr)
    wired = {entry[0] for entry in spec}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in wired:
            lines.append("    d[%r] = None" % f.name)  # a local() field
    if hasattr(cls, "__post_init__"):
        lines.append("    new.__post_init__()")
    lines.append("    return new")
    omitted = {f.name for f in dataclasses.fields(cls) if f.metadata.get("omit")}  # type: ignore[arg-type]
    lines.append("def encode(msg):")
    lines.append("    d = {%s}" % ", ".join(["'type': %r" % cls.TYPE] + ["%r: msg.%s" % (name, attr)
                                                                     for attr, name, *_ in spec
                                                                     if attr not in omitted]))
    for i, (attr, name, *_rest) in enumerate(spec):
        if attr in omitted:
            lines.append("    if msg.%s != _default%d:" % (attr, i))
            lines.append("        d[%r] = msg.%s" % (name, attr))
    lines.append("    return d")
    exec("\n".join(lines), names)  # noqa: S102 - source built from the class's declared fields only
    codec = (names["decode"], names["encode"])
    setattr(cls, "_CODEC", codec)
    return codec


def _missing_field(cls: type[Message], name: str) -> ProtocolError:
    return ProtocolError("%s is missing field %r" % (cls.TYPE, name))


def _bad_field(cls: type[Message], name: str, kind: str, value: Any) -> ProtocolError:
    return ProtocolError("%s field %r must be %s, got %s" % (cls.TYPE, name, _KIND_NAMES[kind], _json_type(value)))


_KIND_NAMES = {
    "str": "a string", "str?": "a string or null", "int": "an integer", "int?": "an integer or null",
    "bool": "a boolean", "obj": "an object", "obj?": "an object or null", "list": "an array",
    "list?": "an array or null", "num": "a number",
}


_PYTHON_KIND_NAMES = {
    "str": "a str", "str?": "a str or None", "int": "an int", "int?": "an int or None",
    "bool": "a bool", "obj": "a dict", "obj?": "a dict or None", "list": "a list", "list?": "a list or None",
    "num": "an int or a float",
}


def _python_type(value: Any) -> str:
    return "None" if value is None else "%s %s" % (type(value).__name__, quote(value, 40))


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
    worker_id: str = wire("workerId", "str")
    capacity: int = wire("capacity", "int")
    # The task types this worker runs; None (absent) means the five built-ins.
    task_types: list[str] | None = wire("taskTypes", "list?", None)
    # The attempts this worker still runs (or holds a result of) from before it lost its
    # coordinator: ``[{jobId, attemptId}, ...]``; None (absent) means none.
    running: list[dict[str, Any]] | None = wire("running", "list?", None, omit=True)
    # Asks for RESULT_ACKs: the worker then holds each result it sends until the
    # coordinator has applied it (or found it stale), and names the ones still held in
    # ``running`` at its next registration, so a result written to a coordinator that
    # froze or died before applying it reaches the one that follows.
    result_acks: bool = wire("resultAcks", "bool", False, omit=True)
    # What this worker's task types ask for (``@task`` options): ``{TYPE: {timeoutMillis,
    # maxAttempts, retryBaseMillis, retryCapMillis}}``; the coordinator keeps the latest
    # per type. None (absent) leaves the kept ones alone.
    task_defaults: dict[str, Any] | None = wire("taskDefaults", "obj?", None, omit=True)


@dataclass(frozen=True)
class WorkerRegistered(Message):
    TYPE = "WORKER_REGISTERED"
    worker_id: str = wire("workerId", "str")
    # True when the registration asked for RESULT_ACKs: this coordinator sends them.
    result_acks: bool = wire("resultAcks", "bool", False, omit=True)


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE = "HEARTBEAT"
    worker_id: str = wire("workerId", "str")
    # Asks for a HEARTBEAT_ACK: a worker that gets no frame at all for a while then knows
    # its coordinator is frozen (its kernel still acknowledges the bytes) and moves on.
    ack: bool = wire("ack", "bool", False)


@dataclass(frozen=True)
class HeartbeatAck(Message):
    TYPE = "HEARTBEAT_ACK"
    worker_id: str = wire("workerId", "str")


@dataclass(frozen=True)
class ResultAck(Message):
    """The TASK_RESULTs of these attempts are dealt with, durably: applied, or stale (their
    lease had ended); the worker forgets them. Sent, after the commit, only to a session
    that asked (WORKER_REGISTER ``resultAcks``), one frame for the results of a batch."""

    TYPE = "RESULT_ACK"
    attempt_ids: list[str] = wire("attemptIds", "list")


@dataclass(frozen=True)
class TaskAssign(Message):
    TYPE = "TASK_ASSIGN"
    job_id: str = wire("jobId", "str")
    attempt_id: str = wire("attemptId", "str")
    attempt_number: int = wire("attemptNumber", "int")
    task_type: str = wire("taskType", "str")
    payload: dict[str, Any] = wire("payload", "obj")
    # A workflow job's direct dependencies' results, by their refs (absent for other jobs).
    parents: dict[str, Any] | None = wire("parents", "obj?", None, omit=True)


@dataclass(frozen=True)
class TaskCancel(Message):
    TYPE = "TASK_CANCEL"
    job_id: str = wire("jobId", "str")
    attempt_id: str = wire("attemptId", "str")


@dataclass(frozen=True)
class TaskResult(Message):
    TYPE = "TASK_RESULT"
    worker_id: str = wire("workerId", "str")
    job_id: str = wire("jobId", "str")
    attempt_id: str = wire("attemptId", "str")
    success: bool = wire("success", "bool")
    result: dict[str, Any] | None = wire("result", "obj?", None)
    error: str | None = wire("error", "str?", None)


@dataclass(frozen=True)
class TaskProgress(Message):
    """How far a running attempt is: ``fraction`` 0..1 and an optional ``message`` (at most
    1,000 characters). Kept by the coordinator in memory only, as the job's snapshot
    ``progress``; one for a lease the session does not hold, or out of those bounds, is
    dropped and the connection stays (docs/PROTOCOL.md)."""

    TYPE = "TASK_PROGRESS"
    worker_id: str = wire("workerId", "str")
    job_id: str = wire("jobId", "str")
    attempt_id: str = wire("attemptId", "str")
    fraction: float = wire("fraction", "num")
    message: str | None = wire("message", "str?", None)


@dataclass(frozen=True)
class Error(Message):
    """``message`` is bounded on construction (``MAX_ERROR_CHARS``), so an ERROR always
    encodes and fits in a frame, whatever the text it was built from."""

    TYPE = "ERROR"
    message: str = wire("message", "str")

    def __post_init__(self) -> None:
        if isinstance(self.message, str):
            object.__setattr__(self, "message", _bounded_message(self.message))


# ---- both ports, with --auth-file -------------------------------------------------


@dataclass(frozen=True)
class Auth(Message):
    """The first frame on the worker and client ports of a coordinator with ``--auth-file``."""

    TYPE = "AUTH"
    token: str = wire("token", "str")


@dataclass(frozen=True)
class AuthOk(Message):
    """The token was accepted: the name of its entry and its role."""

    TYPE = "AUTH_OK"
    name: str = wire("name", "str")
    role: str = wire("role", "str")


# ---- client port -------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitJob(Message):
    TYPE = "SUBMIT_JOB"
    task_type: str = wire("taskType", "str")
    payload: dict[str, Any] = wire("payload", "obj")
    max_attempts: int = wire("maxAttempts", "int", 0)
    idempotency_key: str | None = wire("idempotencyKey", "str?", None)
    priority: str | None = wire("priority", "str?", None)
    run_at_millis: int | None = wire("runAtMillis", "int?", None)  # epoch millis; not with delayMillis
    delay_millis: int | None = wire("delayMillis", "int?", None)
    # Limits (docs/PROTOCOL.md, "Limits"): the key maxRunningPerKey counts by, and the key
    # that makes the job unique among its type's live jobs.
    concurrency_key: str | None = wire("concurrencyKey", "str?", None, omit=True)
    unique_key: str | None = wire("uniqueKey", "str?", None, omit=True)
    timeout_millis: int | None = wire("timeoutMillis", "int?", None, omit=True)  # this job's per-attempt deadline
    result_ttl_millis: int | None = wire("resultTtlMillis", "int?", None, omit=True)  # purged this long after it ends
    submitted_by: str | None = local()  # the submitting token's name (auth on), set by the handler


@dataclass(frozen=True)
class JobSubmitted(Message):
    TYPE = "JOB_SUBMITTED"
    job_id: str = wire("jobId", "str")
    duplicate: bool = wire("duplicate", "bool", False, omit=True)  # a live job held the submit's uniqueKey


@dataclass(frozen=True)
class SubmitRejected(Message):
    TYPE = "SUBMIT_REJECTED"
    reason: str = wire("reason", "str")
    active_count: int = wire("activeCount", "int")
    limit: int = wire("limit", "int")
    retryable: bool = wire("retryable", "bool", True)


@dataclass(frozen=True)
class GetJobStatus(Message):
    TYPE = "GET_JOB_STATUS"
    job_id: str = wire("jobId", "str")


@dataclass(frozen=True)
class JobStatus(Message):
    TYPE = "JOB_STATUS"
    job: dict[str, Any] = wire("job", "obj")


@dataclass(frozen=True)
class WaitJob(Message):
    """Answered with JOB_STATUS once the job is COMPLETED, FAILED or CANCELLED, or with the
    snapshot as it stands once ``timeoutMillis`` (0..3,600,000) has passed. Replies to
    later requests on the same connection follow its reply."""

    TYPE = "WAIT_JOB"
    job_id: str = wire("jobId", "str")
    timeout_millis: int = wire("timeoutMillis", "int")


@dataclass(frozen=True)
class ListJobs(Message):
    TYPE = "LIST_JOBS"
    limit: int | None = wire("limit", "int?", None)
    state: str | None = wire("state", "str?", None)
    cursor: str | None = wire("cursor", "str?", None)
    task_type: str | None = wire("taskType", "str?", None)


@dataclass(frozen=True)
class JobList(Message):
    TYPE = "JOB_LIST"
    jobs: list[dict[str, Any]] = wire("jobs", "list", [])
    next_cursor: str | None = wire("nextCursor", "str?", None)


@dataclass(frozen=True)
class ListWorkers(Message):
    TYPE = "LIST_WORKERS"


@dataclass(frozen=True)
class WorkerList(Message):
    TYPE = "WORKER_LIST"
    workers: list[dict[str, Any]] = wire("workers", "list", [])


@dataclass(frozen=True)
class CancelJob(Message):
    TYPE = "CANCEL_JOB"
    job_id: str = wire("jobId", "str")


@dataclass(frozen=True)
class JobCancel(Message):
    TYPE = "JOB_CANCEL"
    cancelled: bool = wire("cancelled", "bool")
    job: dict[str, Any] = wire("job", "obj")


@dataclass(frozen=True)
class GetJobEvents(Message):
    TYPE = "GET_JOB_EVENTS"
    job_id: str = wire("jobId", "str")


@dataclass(frozen=True)
class JobEvents(Message):
    TYPE = "JOB_EVENTS"
    job_id: str = wire("jobId", "str")
    events: list[dict[str, Any]] = wire("events", "list", [])  # oldest first


@dataclass(frozen=True)
class RetryJob(Message):
    """Submit a new job with a finished job's type, payload, priority and attempt budget
    (answered with JOB_SUBMITTED; the new job's ``retryOf`` names the old one)."""

    TYPE = "RETRY_JOB"
    job_id: str = wire("jobId", "str")
    submitted_by: str | None = local()  # the retrying token's name (auth on), set by the handler
    task_types: tuple[str, ...] | None = local()  # that token's taskTypes (None: any), set by the handler


@dataclass(frozen=True)
class PurgeJobs(Message):
    """Delete finished jobs (and their events) last updated more than ``olderThanMillis`` ago;
    with ``dryRun``, delete nothing and count them (JOBS_PURGED ``purged`` is that count)."""

    TYPE = "PURGE_JOBS"
    older_than_millis: int = wire("olderThanMillis", "int")
    limit: int | None = wire("limit", "int?", None)
    dry_run: bool = wire("dryRun", "bool", False)


@dataclass(frozen=True)
class JobsPurged(Message):
    TYPE = "JOBS_PURGED"
    purged: int = wire("purged", "int")
    more: bool = wire("more", "bool", False)  # more such jobs remain: ask again


@dataclass(frozen=True)
class GetStats(Message):
    """The coordinator's figures: what ``jobmesh top`` shows, without listing any job."""

    TYPE = "GET_STATS"


@dataclass(frozen=True)
class Stats(Message):
    TYPE = "STATS"
    at_millis: int = wire("atMillis", "int")  # the coordinator's wall clock
    jobs: dict[str, int] = wire("jobs", "obj", {})  # non-terminal jobs by state, every state listed
    submitted: int = wire("submitted", "int", 0)  # jobs created since the process started
    finished: dict[str, int] = wire("finished", "obj", {})  # jobs that ended since then, by state
    rejected: int = wire("rejected", "int", 0)
    retries: int = wire("retries", "int", 0)
    workers: int = wire("workers", "int", 0)  # JSON worker sessions
    periodic_workers: int = wire("periodicWorkers", "int", 0)
    capacity: int = wire("capacity", "int", 0)  # the JSON workers' slots
    busy_slots: int = wire("busySlots", "int", 0)
    waits: int = wire("waits", "int", 0)  # pending WAIT_JOBs and Periodic RUN_JOB / RECV_DATA callers


# A job's payload: a client-port request (a reader's), which the dashboard's job view also
# asks in process. The job snapshot carries no payload (its field set is the protocol's).
@dataclass(frozen=True)
class GetJobPayload(Message):
    TYPE = "GET_JOB_PAYLOAD"
    job_id: str = wire("jobId", "str")


@dataclass(frozen=True)
class JobPayload(Message):
    TYPE = "JOB_PAYLOAD"
    job_id: str = wire("jobId", "str")
    payload: dict[str, Any] | None = wire("payload", "obj?", None)  # None: a Periodic job (its workload is bytes)


# ---- recurring schedules (docs/PROTOCOL.md, "Recurring schedules") -------------------------


@dataclass(frozen=True)
class SchedulePut(Message):
    """Create or replace a schedule (its fields as SCHEDULE shows them); answered with SCHEDULE."""

    TYPE = "SCHEDULE_PUT"
    schedule: dict[str, Any] = wire("schedule", "obj")


@dataclass(frozen=True)
class Schedule(Message):
    """A schedule as the coordinator holds it: the reply to SCHEDULE_PUT, GET, PAUSE,
    RESUME and DELETE, one shape for all (``Schedule.view`` in coordinator/core/schedules.py;
    SCHEDULE_LIST's items have it too)."""

    TYPE = "SCHEDULE"
    schedule: dict[str, Any] = wire("schedule", "obj")


@dataclass(frozen=True)
class ScheduleGet(Message):
    TYPE = "SCHEDULE_GET"
    name: str = wire("name", "str")


@dataclass(frozen=True)
class ScheduleList(Message):
    """The request (``limit``, ``after``: a page by name) and its reply (``schedules``,
    ``nextAfter``: null on the last page) share the type name."""

    TYPE = "SCHEDULE_LIST"
    limit: int | None = wire("limit", "int?", None)
    after: str | None = wire("after", "str?", None)
    schedules: list[dict[str, Any]] = wire("schedules", "list", [])
    next_after: str | None = wire("nextAfter", "str?", None)


@dataclass(frozen=True)
class SchedulePause(Message):
    TYPE = "SCHEDULE_PAUSE"
    name: str = wire("name", "str")


@dataclass(frozen=True)
class ScheduleResume(Message):
    TYPE = "SCHEDULE_RESUME"
    name: str = wire("name", "str")


@dataclass(frozen=True)
class ScheduleDelete(Message):
    TYPE = "SCHEDULE_DELETE"
    name: str = wire("name", "str")


@dataclass(frozen=True)
class ScheduleTrigger(Message):
    """A job now from the schedule's template; answered with JOB_SUBMITTED."""

    TYPE = "SCHEDULE_TRIGGER"
    name: str = wire("name", "str")
    submitted_by: str | None = local()  # the triggering token's name (auth on), set by the handler
    task_types: tuple[str, ...] | None = local()  # that token's taskTypes (None: any), set by the handler


@dataclass(frozen=True)
class SchedulePreview(Message):
    """The next ``count`` fire times after ``fromMillis`` of a cron expression or interval;
    the reply (same type) repeats the question and adds ``fireTimes``."""

    TYPE = "SCHEDULE_PREVIEW"
    cron: str | None = wire("cron", "str?", None)
    every_millis: int | None = wire("everyMillis", "int?", None)
    timezone: str | None = wire("timezone", "str?", None)
    from_millis: int | None = wire("fromMillis", "int?", None)
    count: int | None = wire("count", "int?", None)
    fire_times: list[int] = wire("fireTimes", "list", [])


# ---- limits per task type (docs/PROTOCOL.md, "Limits") ------------------------------------


@dataclass(frozen=True)
class LimitPut(Message):
    """Create or replace a type's limit (``paused`` kept unless given); answered with LIMIT."""

    TYPE = "LIMIT_PUT"
    limit: dict[str, Any] = wire("limit", "obj")


@dataclass(frozen=True)
class Limit(Message):
    """A type's limit as the coordinator holds it, with its RUNNING and QUEUED jobs now:
    the reply to LIMIT_PUT, GET, DELETE, TYPE_PAUSE and TYPE_RESUME."""

    TYPE = "LIMIT"
    limit: dict[str, Any] = wire("limit", "obj")


@dataclass(frozen=True)
class LimitGet(Message):
    TYPE = "LIMIT_GET"
    task_type: str = wire("taskType", "str")


@dataclass(frozen=True)
class LimitList(Message):
    """The request (no field) and its reply (``limits``: every type with a limit or paused)."""

    TYPE = "LIMIT_LIST"
    limits: list[dict[str, Any]] = wire("limits", "list", [])


@dataclass(frozen=True)
class LimitDelete(Message):
    TYPE = "LIMIT_DELETE"
    task_type: str = wire("taskType", "str")


@dataclass(frozen=True)
class TypePause(Message):
    TYPE = "TYPE_PAUSE"
    task_type: str = wire("taskType", "str")


@dataclass(frozen=True)
class TypeResume(Message):
    TYPE = "TYPE_RESUME"
    task_type: str = wire("taskType", "str")


# ---- workflows (docs/PROTOCOL.md, "Workflows") -------------------------------------------


@dataclass(frozen=True)
class SubmitWorkflow(Message):
    """Jobs with ``ref`` and ``dependsOn`` (each otherwise a SUBMIT_JOB's fields), created
    in one commit or not at all; answered with WORKFLOW_SUBMITTED."""

    TYPE = "SUBMIT_WORKFLOW"
    jobs: list[dict[str, Any]] = wire("jobs", "list")
    name: str | None = wire("name", "str?", None)
    submitted_by: str | None = local()  # the submitting token's name (auth on), set by the handler


@dataclass(frozen=True)
class WorkflowSubmitted(Message):
    TYPE = "WORKFLOW_SUBMITTED"
    workflow_id: str = wire("workflowId", "str")
    job_ids: dict[str, Any] = wire("jobIds", "obj")  # {ref: jobId}


@dataclass(frozen=True)
class WorkflowStatus(Message):
    """Answered with WORKFLOW; ``cursor`` asks for the next page of its jobs."""

    TYPE = "WORKFLOW_STATUS"
    workflow_id: str = wire("workflowId", "str")
    cursor: str | None = wire("cursor", "str?", None, omit=True)


@dataclass(frozen=True)
class Workflow(Message):
    """A workflow and its jobs ``[{ref, jobId, state, dependsOn}]``: the reply to
    WORKFLOW_STATUS, WORKFLOW_CANCEL and WAIT_WORKFLOW. ``state`` is RUNNING until every
    job is terminal, then COMPLETED, FAILED or CANCELLED; ``nextCursor`` is set when
    ``jobs`` is one page of more."""

    TYPE = "WORKFLOW"
    workflow_id: str = wire("workflowId", "str")
    name: str | None = wire("name", "str?", None)
    state: str = wire("state", "str", "RUNNING")
    jobs: list[dict[str, Any]] = wire("jobs", "list", [])
    next_cursor: str | None = wire("nextCursor", "str?", None, omit=True)


@dataclass(frozen=True)
class WorkflowCancel(Message):
    TYPE = "WORKFLOW_CANCEL"
    workflow_id: str = wire("workflowId", "str")


@dataclass(frozen=True)
class WaitWorkflow(Message):
    """Answered with WORKFLOW once every job of the workflow is terminal, or as it stands
    once ``timeoutMillis`` (0..3,600,000) has passed; like WAIT_JOB, replies to later
    requests on the same connection follow its reply."""

    TYPE = "WAIT_WORKFLOW"
    workflow_id: str = wire("workflowId", "str")
    timeout_millis: int = wire("timeoutMillis", "int")


ALL_MESSAGES: tuple[type[Message], ...] = (
    WorkerRegister, WorkerRegistered, Heartbeat, HeartbeatAck, ResultAck, TaskAssign, TaskCancel, TaskResult, Error,
    SubmitJob, JobSubmitted, SubmitRejected, GetJobStatus, JobStatus, ListJobs, JobList,
    ListWorkers, WorkerList, CancelJob, JobCancel, GetJobEvents, JobEvents, RetryJob, PurgeJobs,
    JobsPurged, WaitJob, GetStats, Stats, SchedulePut, Schedule, ScheduleGet, ScheduleList, SchedulePause,
    ScheduleResume, ScheduleDelete, ScheduleTrigger, SchedulePreview, Auth, AuthOk,
    LimitPut, Limit, LimitGet, LimitList, LimitDelete, TypePause, TypeResume,
    TaskProgress, GetJobPayload, JobPayload,
    SubmitWorkflow, WorkflowSubmitted, WorkflowStatus, Workflow, WorkflowCancel, WaitWorkflow,
)
BY_TYPE: dict[str, type[Message]] = {cls.TYPE: cls for cls in ALL_MESSAGES}

# What each side may legally receive.
WORKER_PORT_REQUESTS = frozenset({"WORKER_REGISTER", "HEARTBEAT", "TASK_RESULT", "TASK_PROGRESS"})
CLIENT_PORT_REQUESTS = frozenset({"SUBMIT_JOB", "GET_JOB_STATUS", "LIST_JOBS", "LIST_WORKERS", "CANCEL_JOB",
                                  "GET_JOB_EVENTS", "RETRY_JOB", "PURGE_JOBS", "WAIT_JOB",
                                  "GET_STATS", "SCHEDULE_PUT", "SCHEDULE_GET", "SCHEDULE_LIST", "SCHEDULE_PAUSE",
                                  "SCHEDULE_RESUME", "SCHEDULE_DELETE", "SCHEDULE_TRIGGER", "SCHEDULE_PREVIEW",
                                  "LIMIT_PUT", "LIMIT_GET", "LIMIT_LIST", "LIMIT_DELETE", "TYPE_PAUSE",
                                  "TYPE_RESUME", "GET_JOB_PAYLOAD", "SUBMIT_WORKFLOW", "WORKFLOW_STATUS",
                                  "WORKFLOW_CANCEL", "WAIT_WORKFLOW"})
TO_WORKER = frozenset({"WORKER_REGISTERED", "TASK_ASSIGN", "TASK_CANCEL", "HEARTBEAT_ACK", "RESULT_ACK", "ERROR",
                       "AUTH_OK"})
TO_CLIENT = frozenset({"JOB_SUBMITTED", "SUBMIT_REJECTED", "JOB_STATUS", "JOB_LIST", "WORKER_LIST", "JOB_CANCEL",
                       "JOB_EVENTS", "JOBS_PURGED", "STATS", "SCHEDULE", "SCHEDULE_LIST", "SCHEDULE_PREVIEW",
                       "ERROR", "AUTH_OK", "LIMIT", "LIMIT_LIST", "JOB_PAYLOAD", "WORKFLOW_SUBMITTED", "WORKFLOW"})


def decode(obj: dict[str, Any], allowed: frozenset[str] | None = None) -> Message:
    """Turn a wire dict into its message object; ``ProtocolError`` on anything invalid."""
    kind = obj.get("type", _MISSING)
    if kind is _MISSING:
        raise ProtocolError("message has no 'type' field")
    if not isinstance(kind, str):
        raise ProtocolError("message 'type' must be a string")
    cls = BY_TYPE.get(kind)
    if cls is None or (allowed is not None and kind not in allowed):
        raise ProtocolError(wrong_port(kind, allowed) or "unknown or unexpected message type %s" % quote(kind))
    return cls.from_wire(obj)


CLIENT_PORT_REFUSAL = "this is the client port"  # how the client port's refusals of worker messages begin
# The refusal of an AUTH frame by a coordinator without --auth-file (the connection closes).
NO_AUTH = "this coordinator takes no tokens (it runs without --auth-file); connect without one"
METRICS_PORT_REFUSAL = "this is the metrics port"  # how the metrics port answers a frame
# How a TLS port answers a frame sent in plaintext (before closing the connection).
TLS_PORT_REFUSAL = "the coordinator speaks TLS here: add --tls-ca=PEM (or --tls to trust the system's CAs)"
# A worker that gets a refusal beginning with one of these was pointed at the wrong port.
WRONG_PORT_REFUSALS = (CLIENT_PORT_REFUSAL, METRICS_PORT_REFUSAL, TLS_PORT_REFUSAL)


def metrics_port_refusal() -> Error:
    """What the metrics port (HTTP) answers, as a frame, to a peer that sends it one."""
    return Error("%s (HTTP); a client belongs on the client port (%d by default), a worker on the worker "
                 "port (%d by default)" % (METRICS_PORT_REFUSAL, DEFAULT_CLIENT_PORT, DEFAULT_WORKER_PORT))


def wrong_port(kind: str, allowed: frozenset[str] | None) -> str | None:
    """The reason for a request that belongs on the coordinator's other port, or None.

    A client pointed at the worker port (or a worker at the client port) learns where
    to go instead of just "unknown message type"."""
    if kind == "AUTH":
        return NO_AUTH
    if allowed is WORKER_PORT_REQUESTS and kind in CLIENT_PORT_REQUESTS:
        return "this is the worker port; %s belongs on the client port (%d by default)" % (kind, DEFAULT_CLIENT_PORT)
    if allowed is CLIENT_PORT_REQUESTS and kind in WORKER_PORT_REQUESTS:
        return "%s; %s belongs on the worker port (%d by default)" % (CLIENT_PORT_REFUSAL, kind, DEFAULT_WORKER_PORT)
    return None
