"""AsyncClient: the client library for asyncio (a FastAPI or aiohttp service, a script
under ``asyncio.run``).

    from jobmesh.aio import AsyncClient

    async with AsyncClient("127.0.0.1:7071") as client:
        job_id = await client.submit("SHA256", {"text": "hello"})
        print((await client.wait(job_id, timeout=30))["result"])

The methods are the blocking ``CoordinatorClient``'s (jobmesh/client/api.py), as
coroutines, with the same arguments, the same results and the same errors:
``CoordinatorUnavailable``, ``RequestFailed``, ``SubmitRejected``, ``TypeError`` and
``InvalidRequest`` before anything is sent, ``WaitTimeout``. The same requests are sent
again through a restart or a takeover (reads, waits and submits with an
``idempotency_key``, for up to ``failover_timeout`` seconds after each lost connection),
and addresses, tokens and TLS are given the same way. It imports nothing of gevent and
patches nothing.

Connections. Every request but a wait goes on one shared connection: each coroutine
writes its request as it makes it, and a reply is matched to its request by order, since
the client port answers every connection's requests in the order they came
(docs/PROTOCOL.md, "Client port"); so one connection serves any number of coroutines at
once, and a reply timed out (``timeout``) or lost fails the requests behind it as well.
The frames that coroutines make in one turn of the event loop go out in one write.
A pending WAIT_JOB (or WAIT_WORKFLOW) holds back the replies to everything sent after it on its connection,
so each wait goes on a connection of its own, kept afterwards for the next wait (at most
``IDLE_WAIT_CONNECTIONS`` of them are kept). Every connection is opened in the running
loop when first needed and sends AUTH first when there is a token.

Cancelling a coroutine (``asyncio.wait_for``, a task's ``cancel()``) leaves its request
sent if it was: the coordinator still applies it, and its reply is skipped. A cancelled
wait closes its connection, which drops the coordinator's wait.

One client serves one event loop at a time; used from another loop (a second
``asyncio.run``), it leaves the first loop's connections and opens new ones.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import os
import ssl
import time
from datetime import datetime, timedelta
from typing import Any, AsyncIterator, Callable, Sequence

from jobmesh.addresses import CONNECT_TIMEOUT, Address, AllFailed, joined
from jobmesh.client.api import (DEFAULT_PORT, FAILOVER_TIMEOUT, WAITS, Failover,
                                SubmittedWorkflow, WaitChunks, WaitTimeout, WorkflowJobs, WorkflowPages, WorkflowWaitTimeout, coordinator_addresses,
                                dropped_at_once, fire_times, limit_put_request, may_resend, preview_request, purge_request,
                                reply_timeout, resends_workflow, schedule_put_request, submit_backoff, submit_request, tls_context,
                                workflow_request)
from jobmesh.client.wire import (BadReply, ClosedUnanswered, NotConnected, TlsFailed, encode_request, read_reply,
                                 tls_reason)
from jobmesh.errors import CoordinatorUnavailable, ProtocolError, SubmitRejected
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameDecoder
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.tls import HANDSHAKE_SECONDS

__all__ = ["AsyncClient", "WaitTimeout", "WorkflowWaitTimeout"]

IDLE_WAIT_CONNECTIONS = 8  # wait connections kept open between waits


class _Connection(asyncio.Protocol):
    """One connection to a client port: requests written in order, each reply handed to the
    oldest request still unanswered. When the connection ends, every request still
    unanswered fails: ``ClosedUnanswered`` when the coordinator closed it (EOF, reset),
    else ``CoordinatorUnavailable`` (a reply timed out or made no sense)."""

    def __init__(self, address: Address, index: int, connect_timeout: float) -> None:
        self.address = address
        self.index = index  # its place in the client's address list
        self.sent = 0  # requests sent on it (AUTH not counted)
        self.answered = False  # it has carried a reply
        self.refused = False  # the last reply on it was an ERROR (after which the coordinator may close)
        self.ended = False
        self._connect_timeout = connect_timeout
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder()
        # (reply, sent at, reply due by, timeout), oldest first; replies come in this order
        self._pending: collections.deque[tuple[asyncio.Future[dict[str, Any]], float, float, float]] = (
            collections.deque())
        self._timer: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None  # while the transport's buffer is full
        self._unsent: list[bytes] = []  # frames of this turn of the loop, written together at its end

    @property
    def usable(self) -> bool:
        return not self.ended and self._transport is not None and not self._transport.is_closing()

    def secured(self, transport: asyncio.Transport) -> None:
        """The TLS transport that replaces the plain one after the handshake."""
        self._transport = transport

    def send(self, frame: bytes, timeout: float) -> asyncio.Future[dict[str, Any]]:
        """Write one request; its reply (the frame's object) arrives in the future."""
        assert self._transport is not None
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        if self.ended:  # ended while its opener handed it over
            future.set_exception(ClosedUnanswered("connection to %s lost" % self.address, False))
            return future
        now = self._loop.time()
        self._pending.append((future, now, now + timeout, timeout))
        if not self._unsent:  # the first of this turn of the loop: written once it ends
            self._loop.call_soon(self._write)
        self._unsent.append(frame)
        if self._timer is None:
            self._arm()
        return future

    def _write(self) -> None:
        """Write the frames the loop's turn made, in one write: many coroutines sending at
        once cost one system call."""
        unsent, self._unsent = self._unsent, []
        if self._transport is not None and not self.ended:
            self._transport.write(b"".join(unsent))

    async def drain(self) -> None:
        """Return once the transport takes more (at once unless the coordinator reads slowly)."""
        if self._writable is not None:
            await asyncio.shield(self._writable)

    def close(self, message: str) -> None:
        """Done with it: every unanswered request fails with ``CoordinatorUnavailable(message)``."""
        self._end(lambda sent_at: CoordinatorUnavailable(message))
        if self._transport is not None:
            self._transport.abort()

    # ---- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._decoder.feed(data)
        try:
            while (obj := self._decoder.next_payload()) is not None:
                if not self._pending:
                    self.close("%s sent a reply to no request" % self.address)
                    return
                future = self._pending.popleft()[0]
                self.answered = True
                self.refused = obj.get("type") == m.Error.TYPE
                if not future.done():  # else its caller was cancelled
                    future.set_result(obj)
        except ProtocolError as exc:
            self.close("connection to %s lost: %s" % (self.address, exc))

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self._decoder.pending:
            self.close("connection to %s lost: connection closed inside a frame" % self.address)
        elif exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            message = ("%s closed the connection without replying" % self.address if exc is None
                       else "connection to %s lost: %s" % (self.address, exc))
            now = self._loop.time()
            self._end(lambda sent_at: ClosedUnanswered(
                message, dropped_at_once(self.answered, now - sent_at, self._connect_timeout), self.address))
        else:
            self.close("connection to %s lost: %s" % (self.address, exc))
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # ---- internals -----------------------------------------------------------------

    def _end(self, error: Callable[[float], CoordinatorUnavailable]) -> None:
        """Fail every unanswered request with ``error(sent_at)`` (once)."""
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            future, sent_at, _, _ = self._pending.popleft()
            if not future.done():
                future.set_exception(error(sent_at))

    def _arm(self) -> None:
        """Time the oldest unanswered request: replies come in order, and every request on
        a connection has the same timeout but waits (alone on theirs), so it is due first."""
        self._timer = self._loop.call_at(self._pending[0][2], self._expire) if self._pending else None

    def _expire(self) -> None:
        if self._pending and self._pending[0][2] <= self._loop.time():
            self.close("no reply from %s within %.3gs" % (self.address, self._pending[0][3]))
        else:
            self._arm()


Sent = tuple[m.Message, dict[str, Any], _Connection]  # a request as sent, its reply, and where it went


class AsyncClient:
    """Client for asyncio; use ``async with`` or ``await close()``.

    ``address``: ``HOST:PORT``, several of those separated by commas, or a list of them
    (an entry without a port takes ``port``); when not given, ``$JOBMESH_COORDINATOR``,
    else 127.0.0.1. ``token``, ``connect_timeout``, ``timeout``, ``failover_timeout`` and
    the TLS arguments are the blocking ``CoordinatorClient``'s (jobmesh/client/api.py).
    Nothing connects here: the first request does, in the running loop.
    """

    def __init__(
        self,
        address: str | Sequence[str | Address] | None = None,
        token: str | None = None,
        *,
        port: int = DEFAULT_PORT,
        connect_timeout: float = CONNECT_TIMEOUT,
        timeout: float = 30.0,
        failover_timeout: float = FAILOVER_TIMEOUT,
        tls: bool | ssl.SSLContext = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self.addresses = coordinator_addresses(address, port)
        self._at = 0  # the index of the address connected to, or to try first
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.failover_timeout = failover_timeout
        self._token = token
        self.tls = tls_context(tls, tls_ca, tls_cert, tls_key)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the connections belong to
        self._conn: _Connection | None = None  # the shared connection
        self._connecting: asyncio.Task[_Connection] | None = None  # opening it, for every caller at once
        self._idle_waits: list[_Connection] = []
        self._busy_waits: set[_Connection] = set()
        self._closes = 0  # close() calls so far: a request failed by one is not sent again
        self.schedules = AsyncSchedules(self)
        self.limits = AsyncLimits(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        return "AsyncClient(%s)" % joined(self.addresses)

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

    async def close(self) -> None:
        """Close every connection; requests still unanswered fail with
        ``CoordinatorUnavailable``. The next request connects again."""
        self._closes += 1
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._leave_loop(loop)
        conns = [self._conn] if self._conn is not None else []
        conns += self._idle_waits + list(self._busy_waits)
        self._conn = None
        self._idle_waits.clear()
        self._busy_waits.clear()
        for conn in conns:
            conn.close("the client was closed")

    # ---- requests ------------------------------------------------------------------

    async def submit(
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
        """Submit a job and return its jobId (as ``CoordinatorClient.submit``: ``submit_retries``
        resubmits after a retryable ``SubmitRejected`` with backoff; ``delay`` or ``run_at``
        schedule it; ``timeout_millis``, ``result_ttl_millis``, ``concurrency_key`` and
        ``unique_key`` as there)."""
        request = submit_request(task_type, payload, max_attempts, priority, idempotency_key, delay, run_at,
                                 timeout_millis, result_ttl_millis, concurrency_key, unique_key)
        return (await self.send_submit(request, submit_retries)).job_id

    async def send_submit(self, request: m.SubmitJob, submit_retries: int = 0) -> m.JobSubmitted:
        """Send a SUBMIT_JOB made by ``submit_request`` and return the JOB_SUBMITTED itself
        (``.job_id``, ``.duplicate``), as ``CoordinatorClient.send_submit``."""
        retry = 0
        while True:
            try:
                # A keyed submit is safe to send again: the coordinator answers a repeat
                # with the job the key already made.
                return await self._request(request, m.JobSubmitted, idempotent=request.idempotency_key is not None)
            except SubmitRejected as exc:
                if not exc.retryable or retry >= submit_retries:
                    raise
            retry += 1
            await asyncio.sleep(submit_backoff(retry))

    async def status(self, job_id: str) -> dict[str, Any]:
        """The job's snapshot; ``RequestFailed`` for an unknown id."""
        return (await self._request(m.GetJobStatus(job_id), m.JobStatus, idempotent=True)).job

    async def list_jobs(
        self,
        limit: int | None = None,
        state: str | JobState | None = None,
        cursor: str | None = None,
        task_type: str | None = None,
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of snapshots, newest first, and the cursor of the next page (None at the end)."""
        if isinstance(state, JobState):
            state = state.value
        reply = await self._request(m.ListJobs(limit, state, cursor, task_type), m.JobList, idempotent=True)
        return reply.jobs, reply.next_cursor

    async def iter_jobs(
        self, state: str | JobState | None = None, page_size: int | None = None, task_type: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Every job (optionally in one state, of one task type), newest first, page by page:
        ``async for job in client.iter_jobs(): ...``."""
        cursor = None
        while True:
            jobs, cursor = await self.list_jobs(page_size, state, cursor, task_type)
            for job in jobs:
                yield job
            if cursor is None:
                return

    async def workers(self) -> list[dict[str, Any]]:
        """The live workers: ``workerId``, ``capacity``, ``activeJobs``, ``lastHeartbeatMillis``."""
        return (await self._request(m.ListWorkers(), m.WorkerList, idempotent=True)).workers

    async def stats(self) -> m.Stats:
        """The coordinator's figures (GET_STATS)."""
        return await self._request(m.GetStats(), m.Stats, idempotent=True)

    async def cancel(self, job_id: str) -> tuple[bool, dict[str, Any]]:
        """Cancel a job: (True, snapshot) if this call cancelled it, (False, snapshot) if it had ended."""
        reply = await self._request(m.CancelJob(job_id), m.JobCancel)
        return reply.cancelled, reply.job

    async def events(self, job_id: str) -> list[dict[str, Any]]:
        """The job's timeline, oldest first; ``RequestFailed`` for an unknown id."""
        return (await self._request(m.GetJobEvents(job_id), m.JobEvents, idempotent=True)).events

    async def payload(self, job_id: str) -> dict[str, Any] | None:
        """The payload the job was submitted with (None for a Periodic job); ``RequestFailed``
        for an unknown id."""
        return (await self._request(m.GetJobPayload(job_id), m.JobPayload, idempotent=True)).payload

    async def retry(self, job_id: str) -> str:
        """Submit a finished job again and return the new jobId (never resubmitted here)."""
        return (await self._request(m.RetryJob(job_id), m.JobSubmitted)).job_id

    async def purge(self, older_than_millis: int, limit: int | None = None, dry_run: bool = False) -> tuple[int, bool]:
        """Delete up to ``limit`` finished jobs last updated more than ``older_than_millis``
        ago; ``(purged, more)`` (as ``CoordinatorClient.purge``)."""
        reply = await self._request(purge_request(older_than_millis, limit, dry_run), m.JobsPurged)
        return reply.purged, reply.more

    async def wait(self, job_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the job is COMPLETED, FAILED or CANCELLED and return that snapshot;
        ``WaitTimeout`` with the snapshot as it stood once ``timeout`` seconds (None: no
        limit) have passed. WAIT_JOB on a connection of its own, asked again each
        ``WAIT_CHUNK_MILLIS``; other coroutines' requests are not held up meanwhile."""
        asks = WaitChunks(job_id, timeout, time.monotonic)
        while True:
            job = asks.outcome((await self._request(asks, m.JobStatus, idempotent=True)).job)
            if job is not None:
                return job

    async def submit_workflow(self, jobs: WorkflowJobs, name: str | None = None, *,
                              idempotency_key: str | None = None) -> SubmittedWorkflow:
        """Submit a workflow (a ``jobmesh.canvas`` shape or a list of job objects); returns
        ``(workflow_id, {ref: job_id})``, as ``CoordinatorClient.submit_workflow``."""
        request = workflow_request(jobs, name, idempotency_key)
        reply = await self._request(request, m.WorkflowSubmitted, idempotent=resends_workflow(request))
        return SubmittedWorkflow(reply.workflow_id, dict(reply.job_ids))

    async def workflow_status(self, workflow_id: str) -> dict[str, Any]:
        """The workflow with every job, as ``CoordinatorClient.workflow_status``."""
        return await self._whole(await self._request(m.WorkflowStatus(workflow_id), m.Workflow, idempotent=True))

    async def cancel_workflow(self, workflow_id: str) -> dict[str, Any]:
        """Cancel every job of the workflow that has not ended; returns the workflow after."""
        return await self._whole(await self._request(m.WorkflowCancel(workflow_id), m.Workflow))

    async def wait_workflow(self, workflow_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Wait until every job of the workflow has ended and return the workflow;
        ``WorkflowWaitTimeout`` (a ``WaitTimeout``) once ``timeout`` seconds have passed.
        WAIT_WORKFLOW on a connection of its own, as ``wait``."""
        asks = WaitChunks(workflow_id, timeout, time.monotonic, workflow=True)
        while True:
            reply = await self._request(asks, m.Workflow, idempotent=True)
            if asks.settled(reply):
                return asks.ended(await self._whole(reply))

    async def _whole(self, reply: m.Workflow) -> dict[str, Any]:
        pages = WorkflowPages(reply)
        while (ask := pages.next_request()) is not None:
            pages.add(await self._request(ask, m.Workflow, idempotent=True))
        return pages.whole()

    async def request(self, request: m.Message, expect: type, idempotent: bool = False) -> Any:
        """Send any client-port request and return its reply of type ``expect``
        (``idempotent``: safe to repeat, it may go again on a fresh connection)."""
        return await self._request(request, expect, idempotent)

    # ---- transport -----------------------------------------------------------------

    async def _request(self, request: m.Message | Callable[[], m.Message], expect: type,
                       idempotent: bool = False) -> Any:
        """One request, one reply (``request`` may be a function that makes it, called again
        for each sending). Only the public ``CoordinatorUnavailable`` leaves here."""
        make: Callable[[], m.Message] = request if callable(request) else (lambda: request)
        try:
            sent, obj, conn = await self._send(make, idempotent)
        except CoordinatorUnavailable as exc:
            if type(exc) is CoordinatorUnavailable:
                raise
            raise CoordinatorUnavailable(str(exc)) from exc.__cause__ or exc
        try:
            return read_reply(sent, obj, expect, conn.address)
        except BadReply as exc:
            conn.close(str(exc))
            raise CoordinatorUnavailable(str(exc)) from exc.__cause__ or exc

    async def _send(self, make: Callable[[], m.Message], idempotent: bool) -> Sent:
        """The request sent and its reply, sent again where that is safe (the rules of
        jobmesh/client/api.py)."""
        closes = self._closes
        request = make()
        frame = encode_request(request)
        reused = False  # the connection carried requests before this one
        try:
            conn = await self._connection(isinstance(request, WAITS))
            reused = conn.sent > 0
            return request, await self._exchange(conn, frame, request), conn
        except CoordinatorUnavailable as exc:
            if closes != self._closes or not may_resend(exc, idempotent, reused, reused and conn.refused,
                                                        len(self.addresses) > 1):
                raise
            return await self._resend(make, idempotent, exc)

    async def _resend(self, make: Callable[[], m.Message], ride: bool, lost: CoordinatorUnavailable) -> Sent:
        """Send the request again on a fresh connection, with backoff while no address takes
        one, for up to ``failover_timeout`` after each loss (as ``CoordinatorClient._resend``)."""
        closes = self._closes
        failover = Failover(lost, self.failover_timeout, time.monotonic)
        while True:
            request = make()
            frame = encode_request(request)
            try:
                conn = await self._connection(isinstance(request, WAITS))
                return request, await self._exchange(conn, frame, request), conn
            except (NotConnected, ClosedUnanswered) as exc:
                if closes != self._closes:
                    raise
                await asyncio.sleep(failover.pause(exc, ride))

    async def _exchange(self, conn: _Connection, frame: bytes, request: m.Message) -> dict[str, Any]:
        """Send one frame on ``conn`` and return its reply. A WAIT_JOB's reply may take its
        wait plus ``timeout``; its connection is kept for the next wait once it is answered."""
        wait = isinstance(request, WAITS)
        conn.sent += 1
        reply = conn.send(frame, reply_timeout(request, self.timeout))
        try:
            await conn.drain()
            obj = await reply
        except CoordinatorUnavailable:
            self._lost(conn)
            raise
        except asyncio.CancelledError:
            reply.cancel()
            if wait:  # its reply would hold up the next wait's
                conn.close("a wait was cancelled")
            raise
        finally:
            self._busy_waits.discard(conn)
        if wait:
            if conn.usable and len(self._idle_waits) < IDLE_WAIT_CONNECTIONS:
                self._idle_waits.append(conn)
            else:
                conn.close("enough idle wait connections")
        return obj

    async def _connection(self, wait: bool) -> _Connection:
        """The shared connection (opened once for all callers), or for a wait one of its own."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._leave_loop(loop)
        if wait:
            while self._idle_waits:
                conn = self._idle_waits.pop()
                if conn.usable:
                    break
            else:
                conn = await self._connect()
            self._busy_waits.add(conn)
            return conn
        conn_or_none = self._conn
        if conn_or_none is not None and conn_or_none.usable:
            return conn_or_none
        if self._connecting is None:
            self._connecting = loop.create_task(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, task: asyncio.Task[_Connection]) -> None:
        if self._connecting is task:
            self._connecting = None
            if not task.cancelled() and task.exception() is None:
                self._conn = task.result()

    def _leave_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Leave the connections of the loop used before (closed, or another thread's)."""
        for conn in ([self._conn] if self._conn is not None else []) + self._idle_waits:
            try:
                conn.close("the client moved to another event loop")
            except RuntimeError:  # that loop is closed
                pass
        self._conn = None
        self._connecting = None
        self._idle_waits.clear()
        self._busy_waits.clear()
        self._loop = loop

    async def _connect(self) -> _Connection:
        """A connection to the first address that takes one, from ``_at`` round the list,
        authenticated when there is a token."""
        failures: list[tuple[Address, BaseException]] = []
        for i in range(len(self.addresses)):
            index = (self._at + i) % len(self.addresses)
            try:
                conn = await self._open(self.addresses[index], index)
                break
            except (OSError, TlsFailed) as exc:  # refused, timed out (a TimeoutError), TLS refused
                failures.append((self.addresses[index], exc))
        else:
            raise NotConnected("cannot connect to %s" % AllFailed(failures)) from failures[-1][1]
        self._at = index
        if self._token is not None:
            request = m.Auth(self._token)
            try:
                obj = await self._exchange(conn, encode_request(request), request)
                read_reply(request, obj, m.AuthOk, conn.address)
            except BaseException:
                conn.close("authentication failed")
                raise
            conn.sent = 0
        return conn

    async def _open(self, address: Address, index: int) -> _Connection:
        """A connection to ``address``, after the TLS handshake when TLS is on."""
        loop = asyncio.get_running_loop()
        conn = _Connection(address, index, self.connect_timeout)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: conn, address.host, address.port), self.connect_timeout)
        except OSError as exc:
            if exc.errno:  # asyncio's text names the call; say why it failed, as the blocking client does
                raise OSError(exc.errno, os.strerror(exc.errno)) from exc
            raise
        if self.tls is not None:
            try:
                secured = await loop.start_tls(transport, conn, self.tls, server_hostname=address.host,
                                               ssl_handshake_timeout=HANDSHAKE_SECONDS)
            except OSError as exc:
                transport.abort()
                raise TlsFailed("TLS handshake failed: %s" % tls_reason(exc)) from exc
            assert isinstance(secured, asyncio.Transport)
            conn.secured(secured)
        return conn

    def _lost(self, conn: _Connection) -> None:
        """``conn`` failed: the next connection starts with the address after its own."""
        if self._at == conn.index:
            self._at = (conn.index + 1) % len(self.addresses)


class AsyncSchedules:
    """``client.schedules`` of an AsyncClient: recurring schedules, as the blocking
    client's ``schedules`` (jobmesh/client/api.py, ``Schedules``), as coroutines."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def put(self, name: str, task_type: str, payload: dict[str, Any] | None = None, *,
                  cron: str | None = None, every: float | timedelta | None = None, timezone: str = "UTC",
                  missed: str = "latest", overlap: str = "skip", jitter: float | timedelta = 0,
                  catchup_window: float | timedelta | None = None, priority: str | Priority | None = None,
                  max_attempts: int = 0, paused: bool = False) -> dict[str, Any]:
        """Create or replace the schedule ``name`` and return it."""
        request = schedule_put_request(name, task_type, payload, cron=cron, every=every, timezone=timezone,
                                       missed=missed, overlap=overlap, jitter=jitter, catchup_window=catchup_window,
                                       priority=priority, max_attempts=max_attempts, paused=paused)
        return (await self.client.request(request, m.Schedule)).schedule

    async def get(self, name: str) -> dict[str, Any]:
        return (await self.client.request(m.ScheduleGet(name), m.Schedule, idempotent=True)).schedule

    async def list(self) -> builtins.list[dict[str, Any]]:
        """Every schedule, by name (fetched a page at a time)."""
        out: builtins.list[dict[str, Any]] = []
        after = None
        while True:
            reply = await self.client.request(m.ScheduleList(after=after), m.ScheduleList, idempotent=True)
            out.extend(reply.schedules)
            after = reply.next_after
            if after is None:
                return out

    async def pause(self, name: str) -> dict[str, Any]:
        return (await self.client.request(m.SchedulePause(name), m.Schedule)).schedule

    async def resume(self, name: str) -> dict[str, Any]:
        return (await self.client.request(m.ScheduleResume(name), m.Schedule)).schedule

    async def delete(self, name: str) -> dict[str, Any]:
        return (await self.client.request(m.ScheduleDelete(name), m.Schedule)).schedule

    async def trigger(self, name: str) -> str:
        return (await self.client.request(m.ScheduleTrigger(name), m.JobSubmitted)).job_id

    async def preview(self, cron: str | None = None, every: float | timedelta | None = None, timezone: str = "UTC",
                      start: datetime | float | None = None, count: int = 10) -> builtins.list[datetime]:
        reply = await self.client.request(preview_request(cron, every, timezone, start, count), m.SchedulePreview,
                                          idempotent=True)
        return fire_times(reply, timezone)


class AsyncLimits:
    """``client.limits`` of an AsyncClient: limits per task type and pausing a type, as
    the blocking client's ``limits`` (jobmesh/client/api.py, ``Limits``), as coroutines."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def put(self, task_type: str, max_running: int | None = None, max_running_per_key: int | None = None,
                  rate_per_second: float | None = None, burst: int | None = None,
                  rate_per_key_per_second: float | None = None, paused: bool | None = None) -> dict[str, Any]:
        """Create or replace the limits of ``task_type`` and return them."""
        request = limit_put_request(task_type, max_running, max_running_per_key, rate_per_second, burst,
                                    rate_per_key_per_second, paused)
        return (await self.client.request(request, m.Limit)).limit

    async def get(self, task_type: str) -> dict[str, Any]:
        return (await self.client.request(m.LimitGet(task_type), m.Limit, idempotent=True)).limit

    async def list(self) -> builtins.list[dict[str, Any]]:
        return (await self.client.request(m.LimitList(), m.LimitList, idempotent=True)).limits

    async def delete(self, task_type: str) -> dict[str, Any]:
        return (await self.client.request(m.LimitDelete(task_type), m.Limit)).limit

    async def pause(self, task_type: str) -> dict[str, Any]:
        return (await self.client.request(m.TypePause(task_type), m.Limit)).limit

    async def resume(self, task_type: str) -> dict[str, Any]:
        return (await self.client.request(m.TypeResume(task_type), m.Limit)).limit
