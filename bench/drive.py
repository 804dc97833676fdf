"""Client loops shared by the load generator and the echo baseline.

A ``Phase`` holds one measured phase's counters and histograms. Client loops run one
per connection (a greenlet each) and share the phase's budget of submits (``tokens``)
or stop when ``phase.stop`` is set (duration mode). Every request is timed with
``perf_counter`` around one write and one framed read; failures are counted by kind and
end that client (the outcome of a request on a broken connection is unknown).
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from typing import Callable

import gevent
import gevent.event

from bench.conns import Conn, classify
from bench.histogram import Histogram
from bench.workload import Workload
from jobmesh.protocol.framing import encode_frame

TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
REJECT_BACKOFF = (0.005, 0.05)
PIPELINE = 64


def status_frame(job_id: str) -> bytes:
    return encode_frame({"type": "GET_JOB_STATUS", "jobId": job_id})


def wait_frame(job_id: str, timeout_millis: int = 60_000) -> bytes:
    """WAIT_JOB: answered when the job ends (or after ``timeout_millis``), no polling."""
    return encode_frame({"type": "WAIT_JOB", "jobId": job_id, "timeoutMillis": timeout_millis})


class Phase:
    """Counters of one measured phase. ``tokens`` is None in duration mode."""

    def __init__(self, name: str, tokens: int | None) -> None:
        self.name = name
        self.tokens = tokens
        self.stop = gevent.event.Event()
        self.submit_hist = Histogram()
        self.op_hists: dict[str, Histogram] = {}
        self.sent = 0
        self.accepted = 0
        self.rejected = 0
        self.deduplicated = 0
        self.duplicates = 0
        self.errors: Counter = Counter()
        self.ids: list[str] = []          # accepted job ids, in acceptance order
        self.id_set: set[str] = set()
        self.first_send: float | None = None      # perf_counter
        self.first_send_wall_ms: int | None = None
        self.last_reply: float | None = None
        self.ops = 0

    # -- budget --------------------------------------------------------------------

    def take(self) -> bool:
        if self.stop.is_set():
            return False
        if self.tokens is None:
            return True
        if self.tokens <= 0:
            return False
        self.tokens -= 1
        return True

    def give_back(self) -> None:
        if self.tokens is not None:
            self.tokens += 1

    def hist(self, op: str) -> Histogram:
        h = self.op_hists.get(op)
        if h is None:
            h = self.op_hists[op] = Histogram()
        return h

    # -- results -------------------------------------------------------------------

    def mark_send(self) -> float:
        now = time.perf_counter()
        if self.first_send is None:
            self.first_send = now
            self.first_send_wall_ms = int(time.time() * 1000)
        return now

    def submit_rate(self) -> float:
        if not self.accepted or self.first_send is None or self.last_reply is None:
            return 0.0
        span = self.last_reply - self.first_send
        return self.accepted / span if span > 0 else 0.0

    def on_submitted(self, reply: dict, key: str | None, expect_id: str | None = None) -> str | None:
        """Account one SUBMIT_JOB reply; returns the jobId if a new job was accepted."""
        kind = reply.get("type")
        if kind == "JOB_SUBMITTED":
            job_id = reply.get("jobId")
            if expect_id is not None:
                if job_id == expect_id:
                    self.deduplicated += 1
                else:
                    self.errors["dedup_mismatch"] += 1
                    self.duplicates += 1
                return None
            if job_id in self.id_set:
                self.duplicates += 1  # two distinct submits answered with one job
                self.errors["duplicate_job_id"] += 1
                return None
            self.id_set.add(job_id)
            self.ids.append(job_id)
            self.accepted += 1
            return job_id
        if kind == "SUBMIT_REJECTED":
            self.rejected += 1
            return None
        self.errors["reply_" + str(kind).lower()] += 1
        return None


def submit_once(conn: Conn, phase: Phase, frame: bytes, key: str | None,
                expect_id: str | None = None) -> tuple[str | None, dict]:
    """One timed SUBMIT_JOB; raises on a transport or framing failure."""
    phase.sent += 1
    t0 = phase.mark_send()
    reply = conn.request(frame)
    t1 = time.perf_counter()
    phase.submit_hist.record(t1 - t0)
    phase.last_reply = t1
    return phase.on_submitted(reply, key, expect_id), reply


def submit_client(idx: int, conn: Conn, phase: Phase, workload: Workload, dup_rate: float = 0.0,
                  on_accepted: Callable[[str, float], None] | None = None) -> None:
    """Closed loop: submit, wait for the reply, repeat while the budget lasts."""
    rng = workload.rng(idx)
    dup_rng = random.Random(rng.random())
    sent_keys: list[tuple[bytes, str, str]] = []
    n = 0
    try:
        while True:
            if sent_keys and dup_rate > 0 and dup_rng.random() < dup_rate:
                frame, key, job_id = sent_keys[dup_rng.randrange(len(sent_keys))]
                submit_once(conn, phase, frame, key, expect_id=job_id)
                if phase.stop.is_set():
                    return
                continue
            if not phase.take():
                return
            frame, key = workload.submit_frame(rng, idx, n)
            n += 1
            t0 = time.perf_counter()
            job_id, reply = submit_once(conn, phase, frame, key)
            if job_id is not None:
                if key is not None and dup_rate > 0:
                    sent_keys.append((frame, key, job_id))
                if on_accepted is not None:
                    on_accepted(job_id, t0)
            elif reply.get("type") == "SUBMIT_REJECTED":
                phase.give_back()
                gevent.sleep(dup_rng.uniform(*REJECT_BACKOFF))
    except Exception as exc:  # noqa: BLE001 - counted by kind; this client ends
        phase.errors[classify(exc)] += 1
        conn.close()


def run_clients(conns: list[Conn], target, *args, **kwargs) -> list[gevent.Greenlet]:
    return [gevent.spawn(target, i, c, *args, **kwargs) for i, c in enumerate(conns)]


def wait_phase(greenlets: list[gevent.Greenlet], phase: Phase, deadline_s: float | None,
               abort: gevent.event.Event, grace_s: float = 5.0) -> bool:
    """Wait until every client ends, the deadline passes or ``abort`` is set.

    Then set ``phase.stop`` so clients finish their current request, wait ``grace_s``
    and kill what is left. Returns True if the clients all ended on their own.
    """
    end = None if deadline_s is None else time.monotonic() + deadline_s
    done = gevent.event.Event()

    def watch() -> None:
        gevent.joinall(greenlets)
        done.set()

    watcher = gevent.spawn(watch)
    finished = True
    while not done.is_set():
        if abort.is_set():
            finished = False
            break
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            finished = False
            break
        done.wait(0.2 if left is None else min(0.2, left))
    phase.stop.set()
    gevent.joinall(greenlets, timeout=grace_s)
    gevent.killall(greenlets, block=True, timeout=2)
    watcher.kill(block=False)
    return finished


class CompletionTracker:
    """Waits for accepted jobs to reach a terminal state, asking the coordinator.

    ``checker`` polls the oldest unfinished jobs in pipelined GET_JOB_STATUS batches;
    when none of a batch finished, it backs off (2..20 ms). Completion time is the
    job's ``updatedAtMillis`` (the coordinator's commit-side clock), so jobs/s does not
    depend on how promptly the checker looks.
    """

    def __init__(self) -> None:
        self.done: dict[str, tuple[str, int]] = {}   # jobId -> (state, updatedAtMillis)
        self.states: Counter = Counter()
        self.unknown: set[str] = set()
        self.repeat_terminal = 0
        self.last_update_ms = 0
        self.errors: Counter = Counter()
        self.polls = 0

    def mark(self, job_id: str, job: dict) -> None:
        if job_id in self.done:
            self.repeat_terminal += 1
            return
        updated = int(job.get("updatedAtMillis") or 0)
        self.done[job_id] = (job.get("state"), updated)
        self.states[job.get("state")] += 1
        if updated > self.last_update_ms:
            self.last_update_ms = updated

    def checker(self, conn: Conn, ids: list[str], load_done: gevent.event.Event,
                stop: gevent.event.Event) -> None:
        pending: deque[str] = deque()
        taken = 0
        idle = 0.002
        try:
            while not stop.is_set():
                while taken < len(ids):
                    pending.append(ids[taken])
                    taken += 1
                if not pending:
                    if load_done.is_set() and taken >= len(ids):
                        return
                    gevent.sleep(0.005)
                    continue
                batch = [pending.popleft() for _ in range(min(PIPELINE, len(pending)))]
                replies = conn.pipeline([status_frame(j) for j in batch])
                self.polls += len(batch)
                progress = False
                keep = []
                for job_id, reply in zip(batch, replies):
                    kind = reply.get("type")
                    if kind == "JOB_STATUS" and reply["job"].get("state") in TERMINAL:
                        self.mark(job_id, reply["job"])
                        progress = True
                    elif kind == "JOB_STATUS":
                        keep.append(job_id)
                    else:
                        self.unknown.add(job_id)
                        progress = True
                pending.extendleft(reversed(keep))
                if progress:
                    idle = 0.002
                else:
                    gevent.sleep(idle)
                    idle = min(idle * 2, 0.02)
        except Exception as exc:  # noqa: BLE001
            self.errors["checker_" + classify(exc)] += 1
