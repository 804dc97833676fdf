"""CoordinatorClient: a small blocking client for the coordinator's client port.

One socket, connected lazily, many requests on it, exactly one reply per request
(docs/PROTOCOL.md, "Client port"). It uses the stdlib ``socket`` module, so it
works from a plain script, from threads (a lock serializes requests on the shared
socket) and from a gevent-patched process alike.

What each failure means for the caller (the error tree is in jobmesh/errors.py):

- ``CoordinatorUnavailable``: connecting failed (to every address), the connection broke
  mid-request, the reply timed out or made no sense. The outcome is unknown (a submit may
  have created a job), so only requests that are safe to repeat are sent again: reads
  (status, listings, waits, stats...) and submits that carry an ``idempotency_key`` (the
  coordinator answers a repeated key with the job it made). These ride through a restart
  or a takeover: when the connection is lost (closed or reset) the request goes again on
  a fresh connection, from the next address round the list (the same one when it is the
  only one: a restarted coordinator comes back on it), and while no address takes the
  connection the client tries again with backoff, for up to ``failover_timeout`` seconds
  after each loss. A reply that timed out or made no sense sends them again as well when
  the connection was reused or there are several addresses. A coordinator that closes
  fresh connections on the request at once, before answering anything (a TLS port does so
  to a plaintext client), is sent it ``DROPS_AT_ONCE`` times in a row (a moment when no
  address takes the connection, as while a killed coordinator restarts, or a drop by
  another address, as after a takeover, starts the count again). Other requests (a
  submit without a key, cancel, retry, purge, schedule changes) are not repeated; except
  that any request goes on a fresh connection when the coordinator closed the connection
  after refusing the previous request (it reads nothing more there, so this one was never
  read, or not even sent). The socket is discarded; the next call reconnects. No other
  class of it is raised.
- ``RequestFailed``: the coordinator answered ERROR (unknown job, invalid payload,
  idempotency conflict). The next call works, on this connection or a fresh one.
- ``TypeError``: an argument has a type the coordinator would refuse (``payload`` not a
  dict, ``priority=2``, ``idempotency_key=123``); nothing was sent.
- ``InvalidRequest``: the request cannot be sent (nothing was): text that is not valid
  Unicode, or, as ``RequestTooLarge``, more than the 1 MiB frame limit encoded.
- ``SubmitRejected``: the coordinator is at its active-job limit. ``submit_retries``
  backs off and resubmits, for this and nothing else.
- ``WaitTimeout`` (also a ``TimeoutError``): ``wait`` gave up; ``.job`` is the
  snapshot as it stood then (``wait`` uses WAIT_JOB: the coordinator answers when the
  job ends, so nothing polls). ``wait_workflow`` raises its ``WorkflowWaitTimeout``.
- ``CanvasError`` (a ``ValueError``): ``submit_workflow`` was given a shape that cannot
  be a workflow (more than 10,000 jobs, a ref used twice); nothing was sent.

Workflows (``submit_workflow``, ``workflow_status``, ``cancel_workflow``,
``wait_workflow``): WORKFLOW_STATUS and WAIT_WORKFLOW are reads, sent again like the
others; SUBMIT_WORKFLOW is sent again only when every job carries an idempotency key
(``submit_workflow(..., idempotency_key=K)`` gives each job ``K:REF``): the coordinator
answers a repeat with the workflow those keys made.

Addresses: ``CoordinatorClient("10.0.0.1:7071,10.0.0.2:7071")`` (or a list of such
strings) names a leader and its standbys (docs/SCALING.md). Connecting tries them in
turn, each for at most ``connect_timeout`` seconds: a standby opens no job ports, so a
refused connection just moves on to the next address. After a lost connection the next
one starts with the address after the one that was lost.

Snapshots are returned as the wire dicts (``jobId``, ``state``, ``result`` ...).
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import os
import random
import socket
import ssl
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, NamedTuple, Sequence
from zoneinfo import ZoneInfo

from jobmesh import canvas
from jobmesh.addresses import CONNECT_TIMEOUT, Address, AllFailed, first_reachable, joined, parse_addresses
from jobmesh.client.wire import BadReply, ClosedUnanswered, NotConnected, TlsFailed, encode_request, read_reply, tls_reason
from jobmesh.errors import ClientError, CoordinatorUnavailable, ProtocolError, RequestFailed, SubmitRejected
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameReader
from jobmesh.protocol.jobs import TERMINAL, JobState, Priority
from jobmesh.tls import HANDSHAKE_SECONDS, client_context, client_tls, secure

DEFAULT_PORT = 7071
COORDINATOR_ENV = "JOBMESH_COORDINATOR"  # the addresses when the caller names none, as for the CLI
RETRY_BASE = 0.05
RETRY_CAP = 2.0
# How long after a lost connection a request safe to repeat keeps trying the addresses
# for a coordinator to answer it (a restart, or a standby taking over).
FAILOVER_TIMEOUT = 30.0
# Connections in a row closed on a request at once, before any answer, after which it is
# not sent again: the coordinator will not take it.
DROPS_AT_ONCE = 3
# "At once": a connection closed on the request within this many seconds of its sending (and
# within connect_timeout). A coordinator that refuses a client, or dies of the request, closes
# in milliseconds; one killed from outside while the request waits rarely does so this soon,
# and a supervisor or standby bringing it back must not make a pending request give up.
DROP_AT_ONCE_SECONDS = 0.25
WAIT_CHUNK_MILLIS = 60_000  # one WAIT_JOB waits at most this long; ``wait`` asks again after it
WATCH_MILLIS = 1000  # with ``on_snapshot``, ``wait`` shows the job this often (a WAIT_JOB of this long)
_TERMINAL_NAMES = frozenset(s.value for s in TERMINAL)
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MILLISECOND = timedelta(milliseconds=1)


class WaitTimeout(ClientError, TimeoutError):
    """``wait`` ran out of time; ``job`` is the snapshot as it last stood."""

    what = "job"

    def __init__(self, job_id: str, timeout: float, job: dict[str, Any]):
        super().__init__("%s %s still %s after %.3gs" % (self.what, job_id, job.get("state"), timeout))
        self.job_id = job_id
        self.job = job


class WorkflowWaitTimeout(WaitTimeout):
    """``wait_workflow`` ran out of time; ``workflow`` is the workflow as it last stood
    (``workflowId``, ``name``, ``state``, ``jobs``), as are ``job`` and ``job_id``."""

    what = "workflow"

    @property
    def workflow_id(self) -> str:
        return self.job_id

    @property
    def workflow(self) -> dict[str, Any]:
        return self.job


def schedule_millis(
    delay: float | timedelta | None, run_at: datetime | float | None
) -> tuple[int | None, int | None]:
    """``submit``'s ``delay``/``run_at`` as the wire's ``(runAtMillis, delayMillis)``.

    ``delay``: seconds (int or float) or a ``timedelta``; ``run_at``: an aware ``datetime`` or
    epoch seconds. ``ValueError`` for both at once, a naive datetime, a negative or non-finite
    time; ``TypeError`` for anything else.
    """
    if delay is not None and run_at is not None:
        raise ValueError("give delay or run_at, not both")
    if delay is not None:
        if isinstance(delay, timedelta):
            millis = delay // _MILLISECOND
        else:
            millis = _seconds_to_millis(delay, "delay")
        if millis < 0:
            raise ValueError("delay must not be negative, got %r" % (delay,))
        return None, millis
    if run_at is not None:
        if isinstance(run_at, datetime):
            if run_at.tzinfo is None or run_at.utcoffset() is None:
                raise ValueError("run_at must be an aware datetime (with a tzinfo), got naive %s"
                                 % run_at.isoformat())
            millis = (run_at - EPOCH) // _MILLISECOND
        else:
            millis = _seconds_to_millis(run_at, "run_at")
        if millis < 0:
            raise ValueError("run_at must not be before the epoch, got %r" % (run_at,))
        return millis, None
    return None, None


def _seconds_to_millis(seconds: Any, name: str) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError("%s must be a number of seconds, got %r" % (name, seconds))
    if not math.isfinite(seconds):
        raise ValueError("%s must be finite, got %r" % (name, seconds))
    return round(seconds * 1000)


def submit_backoff(retry: int, base: float = RETRY_BASE, cap: float = RETRY_CAP) -> float:
    """Seconds to wait before resubmit number ``retry`` (1-based): full jitter on a capped doubling."""
    ceiling = min(cap, base * (2 ** (retry - 1)))
    return random.uniform(ceiling / 2, ceiling)


# ---- what the client libraries share (this one and jobmesh.aio's AsyncClient) ----------


def coordinator_addresses(host: str | Sequence[str | Address] | None, port: int) -> tuple[Address, ...]:
    """The client's ``host`` argument as addresses; ``$JOBMESH_COORDINATOR``, else
    127.0.0.1, when it is None. ``ValueError`` (``BadAddress``) for one that is not HOST:PORT."""
    if host is None:
        host = os.environ.get(COORDINATOR_ENV) or "127.0.0.1"
    return parse_addresses(host, "the coordinator address", default_port=port)


def tls_context(tls: bool | ssl.SSLContext, tls_ca: str | None, tls_cert: str | None,
                tls_key: str | None) -> ssl.SSLContext | None:
    """The client's TLS arguments as a context (None: plaintext); ``ConfigError`` for
    certificate files that cannot be read."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    settings = client_tls(tls, tls_ca, tls_cert, tls_key)
    return client_context(settings) if settings is not None else None


def submit_request(task_type: str, payload: dict[str, Any], max_attempts: int = 0,
                   priority: str | Priority | None = None, idempotency_key: str | None = None,
                   delay: float | timedelta | None = None, run_at: datetime | float | None = None,
                   timeout_millis: int | None = None, result_ttl_millis: int | None = None,
                   concurrency_key: str | None = None, unique_key: str | None = None) -> m.SubmitJob:
    """The SUBMIT_JOB that ``submit`` sends (``schedule_millis`` checks the times; the
    other types are checked when it is framed)."""
    if isinstance(priority, Priority):
        priority = priority.value
    run_at_millis, delay_millis = schedule_millis(delay, run_at)
    return m.SubmitJob(task_type, payload, max_attempts, idempotency_key, priority,
                       run_at_millis=run_at_millis, delay_millis=delay_millis, timeout_millis=timeout_millis,
                       result_ttl_millis=result_ttl_millis, concurrency_key=concurrency_key, unique_key=unique_key)


# A limit's fields (CONTRACT, "Limits"): the counts are whole numbers, the rates numbers.
LIMIT_COUNTS = ("maxRunning", "maxRunningPerKey", "burst")
LIMIT_RATES = ("ratePerSecond", "ratePerKeyPerSecond")


def limit_put_request(task_type: str, max_running: int | None = None, max_running_per_key: int | None = None,
                      rate_per_second: float | None = None, burst: int | None = None,
                      rate_per_key_per_second: float | None = None, paused: bool | None = None) -> m.LimitPut:
    """The LIMIT_PUT that ``limits.put`` sends: every limit of the type, None for none;
    ``paused`` None keeps the type's pause as it is. ``TypeError`` for a count that is not
    an int or a rate that is not a number, ``ValueError`` for a rate that is not finite
    (the coordinator judges the values: a negative count, a rate <= 0)."""
    if not isinstance(task_type, str):
        raise TypeError("task_type must be a str, got %r" % (task_type,))
    limit: dict[str, Any] = {"taskType": task_type, "maxRunning": max_running,
                             "maxRunningPerKey": max_running_per_key, "ratePerSecond": rate_per_second,
                             "burst": burst, "ratePerKeyPerSecond": rate_per_key_per_second}
    for name in LIMIT_COUNTS:
        value = limit[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError("%s must be an int or None, got %r" % (name, value))
    for name in LIMIT_RATES:
        value = limit[name]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("%s must be a number of starts a second or None, got %r" % (name, value))
        if not math.isfinite(value):
            raise ValueError("%s must be finite, got %r" % (name, value))
    if paused is not None:
        if not isinstance(paused, bool):
            raise TypeError("paused must be a bool or None, got %r" % (paused,))
        limit["paused"] = paused
    return m.LimitPut(limit)


def purge_request(older_than_millis: int, limit: int | None, dry_run: bool) -> m.PurgeJobs:
    """The PURGE_JOBS that ``purge`` sends; ``ValueError`` for a negative age or limit."""
    request = m.PurgeJobs(older_than_millis, limit, dry_run)
    request.check_types()
    if older_than_millis < 0 or (limit is not None and limit < 1):
        raise ValueError("older_than_millis must be >= 0 and limit >= 1, got %r, %r" % (older_than_millis, limit))
    return request


def may_resend(failure: CoordinatorUnavailable, idempotent: bool, reused: bool, after_refusal: bool,
               several_addresses: bool) -> bool:
    """Whether a request whose first sending failed with ``failure`` goes again (module
    docstring): ``reused``, the connection had carried requests before it; ``after_refusal``,
    the last reply on it was an ERROR."""
    if isinstance(failure, NotConnected):
        return False  # nothing was sent, and no address took the connection
    if isinstance(failure, ClosedUnanswered):
        # A request safe to repeat rides through the coordinator's going away (a restart,
        # a takeover). The coordinator also closes a connection right after refusing a
        # malformed request and reads nothing more on it; a close seen after an ERROR is
        # that one, so the request was never read and any request goes again.
        return idempotent or (reused and after_refusal)
    # No reply in time, or none that made sense: a request safe to repeat goes again
    # when a reused connection may have died while idle, or when another address may be
    # a standby that has taken over; a write's outcome is unknown, so it does not.
    return idempotent and (reused or several_addresses)


def dropped_at_once(answered: bool, seconds: float, connect_timeout: float) -> bool:
    """Whether a connection closed ``seconds`` after the request was sent on it was closed
    at once: it has answered nothing, and the close came within ``DROP_AT_ONCE_SECONDS``
    (at most ``connect_timeout``): a refusal of this client rather than a coordinator
    going away while the request was pending."""
    return not answered and seconds < min(connect_timeout, DROP_AT_ONCE_SECONDS)


class Failover:
    """The rounds of sending a request again after its connection was ``lost``: while no
    address takes the connection, again after ``submit_backoff``, for up to ``timeout``
    seconds after the loss. A request safe to repeat (``ride``) whose connection is lost
    again has had another loss, which opens a window of its own; except that
    ``DROPS_AT_ONCE`` connections in a row that the coordinator closed on the request at
    once, without having answered anything, end it: it will not take this request (a
    TLS port drops a plaintext client so). A round in which no address took the
    connection, or a drop by another address than the last, starts that count again: the
    coordinator that dropped the request went away (killed, restarting, a standby taking
    over) rather than refused it, as coordinators killed again soon after each restart
    or takeover do. ``clock``: monotonic seconds."""

    def __init__(self, lost: CoordinatorUnavailable, timeout: float, clock: Callable[[], float]) -> None:
        self._timeout = timeout
        self._clock = clock
        self._deadline = clock() + timeout
        dropped = isinstance(lost, ClosedUnanswered) and lost.at_once
        self._drops = 1 if dropped else 0
        self._dropped_by = lost.address if isinstance(lost, ClosedUnanswered) else None  # whose drops count
        self._rounds = 0

    def pause(self, failure: NotConnected | ClosedUnanswered, ride: bool) -> float:
        """Seconds to wait before the next sending after ``failure``; raises ``failure``
        when the request is not to go again."""
        if isinstance(failure, ClosedUnanswered):
            if not ride:
                raise failure
            if failure.at_once:
                self._drops = self._drops + 1 if failure.address == self._dropped_by else 1
                self._dropped_by = failure.address
                if self._drops >= DROPS_AT_ONCE:
                    raise failure
            else:
                self._drops = 0
                self._deadline = self._clock() + self._timeout
        else:
            self._drops = 0  # no address took it: gone, not refusing
        self._rounds += 1
        pause = submit_backoff(self._rounds)
        if self._clock() + pause > self._deadline:
            raise failure
        return pause


class WaitChunks:
    """The WAIT_JOBs of one ``wait`` (WAIT_WORKFLOWs with ``workflow``): called, the next
    one, asking for at most ``WAIT_CHUNK_MILLIS`` or the time left of ``timeout`` seconds
    (None: no limit). It is made anew for each sending, so that one sent again after a
    lost connection asks for the time left then. ``clock``: monotonic seconds. A
    ``watch``ed wait asks at once first (0 ms), then for ``WATCH_MILLIS`` at a time, so
    its caller sees the job about once a second."""

    def __init__(self, job_id: str, timeout: float | None, clock: Callable[[], float], watch: bool = False,
                 workflow: bool = False) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self._clock = clock
        self._deadline = None if timeout is None else clock() + max(timeout, 0.0)
        self._last = False  # whether the request made last asks for all the time left
        self._watch = watch
        self._first = watch  # a watched wait shows the job at once
        self._workflow = workflow

    def __call__(self) -> m.WaitJob | m.WaitWorkflow:
        chunk = WAIT_CHUNK_MILLIS if not self._watch else 0 if self._first else WATCH_MILLIS
        if self._deadline is not None:
            left = max(0, math.ceil((self._deadline - self._clock()) * 1000))
            self._last = left <= chunk
            chunk = min(chunk, left)
        return m.WaitWorkflow(self.job_id, chunk) if self._workflow else m.WaitJob(self.job_id, chunk)

    def settled(self, reply: m.Workflow) -> bool:
        """Whether a WORKFLOW a wait brought ends the wait: the workflow has ended, or the
        time is up (its pages are fetched then, and ``ended`` says which)."""
        return reply.state in _TERMINAL_NAMES or self._last

    def ended(self, workflow: dict[str, Any]) -> dict[str, Any]:
        """The whole workflow of a settled wait, once it ended; else ``WorkflowWaitTimeout``."""
        found = self.outcome(workflow)
        assert found is not None, "asked of a wait not settled"
        return found

    def outcome(self, job: dict[str, Any]) -> dict[str, Any] | None:
        """The snapshot (or workflow) a reply brought, once it ended; None to ask again;
        ``WaitTimeout`` (``WorkflowWaitTimeout``) when the time is up."""
        if job.get("state") in _TERMINAL_NAMES:
            return job
        if self._last:
            timeout = self.timeout if self.timeout is not None else 0.0
            raise (WorkflowWaitTimeout if self._workflow else WaitTimeout)(self.job_id, timeout, job)
        self._first = False
        return None


# The requests whose reply may take their wait (``timeoutMillis``) plus the reply timeout.
WAITS = (m.WaitJob, m.WaitWorkflow)


def reply_timeout(request: m.Message, timeout: float) -> float:
    """Seconds to wait for the reply to ``request``: ``timeout``, plus a wait's own."""
    return timeout + request.timeout_millis / 1000.0 if isinstance(request, WAITS) else timeout


class SubmittedWorkflow(NamedTuple):
    """What ``submit_workflow`` returns: the workflow's id and each job's, by ref."""

    workflow_id: str
    job_ids: dict[str, str]


# A step or shape of jobmesh.canvas, or a list of job objects in the wire's shape.
WorkflowJobs = canvas.Node | list[dict[str, Any]] | tuple[dict[str, Any], ...]
# What a workflow's job object may hold: a submit's fields, its ref and the refs it depends on.
WORKFLOW_JOB_FIELDS = frozenset(["ref", "dependsOn"] + [field.metadata["wire"] for field in dataclasses.fields(m.SubmitJob)
                                                         if "wire" in field.metadata])


def workflow_request(jobs: WorkflowJobs, name: str | None = None, idempotency_key: str | None = None
                     ) -> m.SubmitWorkflow:
    """The SUBMIT_WORKFLOW that ``submit_workflow`` sends. ``jobs``: a shape of
    ``jobmesh.canvas`` (each step becomes a job as ``submit`` would make it, with its ref
    and ``dependsOn``), or job objects as the wire has them (``{ref, taskType, payload,
    dependsOn?, ...}``, sent as they are). ``idempotency_key`` gives each job without a key
    of its own the key ``KEY:REF``. ``CanvasError`` for a shape that cannot be a workflow
    (or a list of more than 10,000 jobs), ``TypeError`` for an option of a wrong type."""
    if isinstance(jobs, (canvas.Step, canvas.Chain, canvas.Group)):
        wire_jobs = [_step_job(job) for job in canvas.compile_jobs(jobs)]
    elif isinstance(jobs, (list, tuple)):
        canvas.check_size(len(jobs))
        for job in jobs:
            if not isinstance(job, dict):
                raise TypeError("a workflow's jobs are dicts (or give a jobmesh.canvas shape), got %s"
                                % type(job).__name__)
            unknown = sorted(str(field) for field in set(job) - WORKFLOW_JOB_FIELDS)
            if unknown:  # a misspelt dependsOn would run the job at once: say so before sending
                raise canvas.CanvasError("job %s: unknown field%s %s; a job has ref, dependsOn and a submit's fields (%s)"
                                         % (m.quote(job.get("ref")), "s" if len(unknown) > 1 else "",
                                            ", ".join(map(m.quote, unknown)), ", ".join(sorted(WORKFLOW_JOB_FIELDS))))
        wire_jobs = [dict(job) for job in jobs]
    else:
        raise TypeError("a workflow is a jobmesh.canvas shape or a list of job dicts, got %s" % type(jobs).__name__)
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str):
            raise TypeError("idempotency_key must be a str, got %r" % (idempotency_key,))
        for job in wire_jobs:
            if job.get("idempotencyKey") is None and isinstance(job.get("ref"), str):
                job["idempotencyKey"] = "%s:%s" % (idempotency_key, job["ref"])
    return m.SubmitWorkflow(wire_jobs, name)


def _step_job(job: canvas.CompiledJob) -> dict[str, Any]:
    """A compiled step as a job object: its SUBMIT_JOB's fields (those set), ref and dependsOn."""
    request = submit_request(job.step.task_type, job.step.payload, **job.step.submit_options())
    request.check_types()
    fields = {name: value for name, value in request.to_wire().items()
              if value is not None and name != "type" and not (name == "maxAttempts" and value == 0)}
    fields["ref"] = job.ref
    if job.depends_on:
        fields["dependsOn"] = list(job.depends_on)
    return fields


def resends_workflow(request: m.SubmitWorkflow) -> bool:
    """Whether the SUBMIT_WORKFLOW is safe to send again: every job carries a key."""
    return all(isinstance(job, dict) and isinstance(job.get("idempotencyKey"), str) for job in request.jobs)


class WorkflowPages:
    """A WORKFLOW whose ``jobs`` come in pages: ``next_request`` asks for the next page
    (None once every job is in), ``add`` takes it, ``whole`` is the workflow with every job
    (state and name as the first reply said)."""

    def __init__(self, first: m.Workflow) -> None:
        self.first = first
        self.jobs = list(first.jobs)
        self.cursor = first.next_cursor

    def next_request(self) -> m.WorkflowStatus | None:
        return None if self.cursor is None else m.WorkflowStatus(self.first.workflow_id, self.cursor)

    def add(self, page: m.Workflow) -> None:
        self.jobs.extend(page.jobs)
        self.cursor = page.next_cursor

    def whole(self) -> dict[str, Any]:
        return {"workflowId": self.first.workflow_id, "name": self.first.name, "state": self.first.state,
                "jobs": self.jobs}


class CoordinatorClient:
    """Blocking client; use as a context manager or call ``close()``.

    ``host``: ``HOST``, ``HOST:PORT``, several of those separated by commas, or a list of
    them (an entry without a port takes ``port``); when not given, ``$JOBMESH_COORDINATOR``,
    else 127.0.0.1. ``ValueError`` for an address that is not HOST:PORT (an IPv6 host in
    brackets: ``[::1]:7071``). ``connect_timeout`` (per address), ``timeout`` and
    ``failover_timeout`` are seconds: ``timeout`` bounds each reply, and
    ``failover_timeout`` how long after a lost connection a request safe to repeat
    waits for an address to take it again before ``CoordinatorUnavailable``.
    ``token``: for a coordinator with ``--auth-file``, sent as AUTH first on each
    connection; a refused token raises ``RequestFailed("authentication failed")``.
    Without one, such a coordinator answers ``authentication required``.

    TLS: ``tls=True`` verifies the coordinator against the system's CAs, ``tls_ca=PEM``
    against the certificates in that file (either turns TLS on), and ``tls_cert``/``tls_key``
    present a client certificate; or pass a ready ``ssl.SSLContext`` as ``tls``. The
    coordinator's certificate must carry ``host`` (a DNS name, or an IP address in its
    subjectAltName). Certificate files are read here, once: ``ConfigError`` if they
    cannot be. A handshake that fails is ``CoordinatorUnavailable``.
    """

    def __init__(
        self,
        host: str | Sequence[str | Address] | None = None,
        port: int = DEFAULT_PORT,
        connect_timeout: float = CONNECT_TIMEOUT,
        timeout: float = 30.0,
        token: str | None = None,
        *,
        failover_timeout: float = FAILOVER_TIMEOUT,
        tls: bool | ssl.SSLContext = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.addresses = coordinator_addresses(host, port)
        self._at = 0  # the index of the address connected to, or to try first
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.failover_timeout = failover_timeout
        self._token = token  # sent as AUTH first on each connection (a coordinator with --auth-file)
        self.tls = tls_context(tls, tls_ca, tls_cert, tls_key)
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._lock = threading.RLock()  # re-entered when a fresh connection authenticates (close on a bad reply)
        self._refused = False  # the last reply was an ERROR (after which the coordinator may close)
        self._answered = False  # the connection has carried a reply
        self.schedules = Schedules(self)
        self.limits = Limits(self)

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "CoordinatorClient(%s)" % joined(self.addresses)

    @property
    def address(self) -> Address:
        """The address connected to (or, between connections, the one tried first)."""
        return self.addresses[self._at]

    @property
    def host(self) -> str:
        return self.address.host

    @property
    def port(self) -> int:
        return self.address.port

    def close(self) -> None:
        with self._lock:
            self._discard()

    # ---- requests ---------------------------------------------------------------------

    def submit(
        self,
        task_type: str,
        payload: dict[str, Any],
        max_attempts: int = 0,
        priority: str | Priority | None = None,
        idempotency_key: str | None = None,
        submit_retries: int = 0,
        delay: float | timedelta | None = None,
        run_at: datetime | float | None = None,
        timeout_millis: int | None = None,
        result_ttl_millis: int | None = None,
        concurrency_key: str | None = None,
        unique_key: str | None = None,
    ) -> str:
        """Submit a job and return its jobId.

        ``max_attempts <= 0`` takes the coordinator's default. With ``submit_retries=N``, a
        retryable SUBMIT_REJECTED is retried up to N times with jittered, capped backoff;
        the last rejection is raised. Raises ``RequestFailed`` for an invalid request.

        A scheduled job runs no earlier than ``delay`` (seconds, or a ``timedelta``) from now,
        or than ``run_at`` (an aware ``datetime``, or epoch seconds); it is SCHEDULED until then.
        Give at most one; a naive datetime or a negative time raises ``ValueError`` before
        anything is sent.

        ``timeout_millis`` is this job's per-attempt deadline (1 ms to 7 days; None: its task
        type's, else the coordinator's); ``result_ttl_millis`` purges the job, timeline and
        all, that long after it ends (None: the coordinator's retention).

        ``concurrency_key``: the key the type's per-key limits count the job under (README.md,
        "Limits"). ``unique_key``: while a job of the type with that key is not finished,
        nothing is created and that job's id is returned (``send_submit`` says which).
        """
        request = submit_request(task_type, payload, max_attempts, priority, idempotency_key, delay, run_at,
                                 timeout_millis, result_ttl_millis, concurrency_key, unique_key)
        return self.send_submit(request, submit_retries).job_id

    def send_submit(self, request: m.SubmitJob, submit_retries: int = 0) -> m.JobSubmitted:
        """Send a SUBMIT_JOB made by ``submit_request`` (``submit``'s arguments) and return
        the JOB_SUBMITTED itself: ``.job_id``, and ``.duplicate``, true when a job with the
        ``unique_key`` was active and nothing was made. ``submit_retries`` as for ``submit``."""
        retry = 0
        while True:
            try:
                # A keyed submit is safe to send again: the coordinator answers a repeat
                # with the job the key already made.
                return self._request(request, m.JobSubmitted, idempotent=request.idempotency_key is not None)
            except SubmitRejected as exc:
                if not exc.retryable or retry >= submit_retries:
                    raise
                retry += 1
                time.sleep(submit_backoff(retry))

    def status(self, job_id: str) -> dict[str, Any]:
        """The job's snapshot; ``RequestFailed`` for an unknown id."""
        return self._request(m.GetJobStatus(job_id), m.JobStatus, idempotent=True).job

    def list_jobs(
        self,
        limit: int | None = None,
        state: str | JobState | None = None,
        cursor: str | None = None,
        task_type: str | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of snapshots, newest first, and the cursor of the next page (None at the end).

        ``state`` and ``task_type`` (exact, case-sensitive) filter the jobs.
        """
        if isinstance(state, JobState):
            state = state.value
        reply = self._request(m.ListJobs(limit, state, cursor, task_type), m.JobList, idempotent=True)
        return reply.jobs, reply.next_cursor

    def iter_jobs(
        self, state: str | JobState | None = None, page_size: int | None = None, task_type: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every job (optionally in one state, of one task type), newest first, fetched page by page."""
        cursor = None
        while True:
            jobs, cursor = self.list_jobs(page_size, state, cursor, task_type)
            yield from jobs
            if cursor is None:
                return

    def workers(self) -> list[dict[str, Any]]:
        """The live workers: ``workerId``, ``capacity``, ``activeJobs``, ``lastHeartbeatMillis``."""
        return self._request(m.ListWorkers(), m.WorkerList, idempotent=True).workers

    def stats(self) -> m.Stats:
        """The coordinator's figures (GET_STATS): jobs by state, counters since it started,
        workers and slots; answered from counters, without listing any job."""
        return self._request(m.GetStats(), m.Stats, idempotent=True)

    def cancel(self, job_id: str) -> tuple[bool, dict[str, Any]]:
        """Cancel a job: (True, snapshot) if this call cancelled it, (False, snapshot) if it had ended."""
        reply = self._request(m.CancelJob(job_id), m.JobCancel)
        return reply.cancelled, reply.job

    def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's timeline, oldest first: dicts ``{atMillis, event, ...}`` with ``attempt``,
        ``attemptId``, ``workerId``, ``detail``, ``retryAtMillis`` where they apply.
        ``RequestFailed`` for an unknown id."""
        return self._request(m.GetJobEvents(job_id), m.JobEvents, idempotent=True).events

    def payload(self, job_id: str) -> dict[str, Any] | None:
        """The payload the job was submitted with (None for a Periodic job, whose workload
        is bytes); ``RequestFailed`` for an unknown id."""
        return self._request(m.GetJobPayload(job_id), m.JobPayload, idempotent=True).payload

    def retry(self, job_id: str) -> str:
        """Submit a finished job again (same type, payload, priority and attempt budget) and
        return the new jobId; its snapshot's ``retryOf`` is ``job_id``.

        ``RequestFailed`` if the job is unknown or not finished; ``SubmitRejected`` at the
        admission limit (never retried here: call again after a backoff).
        """
        return self._request(m.RetryJob(job_id), m.JobSubmitted).job_id

    def purge(self, older_than_millis: int, limit: int | None = None, dry_run: bool = False) -> tuple[int, bool]:
        """Delete up to ``limit`` (coordinator default and cap: 10,000) finished jobs last updated
        more than ``older_than_millis`` ago, with their events. Returns ``(purged, more)``;
        ``more`` means such jobs remain: call again. With ``dry_run`` nothing is deleted and
        ``purged`` is how many would have been (``more``: at least that many).
        ``ValueError`` for a negative age or limit."""
        reply = self._request(purge_request(older_than_millis, limit, dry_run), m.JobsPurged)
        return reply.purged, reply.more

    def wait(self, job_id: str, timeout: float | None = None,
             on_snapshot: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """Wait until the job is COMPLETED, FAILED or CANCELLED and return that snapshot.

        No polling: each WAIT_JOB is answered by the coordinator the moment the job ends,
        or after at most ``WAIT_CHUNK_MILLIS`` (then it is asked again), so a long wait
        costs one request a minute. ``timeout`` is seconds (None: no limit); when it
        passes, ``WaitTimeout`` (a ``TimeoutError``) is raised with the snapshot as it
        stood. ``RequestFailed`` for an unknown id. The reply timeout of each request is
        its wait plus the client's ``timeout``; meanwhile other threads sharing this
        client wait for the socket. A wait rides through its coordinator's restart or a
        standby's takeover (``failover_timeout``), asking again for the time left.

        ``on_snapshot`` watches the job meanwhile: it is called with the snapshot at once
        and then about once a second (``WATCH_MILLIS``) until the job ends, e.g. to show
        its ``progress``.
        """
        asks = WaitChunks(job_id, timeout, time.monotonic, watch=on_snapshot is not None)
        while True:
            snapshot = self._request(asks, m.JobStatus, idempotent=True).job
            job = asks.outcome(snapshot)
            if job is not None:
                return job
            if on_snapshot is not None:
                on_snapshot(snapshot)

    # ---- workflows ---------------------------------------------------------------------

    def submit_workflow(self, jobs: WorkflowJobs, name: str | None = None, *,
                        idempotency_key: str | None = None) -> SubmittedWorkflow:
        """Submit a workflow: a ``jobmesh.canvas`` shape (``chain``, ``group``, ``chord``, a
        ``step``) or a list of job objects in the wire's shape; every job is created in one
        commit, or none. Returns ``(workflow_id, {ref: job_id})``.

        ``idempotency_key`` gives each job the key ``KEY:REF`` (unless it has one): the
        submit is then safe to send again after a lost connection, and a repeat with the same
        key answers the workflow it made. ``RequestFailed`` for a bad job, an unknown ref or a
        cycle (nothing is created); ``SubmitRejected`` at the admission limit (never retried
        here); ``CanvasError`` for a shape that cannot be sent."""
        request = workflow_request(jobs, name, idempotency_key)
        reply = self._request(request, m.WorkflowSubmitted, idempotent=resends_workflow(request))
        return SubmittedWorkflow(reply.workflow_id, dict(reply.job_ids))

    def workflow_status(self, workflow_id: str) -> dict[str, Any]:
        """The workflow: ``workflowId``, ``name``, ``state`` (RUNNING until every job has
        ended, then COMPLETED, FAILED or CANCELLED) and ``jobs``, each ``{ref, jobId, state,
        dependsOn}``, all of them (fetched a page at a time). ``RequestFailed`` for an
        unknown id."""
        return self._whole(self._request(m.WorkflowStatus(workflow_id), m.Workflow, idempotent=True))

    def cancel_workflow(self, workflow_id: str) -> dict[str, Any]:
        """Cancel every job of the workflow that has not ended; returns the workflow after."""
        return self._whole(self._request(m.WorkflowCancel(workflow_id), m.Workflow))

    def wait_workflow(self, workflow_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Wait until every job of the workflow has ended and return the workflow (as
        ``workflow_status``), as ``wait`` waits for a job: WAIT_WORKFLOW, asked again each
        ``WAIT_CHUNK_MILLIS``; ``WorkflowWaitTimeout`` (a ``WaitTimeout``) with the workflow
        as it stood once ``timeout`` seconds (None: no limit) have passed."""
        asks = WaitChunks(workflow_id, timeout, time.monotonic, workflow=True)
        while True:
            reply = self._request(asks, m.Workflow, idempotent=True)
            if asks.settled(reply):
                return asks.ended(self._whole(reply))

    def _whole(self, reply: m.Workflow) -> dict[str, Any]:
        pages = WorkflowPages(reply)
        while (ask := pages.next_request()) is not None:
            pages.add(self._request(ask, m.Workflow, idempotent=True))
        return pages.whole()

    def request(self, request: m.Message, expect: type, idempotent: bool = False) -> Any:
        """Send any client-port request and return its reply of type ``expect`` (errors as
        for the other methods; ``idempotent``: safe to repeat, it may go again on a fresh
        connection)."""
        return self._request(request, expect, idempotent)

    # ---- transport --------------------------------------------------------------------

    def _request(self, request: m.Message | Callable[[], m.Message], expect: type, idempotent: bool = False) -> Any:
        """One request, one reply (``request`` may be a function that makes it, called
        again for each sending). Only the public ``CoordinatorUnavailable`` leaves here."""
        make: Callable[[], m.Message] = request if callable(request) else (lambda: request)
        with self._lock:
            try:
                sent, obj = self._send(make, idempotent)
            except CoordinatorUnavailable as exc:
                if type(exc) is CoordinatorUnavailable:
                    raise
                raise CoordinatorUnavailable(str(exc)) from exc.__cause__ or exc
            self._refused = obj.get("type") == m.Error.TYPE
        return self._reply(sent, obj, expect)

    def _send(self, make: Callable[[], m.Message], idempotent: bool) -> tuple[m.Message, dict[str, Any]]:
        """The request sent and its reply, sent again where that is safe (module docstring)."""
        after_refusal = self._refused
        if after_refusal and self._sock is not None and self._peer_closed():
            self._discard()  # closed after the refusal, and nothing sent yet: go on a fresh one
        reused = self._sock is not None
        request = make()
        try:
            return request, self._exchange(request)
        except CoordinatorUnavailable as exc:
            if not may_resend(exc, idempotent, reused, after_refusal, len(self.addresses) > 1):
                raise
            return self._resend(make, idempotent, exc)

    def _resend(self, make: Callable[[], m.Message], ride: bool, lost: CoordinatorUnavailable
                ) -> tuple[m.Message, dict[str, Any]]:
        """Send the request again on a fresh connection, from the address after the one
        lost (the same one when it is the only one: a restarted coordinator comes back
        there), in the rounds of a ``Failover`` (``ride``: a request safe to repeat)."""
        failover = Failover(lost, self.failover_timeout, time.monotonic)
        while True:
            request = make()
            try:
                return request, self._exchange(request)
            except (NotConnected, ClosedUnanswered) as exc:
                time.sleep(failover.pause(exc, ride))

    def _reply(self, request: m.Message, obj: dict[str, Any], expect: type) -> Any:
        """The reply ``obj`` to ``request`` if it is an ``expect``; else the error it means."""
        try:
            return read_reply(request, obj, expect, self.address)
        except BadReply as exc:
            self.close()
            raise CoordinatorUnavailable(str(exc)) from exc.__cause__ or exc

    def _exchange(self, request: m.Message) -> dict[str, Any]:
        """Send one frame, read one frame; any transport trouble discards the socket. A
        WAIT_JOB's reply may take its wait plus ``timeout``."""
        frame = encode_request(request)
        if self._sock is None:
            self._connect()
        where = self.address
        assert self._sock is not None and self._reader is not None
        timeout = reply_timeout(request, self.timeout)
        if timeout != self.timeout:
            self._sock.settimeout(timeout)
        sent_at = time.monotonic()
        try:
            self._sock.sendall(frame)
            obj = self._reader.read_frame()
            if timeout != self.timeout:
                self._sock.settimeout(self.timeout)
        except socket.timeout as exc:
            self._lost()
            raise CoordinatorUnavailable("no reply from %s within %.3gs" % (where, timeout)) from exc
        except (ConnectionResetError, BrokenPipeError) as exc:  # a closed peer, as EOF is
            raise self._closed_unanswered("connection to %s lost: %s" % (where, exc), sent_at) from exc
        except (OSError, ProtocolError) as exc:
            self._lost()
            raise CoordinatorUnavailable("connection to %s lost: %s" % (where, exc)) from exc
        if obj is None:
            raise self._closed_unanswered("%s closed the connection without replying" % where, sent_at)
        self._answered = True
        return obj

    def _closed_unanswered(self, message: str, sent_at: float) -> ClosedUnanswered:
        """The coordinator closed the connection on the request sent at ``sent_at`` without
        answering it: the socket is discarded, and this is the error to raise."""
        address = self.address
        at_once = dropped_at_once(self._answered, time.monotonic() - sent_at, self.connect_timeout)
        self._lost()
        return ClosedUnanswered(message, at_once, address)

    def _peer_closed(self) -> bool:
        """Whether the coordinator has closed the idle connection (seen without blocking;
        asked only after an ERROR reply, so other requests pay nothing for it)."""
        assert self._sock is not None
        if isinstance(self._sock, ssl.SSLSocket):
            # A TLS socket takes no recv flags: peek at the TCP stream under it (the
            # coordinator closes without a TLS close_notify, so its close is the stream's end).
            raw = socket.socket(self._sock.family, self._sock.type, self._sock.proto, fileno=self._sock.fileno())
            try:
                return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True
            finally:
                raw.detach()
        try:
            self._sock.settimeout(0.0)
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, socket.timeout):
            return False
        except OSError:  # e.g. reset by the peer
            return True
        finally:
            self._sock.settimeout(self.timeout)

    def _connect(self) -> None:
        """Connect to the first address that answers, from ``_at`` round the list."""
        try:
            self._at, sock = first_reachable(self.addresses, self._at, self._open, (OSError, TlsFailed))
        except AllFailed as exc:
            raise NotConnected("cannot connect to %s" % exc) from exc.failures[-1][1]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        self._sock = sock
        self._reader = FrameReader(sock.recv)
        self._answered = False
        if self._token is not None:
            self._authenticate()

    def _open(self, address: Address) -> socket.socket:
        """A connection to ``address``, after the TLS handshake when TLS is on."""
        sock = socket.create_connection((address.host, address.port), timeout=self.connect_timeout)
        if self.tls is not None:
            sock.settimeout(HANDSHAKE_SECONDS)  # what the coordinator allows the handshake
            try:
                sock = secure(sock, self.tls, address.host)
            except OSError as exc:
                raise TlsFailed("TLS handshake failed: %s" % tls_reason(exc)) from exc
        return sock

    def _authenticate(self) -> None:
        """AUTH on a fresh connection (``_exchange`` connects, then calls this);
        ``RequestFailed`` if the coordinator refuses the token (it closes the connection)."""
        request = m.Auth(self._token or "")
        try:
            self._reply(request, self._exchange(request), m.AuthOk)
        except RequestFailed:
            self._discard()
            raise

    def _lost(self) -> None:
        """The connection failed: discard it; the next one starts with the next address."""
        self._discard()
        self._at = (self._at + 1) % len(self.addresses)

    def _discard(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None
        self._reader = None


def _millis(value: float | timedelta | None, name: str) -> int | None:
    """Seconds (a number or a ``timedelta``) as whole milliseconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value // _MILLISECOND
    return _seconds_to_millis(value, name)


def schedule_put_request(name: str, task_type: str, payload: dict[str, Any] | None, *, cron: str | None,
                         every: float | timedelta | None, timezone: str, missed: str, overlap: str,
                         jitter: float | timedelta, catchup_window: float | timedelta | None,
                         priority: str | Priority | None, max_attempts: int, paused: bool) -> m.SchedulePut:
    """The SCHEDULE_PUT that ``schedules.put`` sends (times in seconds or timedeltas)."""
    schedule: dict[str, Any] = {
        "name": name, "taskType": task_type, "payload": payload or {}, "timezone": timezone, "missed": missed,
        "overlap": overlap, "jitterMillis": _millis(jitter, "jitter"), "maxAttempts": max_attempts,
        "paused": paused, "priority": priority.value if isinstance(priority, Priority) else priority}
    if cron is not None:
        schedule["cron"] = cron
    if every is not None:
        schedule["everyMillis"] = _millis(every, "every")
    if catchup_window is not None:
        schedule["catchupWindowMillis"] = _millis(catchup_window, "catchup_window")
    return m.SchedulePut(schedule)


def preview_request(cron: str | None, every: float | timedelta | None, timezone: str,
                    start: datetime | float | None, count: int) -> m.SchedulePreview:
    """The SCHEDULE_PREVIEW that ``schedules.preview`` sends."""
    from_millis = None
    if start is not None:
        from_millis, _ = schedule_millis(None, start)
    return m.SchedulePreview(cron=cron, every_millis=_millis(every, "every"), timezone=timezone,
                             from_millis=from_millis, count=count)


def fire_times(reply: m.SchedulePreview, timezone: str) -> list[datetime]:
    """A preview's fire times as aware datetimes in ``timezone``."""
    zone = ZoneInfo(timezone)
    return [(EPOCH + timedelta(milliseconds=t)).astimezone(zone) for t in reply.fire_times]


class Schedules:
    """``client.schedules``: recurring schedules (README.md, "Recurring schedules").

    Schedules are returned as the wire dicts (``name``, ``cron``, ``everyMillis``,
    ``nextFireMillis``, ``firedCount`` ...). ``RequestFailed`` for bad input or an
    unknown name; nothing is changed then."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client

    def put(self, name: str, task_type: str, payload: dict[str, Any] | None = None, *, cron: str | None = None,
            every: float | timedelta | None = None, timezone: str = "UTC", missed: str = "latest",
            overlap: str = "skip", jitter: float | timedelta = 0, catchup_window: float | timedelta | None = None,
            priority: str | Priority | None = None, max_attempts: int = 0, paused: bool = False) -> dict[str, Any]:
        """Create or replace the schedule ``name`` (fire times already made are not made
        again) and return it. Give ``cron`` (five fields or @daily ..., wall-clock times in
        ``timezone``) or ``every`` (seconds or a ``timedelta``, at least one second).
        ``jitter`` and ``catchup_window`` are seconds or timedeltas."""
        request = schedule_put_request(name, task_type, payload, cron=cron, every=every, timezone=timezone,
                                       missed=missed, overlap=overlap, jitter=jitter, catchup_window=catchup_window,
                                       priority=priority, max_attempts=max_attempts, paused=paused)
        return self.client.request(request, m.Schedule).schedule

    def get(self, name: str) -> dict[str, Any]:
        """The schedule, with ``recentJobs`` (its last jobs: jobId, scheduledFor, state)."""
        return self.client.request(m.ScheduleGet(name), m.Schedule, idempotent=True).schedule

    def list(self) -> list[dict[str, Any]]:
        """Every schedule, by name (fetched a page at a time)."""
        out: list[dict[str, Any]] = []
        after = None
        while True:
            reply = self.client.request(m.ScheduleList(after=after), m.ScheduleList, idempotent=True)
            out.extend(reply.schedules)
            after = reply.next_after
            if after is None:
                return out

    def pause(self, name: str) -> dict[str, Any]:
        return self.client.request(m.SchedulePause(name), m.Schedule).schedule

    def resume(self, name: str) -> dict[str, Any]:
        """Fire times that passed while paused make no job."""
        return self.client.request(m.ScheduleResume(name), m.Schedule).schedule

    def delete(self, name: str) -> dict[str, Any]:
        """Delete the schedule (its jobs stay); returns its last state."""
        return self.client.request(m.ScheduleDelete(name), m.Schedule).schedule

    def trigger(self, name: str) -> str:
        """Make a job from the schedule now (outside its overlap rule); returns the jobId."""
        return self.client.request(m.ScheduleTrigger(name), m.JobSubmitted).job_id

    def preview(self, cron: str | None = None, every: float | timedelta | None = None, timezone: str = "UTC",
                start: datetime | float | None = None, count: int = 10) -> builtins.list[datetime]:
        """The next ``count`` fire times after ``start`` (an aware datetime or epoch seconds;
        default now) of a cron expression or interval, as aware datetimes in ``timezone``;
        no schedule is needed."""
        reply = self.client.request(preview_request(cron, every, timezone, start, count), m.SchedulePreview,
                                    idempotent=True)
        return fire_times(reply, timezone)


class Limits:
    """``client.limits``: concurrency and rate limits per task type, and pausing a type
    (README.md, "Limits").

    Limits are returned as the wire dicts: ``taskType``, ``maxRunning``,
    ``maxRunningPerKey``, ``ratePerSecond``, ``burst``, ``ratePerKeyPerSecond`` (None: no
    such limit), ``paused``, and ``running`` and ``queued`` (the type's jobs now).
    ``RequestFailed`` for bad input (nothing is changed then) or a token whose role may
    not (changes need admin, reads reader)."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client

    def put(self, task_type: str, max_running: int | None = None, max_running_per_key: int | None = None,
            rate_per_second: float | None = None, burst: int | None = None,
            rate_per_key_per_second: float | None = None, paused: bool | None = None) -> dict[str, Any]:
        """Create or replace the limits of ``task_type`` (one not given is removed; ``paused``
        None keeps the type's pause) and return them. ``burst``, with ``rate_per_second``:
        starts allowed at once (default: the rate rounded up, at least 1)."""
        request = limit_put_request(task_type, max_running, max_running_per_key, rate_per_second, burst,
                                    rate_per_key_per_second, paused)
        return self.client.request(request, m.Limit).limit

    def get(self, task_type: str) -> dict[str, Any]:
        """The type's limits (all None, not paused, for a type with none)."""
        return self.client.request(m.LimitGet(task_type), m.Limit, idempotent=True).limit

    def list(self) -> builtins.list[dict[str, Any]]:
        """Every type with a limit or a pause."""
        return self.client.request(m.LimitList(), m.LimitList, idempotent=True).limits

    def delete(self, task_type: str) -> dict[str, Any]:
        """Remove every limit of the type, and its pause; returns the last state."""
        return self.client.request(m.LimitDelete(task_type), m.Limit).limit

    def pause(self, task_type: str) -> dict[str, Any]:
        """No job of the type starts until ``resume``; running ones go on, submits are taken."""
        return self.client.request(m.TypePause(task_type), m.Limit).limit

    def resume(self, task_type: str) -> dict[str, Any]:
        return self.client.request(m.TypeResume(task_type), m.Limit).limit
