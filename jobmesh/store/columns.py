"""The jobs table's columns, declared once, and the row form of a ``Job``.

Each column has a logical kind (``Kind``): text, a 64-bit integer, or JSON. A backend
renders the kind to its own SQL type (``sqlite.py``: TEXT / INTEGER / TEXT); everything
else about a column is said here: whether it may be NULL, its default for rows written
before it existed, whether later writes change it, and how a ``Job`` attribute becomes
a stored value and back. Adding a column is one line in ``COLUMNS`` (and the attribute
on ``Job``, and its migration's number as ``added``); a backend that adds columns to
older tables does so from ``added``.

A row is a tuple in ``COLUMNS`` order (``insert_row``), or the mutable columns followed
by the job id (``update_row``). In a row a JSON column holds JSON text; a backend with a
JSON type converts at its boundary. The functions are compiled from the declarations
once, at import, so a row costs what hand-written tuple code would.

A job's timeline (the ``events`` column) is stored compactly: each event an array
[time, code, attempt, worker, detail, retry time] with trailing nulls dropped, its time
as milliseconds after the previous event (the first: absolute) and its retry time as
milliseconds after it. In memory an event is the full tuple
(atMillis, name, attempt, workerId, detail, retryAtMillis).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Callable, cast

import ujson

from jobmesh.protocol.jobs import ACTIVE, JobState, Priority
from jobmesh.store.job import Job


def _dumps(value: Any) -> str | None:
    return None if value is None else ujson.dumps(value, ensure_ascii=False, escape_forward_slashes=False)


def _loads(text: str | None) -> Any:
    return None if text is None else ujson.loads(text)


class Kind(enum.Enum):
    """What a column holds, independent of any database's type names."""

    TEXT = "text"
    INT64 = "int64"  # a signed 64-bit integer (milliseconds, counts, the sequence)
    JSON = "json"  # JSON text in a row; a backend may store it in a JSON type


@dataclass(frozen=True)
class Column:
    """One column of the jobs table and how a ``Job`` attribute maps to it.

    ``encode`` / ``decode`` are Python expressions over ``job`` (the record) and ``v``
    (the stored value). ``default`` is a literal (str or int) that rows written before
    the column existed hold; ``mutable`` columns are written again by each update;
    ``added`` is the schema version (the numbered migration) that brought the column: 1
    for the first schema's; a backend adds the later ones to older tables.
    """

    name: str
    kind: Kind
    nullable: bool = True
    encode: str = ""  # default: job.<name>
    decode: str = "v"
    mutable: bool = False
    added: int = 1
    default: str | int | None = None
    primary_key: bool = False

    @property
    def encode_expr(self) -> str:
        return self.encode or "job." + self.name


T, I, J = Kind.TEXT, Kind.INT64, Kind.JSON

COLUMNS: tuple[Column, ...] = (
    Column("job_id", T, nullable=False, primary_key=True),
    Column("task_type", T, nullable=False),
    Column("payload", J, nullable=False, encode="job.payload_json or _dumps(job.payload)", decode="_loads(v) or {}"),
    Column("state", T, nullable=False, encode="job.state.value", decode="JobState(v)", mutable=True),
    Column("attempts", I, nullable=False, mutable=True),
    Column("max_attempts", I, nullable=False),
    Column("worker_id", T, mutable=True),
    Column("attempt_id", T, mutable=True),
    Column("result", J, encode="job.result_json or _dumps(job.result)", decode="_loads(v)", mutable=True),
    Column("error", T, mutable=True),
    Column("created_at", I, nullable=False),
    Column("updated_at", I, nullable=False, mutable=True),
    Column("retry_at", I, mutable=True),
    Column("idempotency_key", T),
    # v2: the lease deadline
    Column("execution_timeout", I, mutable=True, added=2),  # a Periodic resubmit changes it
    Column("deadline", I, mutable=True, added=2),
    # v3: priority (older rows: NORMAL) and the submission sequence, unique per job: the
    # order of listings, paging cursors and the retention walk.
    Column("priority", T, nullable=False, encode="job.priority.value", decode="Priority.parse(v or None)",
           added=3, default="NORMAL"),
    Column("seq", I, nullable=False, decode="v or 0", added=3, default=0),
    # v4: scheduled jobs; v5: retries of finished jobs and the timeline (last, below)
    Column("run_at", I, mutable=True, added=4),
    Column("retry_of", T, added=5),
    # v6: Periodic jobs (docs/PERIODIC.md): the name, and the Periodic fields (NULL for JSON jobs).
    Column("name", T, added=6),
    Column("periodic", J, encode="job.periodic and _dumps(job.periodic)", decode="_loads(v)", mutable=True,
           added=6),
    # v8: the recurring schedule that made the job and its nominal fire time (NULL for other jobs).
    Column("schedule_name", T, added=8),
    Column("scheduled_for", I, added=8),
    # v9: the name of the token that submitted the job (docs/SECURITY.md); NULL without --auth-file.
    Column("submitted_by", T, added=9),
    # v10: what the job asked for at creation: its result's time to live (resultTtlMillis)
    # and its retry backoff (its task type's declared one); NULL: the coordinator's settings.
    Column("result_ttl", I, added=10),
    Column("retry_base", I, added=10),
    Column("retry_cap", I, added=10),
    # v11: limits (docs/PROTOCOL.md, "Limits"): the key maxRunningPerKey counts by, and the
    # key that keeps the job unique among its type's live jobs (NULL: none).
    Column("concurrency_key", T, added=11),
    Column("unique_key", T, added=11),
    # v12: workflows (docs/PROTOCOL.md, "Workflows"): the workflow, the job's ref in it, the
    # refs it depends on, and its parents' results, written in the commit that releases it.
    Column("workflow_id", T, added=12),
    Column("ref", T, added=12),
    Column("depends_on", J, encode="job.depends_on and _dumps(job.depends_on)", decode="_loads(v)", added=12),
    Column("parents", J, encode="job.parents and _dumps(job.parents)", decode="_loads(v)", mutable=True, added=12),
    # The job's timeline (its newest events, EVENT_CODES below), rewritten with the row it
    # belongs to, so it is exactly as durable as the state it explains. In memory the job
    # keeps it as text too (Job.events), appended one fragment per event.
    Column("events", J, encode="'[' + job.events + ']'", decode="v[1:-1] if v else ''", mutable=True, added=5),
)

MUTABLE_COLUMNS = tuple(c for c in COLUMNS if c.mutable)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
ACTIVE_STATES = tuple(sorted(s.value for s in ACTIVE))
TERMINAL_STATES = tuple(sorted(s.value for s in JobState if s.value not in ACTIVE_STATES))


def added_in(version: int) -> tuple[Column, ...]:
    """The columns schema version ``version`` added."""
    return tuple(c for c in COLUMNS if c.added == version)


def column_definition(column: Column, types: dict[Kind, str]) -> str:
    """The column's type in a backend's dialect (``types``: its name for each kind) and
    its constraints, which SQLite and PostgreSQL spell alike."""
    sql = types[column.kind]
    if column.primary_key:
        sql += " PRIMARY KEY"
    elif not column.nullable:
        sql += " NOT NULL"
    default = column.default
    if default is not None:
        sql += " DEFAULT " + ("'%s'" % default.replace("'", "''") if isinstance(default, str) else "%d" % default)
    return sql


def _compile(name: str, source: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {"_dumps": _dumps, "_loads": _loads, "JobState": JobState,
                                 "Priority": Priority, "Job": Job}
    exec(source, namespace)  # noqa: S102 - source built from COLUMNS only
    return cast(Callable[..., Any], namespace[name])


def _decoder(index: int, column: Column) -> str:
    return "%s=%s" % (column.name, re.sub(r"\bv\b", "_c%d" % index, column.decode))


insert_row: Callable[[Job], tuple[Any, ...]] = _compile(
    "insert_row", "def insert_row(job):\n    return (%s,)\n" % ", ".join(c.encode_expr for c in COLUMNS))
update_row: Callable[[Job], tuple[Any, ...]] = _compile(
    "update_row", "def update_row(job):\n    return (%s, job.job_id)\n" % ", ".join(c.encode_expr for c in MUTABLE_COLUMNS))
job_from_row: Callable[[tuple[Any, ...]], Job] = _compile(
    "job_from_row",
    "def job_from_row(row):\n    (%s,) = row\n    return Job(%s)\n" % (
        ", ".join("_c%d" % i for i in range(len(COLUMNS))),
        ", ".join(_decoder(i, c) for i, c in enumerate(COLUMNS))),
)

# What a column that cannot be decoded reads as in a damaged row (others: None).
_FALLBACK: dict[str, Any] = {"payload": {}, "state": JobState.QUEUED, "priority": Priority.NORMAL, "events": "",
                             "attempts": 0, "max_attempts": 0, "created_at": 0, "updated_at": 0, "seq": 0,
                             "task_type": "", "job_id": ""}
_COLUMN_DECODERS = [(c.name, _compile("decode", "def decode(v):\n    return %s\n" % c.decode)) for c in COLUMNS]


def read_row(row: tuple[Any, ...]) -> Job:
    """The Job of a stored row. A row that does not decode (edited by hand, or by another
    program: a payload that is not JSON, an unknown priority) is read column by column,
    each column that fails as its fallback, and the Job says why in ``damaged``."""
    try:
        return job_from_row(row)
    except Exception:
        pass
    fields: dict[str, Any] = {}
    problems = []
    for (name, decode), value in zip(_COLUMN_DECODERS, row):
        try:
            fields[name] = decode(value)
        except Exception as exc:
            fields[name] = _FALLBACK.get(name)
            problems.append("%s: %s" % (name, str(exc)[:100]))
    job = Job(**fields)
    job.damaged = "; ".join(problems) or "the row does not decode"
    return job


# ---- the timeline's stored form -------------------------------------------------------

EVENT_CODES = {
    "SUBMITTED": "S", "ASSIGNED": "A", "COMPLETED": "C", "ATTEMPT_FAILED": "F", "LEASE_EXPIRED": "E",
    "WORKER_LOST": "L", "RETRY_WAIT": "R", "FAILED": "X", "QUEUED": "Q", "RESCHEDULED": "D", "REPLACED": "P",
    "CANCELLED": "K", "STALE_RESULT": "T", "RECOVERED": "V", "RELEASED": "W",
}
EVENT_NAMES = {code: name for name, code in EVENT_CODES.items()}
# Worker ids as JSON text: every assignment and every result names its worker in the
# timeline, and there are few workers, so each is encoded once (the cache starts over
# past QUOTED_WORKERS_MAX ids).
_quoted_workers: dict[str, str] = {}
QUOTED_WORKERS_MAX = 4096


def _quoted_worker(worker: str) -> str:
    quoted = _quoted_workers.get(worker)
    if quoted is None:
        if len(_quoted_workers) >= QUOTED_WORKERS_MAX:
            _quoted_workers.clear()
        quoted = _quoted_workers[worker] = ujson.dumps(worker, ensure_ascii=False, escape_forward_slashes=False)
    return quoted


def event_fragment(since: int, at: int, name: str, attempt: int | None, worker: str | None,
                   detail: str | None, retry_at: int | None) -> str:
    """One event's stored form: JSON text, its time ``at`` relative to ``since``."""
    code = EVENT_CODES.get(name)
    if code is not None and detail is None and retry_at is None:  # the common shapes, formatted directly
        if attempt is None and worker is None:
            return '[%d,"%s"]' % (at - since, code)
        if attempt is not None and worker is not None:
            return '[%d,"%s",%d,%s]' % (at - since, code, attempt, _quoted_worker(worker))
    item: list[Any] = [at - since, code or name, attempt, worker, detail,
                       None if retry_at is None else retry_at - at]
    while item[-1] is None:
        item.pop()
    return ujson.dumps(item, ensure_ascii=False, escape_forward_slashes=False)


def dump_events(events: list[Any]) -> str:
    """The stored text of a timeline given as full tuples (without the outer brackets)."""
    out = []
    previous = 0
    for at, name, attempt, worker, detail, retry_at in events:
        out.append(event_fragment(previous, at, name, attempt, worker, detail, retry_at))
        previous = at
    return ",".join(out)


def load_events(text: str | None) -> list[Any]:
    """A stored timeline (without the outer brackets) as full tuples, oldest first."""
    events = []
    at = 0
    for item in ujson.loads("[" + text + "]") if text else ():
        item += [None] * (6 - len(item))
        at += item[0]
        events.append((at, EVENT_NAMES.get(item[1], item[1]), item[2], item[3], item[4],
                       None if item[5] is None else at + item[5]))
    return events
