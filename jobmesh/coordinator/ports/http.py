"""The metrics port: ``/metrics``, ``/healthz``, ``/readyz``, the dashboard and its JSON.

An adapter like ``server.py``: it owns no job state. It runs gevent's WSGI server on
the coordinator's hub (``--metrics-port``, on the ``--bind`` address) and answers

    /metrics                 Prometheus text format (prometheus_client's registry and
                             exposition), from a custom collector that walks
                             ``figures.METRICS`` over the core's and the runtime's figures
                             at scrape time
    /healthz                 200 while the process serves
    /readyz                  200 once recovered and listening; 503 while standing by
                             (another coordinator leads the database), recovering or stopping
    /                        the dashboard: one static HTML file (dashboard.html) whose
                             script polls the JSON endpoints below
    /api/summary             the registry's summary figures (counts by state, counters,
                             workers, slots...), the list of states, counts by type
    /api/series              samples of the last minutes (one a second) for the chart
    /api/jobs?state=&type=&cursor=&limit=     a page of jobs, newest first
    /api/jobs/<id>           one job's snapshot, and its payload beside it
    /api/jobs/<id>/events    its timeline
    /api/workflows/<id>      one workflow: name, state, its jobs' counts by state, and its
                             first ``WORKFLOW_JOBS_SHOWN`` jobs (every page of WORKFLOW_STATUS
                             is read: the counts cover all of them)
    /api/workers             the live workers
    /api/schedules?after=    a page of recurring schedules by name (next fire, last job and
                             its state, counts) and nextAfter
    /api/limits              every task type with a limit or a pause: its limits, paused,
                             and its running and queued jobs

Two ways of reading, and why:

* ``core.metrics()`` is read directly: a ``figures.Figures`` of plain ints and dicts whose
  size is the number of series (never the number of jobs), and nothing in it changes a
  cache. A scrape runs on
  the hub like everything else, never yields while it reads, and costs O(series); it
  never waits for the core. The core keeps plain counters rather than prometheus_client
  metric objects because those take a lock on every update.
* Reads of jobs and workers go through the core's mailbox exactly like a client request
  (the core's lookups update its caches, so only the core greenlet may call them): the
  handler posts ``events.Request(LocalConn(), msg)``, the core answers with the encoded
  reply frame after the batch's commit, and ``LocalConn.reply`` hands the bytes to the
  waiting handler through an ``AsyncResult``.

With ``--auth-file`` (the runtime's ``guard``), every path but ``/healthz`` and ``/readyz``
needs ``Authorization: Bearer TOKEN``, or Basic with the token as the password (any user
name, so a browser's login prompt works), of a reader, client or admin token; anything
else is answered 401 with ``WWW-Authenticate: Basic realm="jobmesh"``. A request without
credentials is not counted as a failure (a browser always asks once without); a wrong
token is, and is slowed like on the JSON ports (``guard.py``).

With ``--tls-cert`` it is HTTPS: each connection's handshake runs in its own greenlet
(``connection.tls_accept``), before the request is read. A TLS client or worker pointed here gets past the handshake (the certificate
is the other ports'), so its first byte is read after it and looked at as a plaintext
peer's is: a jobmesh frame is answered with the port mix-up.

A timer greenlet wakes every ``TICK_SECONDS``; how late it wakes is the event-loop lag
(a histogram), and once a second it appends a sample to the ring buffer behind the
dashboard's chart.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import io
import socket
import ssl
import time
from collections import deque
from dataclasses import replace
from importlib import resources
from typing import Any, Callable, Iterator
from urllib.parse import parse_qs

import gevent
import ujson
from gevent.event import AsyncResult
from gevent.pool import Group
from gevent.pywsgi import LoggingLogAdapter, WSGIHandler, WSGIServer
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client import Histogram as LibraryHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.ports.guard import Guard
from jobmesh.coordinator.ports.connection import tls_accept
from jobmesh.coordinator.core.figures import (ACTIVE, FINISHED, METRICS, NO_FIGURES, SUMMARY_KEYS, BucketCounts, Figures, Kind,
                                         Metric, RuntimeFigures)
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import FrameDecoder, encode_frame
from jobmesh.protocol.jobs import JobState
from jobmesh.tls import HANDSHAKE_SECONDS

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # open HTTP connections; each holds at most one request to the core
READ_TIMEOUT_SECONDS = 5.0  # a connection that sends no complete request (or idles) this long is closed
ASK_TIMEOUT = 10.0  # seconds a JSON request waits for the core's answer before a 504
TICK_SECONDS = 0.25  # the lag timer's period
SAMPLE_SECONDS = 1.0  # one chart sample a second ...
SAMPLES = 600  # ... for the last ten minutes
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PAGE_DEFAULT = 50


# ---- /metrics -----------------------------------------------------------------------------


def _histogram(name: str, doc: str, hist: BucketCounts) -> HistogramMetricFamily:
    """A family from plain bucket counts (``bounds``, per-bucket ``counts`` with the
    overflow last, ``sum``; see ``housekeeping.Histogram``), made cumulative here."""
    buckets = []
    total = 0
    for bound, count in zip(hist.bounds, hist.counts):
        total += count
        buckets.append((floatToGoString(bound), total))
    total += hist.counts[-1]
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.sum)


def family(metric: Metric, core: Figures, runtime: RuntimeFigures) -> Any:
    """The Prometheus family of one registry entry, with its values now."""
    value = metric.value(core, runtime)
    if metric.kind is Kind.HISTOGRAM:
        return _histogram(metric.name, metric.help, value)
    cls = CounterMetricFamily if metric.kind is Kind.COUNTER else GaugeMetricFamily
    if not metric.labels:
        return cls(metric.name, metric.help, value=value)
    out = cls(metric.name, metric.help, labels=list(metric.labels))
    for key, n in value.items():
        out.add_metric(list(key) if isinstance(key, tuple) else [key], n)
    return out


class JobmeshCollector:
    """A prometheus_client collector over ``read() -> (core.metrics(), runtime figures)``:
    one family per entry of ``figures.METRICS``, built from those two records alone
    (O(series), no job is visited)."""

    def __init__(self, read: Callable[[], tuple[Figures, RuntimeFigures]]) -> None:
        self._read = read

    def describe(self) -> list[Any]:
        return []  # unchecked collector: names are fixed by the contract, not probed at registration

    def collect(self) -> Iterator[Any]:
        core, runtime = self._read()
        for metric in METRICS:
            yield family(metric, core, runtime)


# ---- asking the core ----------------------------------------------------------------------


class LocalConn:
    """An in-process stand-in for a client connection: the core's ``reply`` hands the
    encoded reply frame to the handler waiting on ``answer``."""

    __slots__ = ("answer", "inbox")

    def __init__(self) -> None:
        self.answer: AsyncResult = AsyncResult()
        self.inbox: deque[Any] = deque()  # the mailbox queues this connection's request here

    def drained(self) -> None:
        """The mailbox took the request (nothing to wake: the handler waits on ``answer``)."""

    def __repr__(self) -> str:
        return "<LocalConn metrics-port>"

    def reply(self, data: bytes, count: int, close: bool = False) -> None:
        self.answer.set(data)

    def held_back(self, count: int) -> None:
        """(The metrics port sends no WAIT_JOB.)"""


class HttpError(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def decode_reply(data: bytes) -> dict[str, Any]:
    """The first frame of a reply's bytes, as a wire dict."""
    decoder = FrameDecoder()
    decoder.feed(data)
    obj = decoder.next_payload()
    if obj is None:
        raise ProtocolError("the core's reply holds no whole frame")
    return obj


def _now(wait: Callable[[], float]) -> float:
    return wait()


def _error_status(message: str, not_found: bool) -> str:
    if message.startswith(("unknown job", "unknown workflow")):
        return "404 Not Found" if not_found else "400 Bad Request"
    if message.startswith("coordinator is shutting down"):
        return "503 Service Unavailable"
    if message.startswith("internal coordinator error"):
        return "500 Internal Server Error"
    return "400 Bad Request"


# ---- the port -----------------------------------------------------------------------------


HOLD_BACK = "jobmesh.hold_back"  # environ key: ``wait(seconds_fn)``, waiting with the slot free


class _Handler(WSGIHandler):
    """gevent's handler, telling the server while it answers a request (from its complete
    head until the response is written): only then is the connection's slot not free,
    but for the wait before answering an address that keeps failing to authenticate
    (``HOLD_BACK``), which a newer connection may cut short as it may a half-sent request."""

    def handle_one_response(self) -> Any:
        server = self.server
        fd = self.socket.fileno()
        server.busy(fd)
        try:
            return super().handle_one_response()
        finally:
            server.idle(fd)

    def get_environ(self) -> dict[str, Any]:
        environ: dict[str, Any] = super().get_environ()
        environ[HOLD_BACK] = self._free_while
        return environ

    def _free_while(self, wait: Callable[[], float]) -> float:
        server = self.server
        fd = self.socket.fileno()
        server.idle(fd)
        try:
            return wait()
        finally:
            server.busy(fd)


class _Server(WSGIServer):
    """gevent's WSGI server, counting its open connections for ``jobmesh_connections``.

    At most ``MAX_CONNECTIONS`` connections are open at once. A connection counts as busy
    only while one of its requests is answered (``_Handler``); before its request is
    complete (a half-sent one), or idle between requests, it is free, and a new connection
    that finds every slot taken closes the oldest free one. So stalled requests cost each
    other their connections, never a scrape's or a health check's: a complete request is
    answered at once (a connection waiting out the slow-down of an address that keeps
    failing to authenticate is free too). Only when every connection is busy answering is
    a new one closed.
    A connection that sends no complete request within ``READ_TIMEOUT_SECONDS`` (or
    idles that long between requests) is closed too."""

    handler_class = _Handler

    def __init__(self, *args: Any, tls: ssl.SSLContext | None, handshake_timeout: float, **kwargs: Any) -> None:
        self.tls = tls  # with a context, every connection starts with the TLS handshake (in its greenlet)
        self.handshake_timeout = handshake_timeout
        self.handlers = Group()
        # Descriptor -> handler greenlet of each open connection: those not answering a
        # request, oldest first (re-inserted when one goes idle again), and those answering.
        self._free: dict[int, gevent.Greenlet] = {}
        self._busy: dict[int, gevent.Greenlet] = {}
        super().__init__(*args, **kwargs)
        self.open_connections = 0

    def _secure(self, sock: Any, address: Any, timeout: float) -> Any | None:
        """The socket to speak HTTP on: as accepted, or after the TLS handshake (None: it failed)."""
        if self.tls is None:
            return sock
        return tls_accept(self.tls, sock, address, timeout, "metrics")

    def do_handle(self, *args: Any) -> None:
        """An accepted connection, ``(socket, address)``: served, past the oldest free
        connection if it must; closed at once when every connection is busy."""
        if len(self._free) + len(self._busy) >= MAX_CONNECTIONS:
            if not self._free:
                self.do_close(*args)
                return
            fd, oldest = next(iter(self._free.items()))
            del self._free[fd]
            oldest.kill(block=False)
        fd = args[0].fileno()
        self._free[fd] = self.handlers.spawn(self._serve, fd, *args)

    def busy(self, fd: int) -> None:
        greenlet = self._free.pop(fd, None)
        if greenlet is not None:
            self._busy[fd] = greenlet

    def idle(self, fd: int) -> None:
        greenlet = self._busy.pop(fd, None)
        if greenlet is not None:
            self._free[fd] = greenlet

    def _serve(self, fd: int, *args: Any) -> None:
        try:
            self.handle(*args)
        finally:
            self._free.pop(fd, None)
            self._busy.pop(fd, None)
            self.do_close(*args)

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        self.handlers.join(timeout=timeout)
        self.handlers.kill(block=False)

    def handle(self, sock: Any, address: Any) -> None:
        self.open_connections += 1
        conn = None
        try:
            conn = self._secure(sock, address, self.handshake_timeout)
            if conn is not None:
                conn.settimeout(READ_TIMEOUT_SECONDS)
                if conn is sock:
                    if not refuse_frames(conn):
                        super().handle(conn, address)
                else:
                    # A TLS socket takes no recv flags: its first byte is read, then given
                    # back to the HTTP handler (a TLS client or worker gets past the
                    # handshake: the certificate is the other ports').
                    first = first_byte(conn)
                    if first and not refuse_frames(conn, first):
                        rfile = io.BufferedReader(_Replay(first, conn))
                        self.handler_class(conn, address, self, rfile=rfile).handle()
        finally:
            self.open_connections -= 1
            if conn is not None and conn is not sock:
                conn.close()


def refuse_frames(sock: Any, first: bytes | None = None) -> bool:
    """Answer a peer that speaks jobmesh frames (a client or worker pointed at this port)
    with an ERROR frame naming the port mix-up, and say whether it was one: a frame's
    first byte is 0 (its length is below 16 MiB), an HTTP request's never is. ``first``:
    that byte, already read (TLS); else it is peeked at."""
    try:
        if (first if first is not None else sock.recv(1, socket.MSG_PEEK)) != b"\x00":
            return False
        sock.sendall(encode_frame(m.metrics_port_refusal().to_wire()))
    except OSError:  # silent until the read timeout, or gone: nothing to serve either way
        pass
    return True


def first_byte(sock: Any) -> bytes:
    """The peer's first byte (b"" at its end, a timeout or an error)."""
    try:
        return sock.recv(1)
    except OSError:
        return b""


class _Replay(io.RawIOBase):
    """A socket's byte stream with its first byte, read already, given back in front."""

    def __init__(self, first: bytes, sock: Any) -> None:
        super().__init__()
        self.first = first
        self.sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.first:
            buffer[0:1] = self.first
            self.first = b""
            return 1
        return self.sock.recv_into(buffer)


SCHEDULES_PAGE = 200  # schedules the dashboard shows at once
JOB_PATH = re.compile(r"/api/jobs/([^/]+)(/events)?\Z")
WORKFLOW_PATH = re.compile(r"/api/workflows/([^/]+)\Z")
# Jobs of one workflow the dashboard gets (in submission order): a workflow has at most
# 10,000 (core/workflows.py, MAX_JOBS), and the page draws a graph, not a list; past this
# it is told how many it does not get.
WORKFLOW_JOBS_SHOWN = 2_000
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # answered without a token


def credentials(header: str) -> str | None:
    """The token of an ``Authorization`` header: ``Bearer TOKEN``, or ``Basic`` with the
    token as the password (the user name is ignored); None if there is none."""
    scheme, _, value = header.strip().partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip() or None
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            return None
        _user, sep, password = decoded.partition(":")
        return password if sep and password else None
    return None


class HttpPort:
    """The metrics port of one coordinator.

    ``source`` is the runtime (``runtime.Coordinator``), read through four names only:
    ``core.metrics()`` (no core yet: standing by or recovering, all zero), ``figures()``,
    ``ready`` and ``mailbox.put(event)``. ``guard`` checks
    tokens (``--auth-file``; None: every path is open).
    """

    def __init__(self, source: Any, bind: str, port: int, guard: Guard | None = None,
                 tls: ssl.SSLContext | None = None, handshake_timeout: float = HANDSHAKE_SECONDS) -> None:
        self.source = source
        self.guard = guard
        self.tls = tls  # HTTPS with the worker and client ports' certificate
        self.handshake_timeout = handshake_timeout
        self.bind = bind
        self.requested_port = port
        self.server: _Server | None = None
        self.started_at_millis = int(time.time() * 1000)
        self.samples: deque[tuple[Any, ...]] = deque(maxlen=SAMPLES)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobmeshCollector(self._read))
        ProcessCollector(registry=self.registry)  # CPU, memory, open fds of this process
        # The lag timer updates this a few times a second, off the core's path, so the
        # library's own (locking) metric object is fine here.
        self.loop_lag = LibraryHistogram("jobmesh_event_loop_lag_seconds",
                                         "How late the metrics port's timer greenlet wakes.",
                                         buckets=LAG_BUCKETS, registry=self.registry)
        self._lag_max = 0.0  # the largest lag since the last chart sample
        self._timer: gevent.Greenlet | None = None
        self._page = resources.files("jobmesh.coordinator.ports").joinpath("dashboard.html").read_bytes()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.server_port

    def start(self) -> _Server:
        """Listen and start the timer; returns the server (the runtime stops it with the others)."""
        self.server = _Server(
            (self.bind, self.requested_port), self.app, tls=self.tls,
            handshake_timeout=self.handshake_timeout,
            log=LoggingLogAdapter(log, logging.DEBUG), error_log=LoggingLogAdapter(log, logging.ERROR),
        )
        self.server.start()
        self._sample(time.monotonic())
        self._timer = gevent.spawn(self._run_timer)
        return self.server

    def stop_timers(self) -> None:
        if self._timer is not None:
            self._timer.kill(block=False)
            self._timer = None

    # ---- figures ------------------------------------------------------------------------

    def _read(self) -> tuple[Figures, RuntimeFigures]:
        runtime = self.source.figures()
        connections = dict(runtime.connections)
        connections["metrics"] = self.server.open_connections if self.server is not None else 0
        return self._core_figures(), replace(runtime, connections=connections)

    def _core_figures(self) -> Figures:
        core = self.source.core
        return core.metrics() if core is not None else NO_FIGURES

    def _run_timer(self) -> None:
        next_sample = time.monotonic() + SAMPLE_SECONDS
        while True:
            before = time.monotonic()
            gevent.sleep(TICK_SECONDS)
            now = time.monotonic()
            late = max(0.0, now - before - TICK_SECONDS)
            self.loop_lag.observe(late)
            self._lag_max = max(self._lag_max, late)
            if now >= next_sample:
                next_sample = max(next_sample + SAMPLE_SECONDS, now)
                try:
                    self._sample(now)
                except Exception:
                    log.exception("metrics sample failed; continuing")

    def _sample(self, _now: float) -> None:
        core = self._core_figures()
        jobs = core.jobs_by_state
        finished = core.finished_by_state
        queued, running = jobs.pop(JobState.QUEUED.value), jobs.pop(JobState.RUNNING.value)
        self.samples.append((
            int(time.time() * 1000), core.counters.submitted, sum(finished.values()), finished[JobState.FAILED.value],
            queued, running, sum(jobs.values()), core.busy_slots, core.capacity, round(self._lag_max * 1000, 1),
        ))
        self._lag_max = 0.0

    def summary(self) -> dict[str, Any]:
        """The registry's ``summary`` figures, and what the page needs beside them: the
        states (the page lists no state of its own), jobs by type, readiness, loop lag."""
        core, runtime = self._read()
        out = {key: metric.value(core, runtime) for key, metric in SUMMARY_KEYS}
        out.update({
            "ready": bool(self.source.ready),
            "startedAtMillis": self.started_at_millis,
            "states": {"active": list(ACTIVE), "terminal": list(FINISHED)},
            "byType": [{"state": s, "taskType": t, "protocol": p, "count": n}
                       for (s, t, p), n in core.jobs_by_type.items()],
            "loopLagMillis": self.samples[-1][9] if self.samples else 0.0,
        })
        return out

    def series(self) -> dict[str, Any]:
        """The ring buffer as columns; rates are per second between consecutive samples."""
        rows = list(self.samples)
        out: dict[str, list[Any]] = {k: [] for k in ("t", "submittedPerSec", "finishedPerSec", "failedPerSec", "queued",
                                                 "running", "waiting", "busySlots", "capacity", "lagMillis")}
        for prev, row in zip(rows, rows[1:]):
            dt = max(0.001, (row[0] - prev[0]) / 1000.0)
            out["t"].append(row[0])
            out["submittedPerSec"].append(round((row[1] - prev[1]) / dt, 2))
            out["finishedPerSec"].append(round((row[2] - prev[2]) / dt, 2))
            out["failedPerSec"].append(round((row[3] - prev[3]) / dt, 2))
            for key, value in zip(("queued", "running", "waiting", "busySlots", "capacity", "lagMillis"), row[4:]):
                out[key].append(value)
        return dict(out, intervalMillis=int(SAMPLE_SECONDS * 1000))

    # ---- asking the core -----------------------------------------------------------------

    def ask(self, msg: m.Message, not_found: bool = False) -> dict[str, Any]:
        """Post ``msg`` to the core as a client request and wait for its reply (a wire dict).
        An ERROR reply raises ``HttpError``."""
        if not self.source.ready:
            raise HttpError("503 Service Unavailable", "coordinator is not ready")
        conn = LocalConn()
        self.source.mailbox.put(ev.Request(conn, msg))
        try:
            data = conn.answer.get(timeout=ASK_TIMEOUT)
        except gevent.Timeout:
            raise HttpError("504 Gateway Timeout", "the core did not answer within %.0f s" % ASK_TIMEOUT) from None
        reply = decode_reply(data)
        if reply.get("type") == "ERROR":
            message = str(reply.get("message", "error"))
            raise HttpError(_error_status(message, not_found), message)
        return reply

    # ---- WSGI ---------------------------------------------------------------------------

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        # WSGI hands the path over as latin-1 text of the raw bytes.
        path = environ.get("PATH_INFO", "/").encode("latin-1").decode("utf-8", "replace")
        guard = self.guard
        if guard is not None and path not in OPEN_PATHS and not self._authorized(guard, environ):
            return self._respond(start_response, "401 Unauthorized", b"a token is needed: Authorization: Bearer "
                                 b"TOKEN, or Basic with the token as the password\n", "text/plain; charset=utf-8",
                                 [("WWW-Authenticate", 'Basic realm="jobmesh"')])
        if method not in ("GET", "HEAD"):
            return self._respond(start_response, "405 Method Not Allowed", b"read-only: GET only\n",
                                 "text/plain; charset=utf-8", [("Allow", "GET, HEAD")])
        try:
            return self._route(path, environ, start_response)
        except HttpError as exc:
            return self._json(start_response, {"error": str(exc)}, exc.status)
        except Exception:
            log.exception("error serving %s", path)
            return self._json(start_response, {"error": "internal error; see the coordinator log"},
                              "500 Internal Server Error")

    @staticmethod
    def _authorized(guard: Guard, environ: dict[str, Any]) -> bool:
        """Whether the request carries the token of a reader, client or admin."""
        token = credentials(environ.get("HTTP_AUTHORIZATION", ""))
        if token is None:
            return False
        host = str(environ.get("REMOTE_ADDR", ""))
        identity = guard.authenticate(token, host)
        # A success waits as a refusal does, for an address that keeps failing; its slot free meanwhile.
        environ.get(HOLD_BACK, _now)(lambda: guard.hold_back(host))
        if identity is None:
            return False
        return identity.may("METRICS")

    def _route(self, path: str, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if path == "/metrics":
            # Text format 0.0.4 unless the scraper asks for OpenMetrics or a newer text format.
            encode, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
            return self._respond(start_response, "200 OK", encode(self.registry), content_type)
        if path == "/healthz":
            return self._respond(start_response, "200 OK", b"ok\n", "text/plain; charset=utf-8")
        if path == "/readyz":
            if self.source.ready:
                return self._respond(start_response, "200 OK", b"ready\n", "text/plain; charset=utf-8")
            return self._respond(start_response, "503 Service Unavailable", b"not ready\n",
                                 "text/plain; charset=utf-8")
        if path in ("/", "/index.html"):
            return self._respond(start_response, "200 OK", self._page, "text/html; charset=utf-8", [(
                "Content-Security-Policy",
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                "img-src 'self' data:",
            )])
        if path == "/api/summary":
            return self._json(start_response, self.summary())
        if path == "/api/series":
            return self._json(start_response, self.series())
        if path == "/api/workers":
            return self._json(start_response, {"workers": self.ask(m.ListWorkers())["workers"]})
        if path == "/api/schedules":
            return self._json(start_response, self._schedules(parse_qs(environ.get("QUERY_STRING", ""))))
        if path == "/api/limits":
            return self._json(start_response, {"limits": self.ask(m.LimitList()).get("limits", [])})
        if path == "/api/jobs":
            return self._json(start_response, self._list_jobs(parse_qs(environ.get("QUERY_STRING", ""))))
        match = WORKFLOW_PATH.match(path)
        if match:
            return self._json(start_response, self._workflow(match.group(1)))
        match = JOB_PATH.match(path)
        if match:
            job_id = match.group(1)
            if match.group(2):
                reply = self.ask(m.GetJobEvents(job_id), not_found=True)
                return self._json(start_response, {"jobId": job_id, "events": reply.get("events", [])})
            job = self.ask(m.GetJobStatus(job_id), not_found=True)["job"]
            payload = self.ask(m.GetJobPayload(job_id), not_found=True).get("payload")
            return self._json(start_response, {"job": job, "payload": payload})
        return self._json(start_response, {"error": "no such page: %s" % path}, "404 Not Found")

    def _schedules(self, query: dict[str, list[str]]) -> dict[str, Any]:
        """A page of recurring schedules by name (``after``: the last name of the page before)."""
        after = [v for v in query.get("after", []) if v]
        reply = self.ask(m.ScheduleList(limit=SCHEDULES_PAGE, after=after[-1] if after else None))
        return {"schedules": reply.get("schedules", []), "nextAfter": reply.get("nextAfter")}

    def _workflow(self, workflow_id: str) -> dict[str, Any]:
        """The workflow with its jobs' counts by state (every state listed, in the states'
        order) over all its pages, and ``jobs`` its first ``WORKFLOW_JOBS_SHOWN``;
        ``jobCount`` says how many it has. A page ends where the core's reply would pass
        the frame limit, so a big workflow costs a few requests, each one batch of the core."""
        reply = self.ask(m.WorkflowStatus(workflow_id), not_found=True)
        counts = dict.fromkeys((state.value for state in JobState), 0)
        jobs: list[dict[str, Any]] = []
        total = 0
        while True:
            page = reply.get("jobs", [])
            for job in page:
                counts[job["state"]] = counts.get(job["state"], 0) + 1
            total += len(page)
            jobs.extend(page[:max(0, WORKFLOW_JOBS_SHOWN - len(jobs))])
            cursor = reply.get("nextCursor")
            if not cursor or not page:
                break
            reply = self.ask(m.WorkflowStatus(workflow_id, cursor=cursor), not_found=True)
        return {"workflowId": reply["workflowId"], "name": reply.get("name"), "state": reply.get("state"),
                "counts": counts, "jobCount": total, "jobs": jobs}

    def _list_jobs(self, query: dict[str, list[str]]) -> dict[str, Any]:
        def one(name: str) -> str | None:
            values = [v for v in query.get(name, []) if v.strip()]
            return values[-1].strip() if values else None

        raw_limit = one("limit")
        try:
            limit = PAGE_DEFAULT if raw_limit is None else int(raw_limit)
        except ValueError:
            raise HttpError("400 Bad Request", "limit must be an integer, got %r" % raw_limit) from None
        state = one("state")
        reply = self.ask(m.ListJobs(limit=limit, state=state.upper() if state else None, cursor=one("cursor"),
                                    task_type=one("type")))
        return {"jobs": reply.get("jobs", []), "nextCursor": reply.get("nextCursor")}

    @staticmethod
    def _respond(start_response: Callable[..., Any], status: str, body: bytes, content_type: str,
                 extra: list[tuple[str, str]] | None = None) -> list[bytes]:
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body))),
                   ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")]
        start_response(status, headers + (extra or []))
        return [body]

    def _json(self, start_response: Callable[..., Any], obj: dict[str, Any], status: str = "200 OK") -> list[bytes]:
        obj.setdefault("nowMillis", int(time.time() * 1000))
        body = ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False).encode("utf-8")
        return self._respond(start_response, status, body, "application/json; charset=utf-8")
