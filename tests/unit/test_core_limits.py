"""Limits per task type through the real core, with plain numbers for time (docs/PROTOCOL.md, "Limits").

Each limit (maxRunning, maxRunningPerKey, ratePerSecond/burst, ratePerKeyPerSecond, paused),
the waiting reasons and their precedence, no head-of-line blocking across types and keys,
uniqueness while active, the wake-up at a token's due time, kept leases counted after a
restart, and the rows that make limits survive one.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.core_driver import Conn
from tests.unit.test_core import Harness

T = "SLEEP"


def put(h: Harness, now: int = 0, **fields: Any) -> m.Message:
    reply = h.request(now, m.LimitPut(dict(fields, taskType=fields.pop("taskType", T))))
    h.step(now)
    return reply


def put_ok(h: Harness, now: int = 0, **fields: Any) -> dict:
    reply = put(h, now, **fields)
    assert isinstance(reply, m.Limit), reply
    return reply.limit


def submit(h: Harness, now: int = 0, task_type: str = T, ckey: str | None = None, ukey: str | None = None,
           priority: str | None = None, idem: str | None = None) -> m.Message:
    reply = h.request(now, m.SubmitJob(task_type, {"durationMillis": 10}, 0, idem, priority,
                                       concurrency_key=ckey, unique_key=ukey))
    h.step(now)
    return reply


def submit_ok(h: Harness, now: int = 0, **kw: Any) -> str:
    reply = submit(h, now, **kw)
    assert isinstance(reply, m.JobSubmitted) and not reply.duplicate, reply
    return reply.job_id


def running(h: Harness) -> set[str]:
    return {job_id for job_id in h.core.table.leases}


def reason(h: Harness, job_id: str) -> str | None:
    return h.status(job_id)["waitingReason"]


@pytest.fixture
def h() -> Harness:
    return Harness()


# ==== maxRunning ===========================================================================


def test_max_running_holds_the_rest_queued_until_an_attempt_ends(h):
    put_ok(h, maxRunning=2)
    h.register(0, "w", capacity=10)
    jobs = [submit_ok(h) for _ in range(5)]
    assert running(h) == set(jobs[:2])  # FIFO within what the limit allows
    assert reason(h, jobs[2]) == "CONCURRENCY_LIMIT"
    h.report(5, jobs[0])
    assert running(h) == {jobs[1], jobs[2]}
    assert h.request(5, m.LimitGet(T)).limit == {
        "taskType": T, "maxRunning": 2, "maxRunningPerKey": None, "ratePerSecond": None, "burst": None,
        "ratePerKeyPerSecond": None, "paused": False, "running": 2, "queued": 2}


def test_a_limit_on_one_type_never_holds_back_another(h):
    put_ok(h, maxRunning=0)
    h.register(0, "w", capacity=4, task_types=[T, "ECHO"])
    held = submit_ok(h, priority="HIGH")
    other = h.submit_ok(1, task_type="ECHO", payload={"message": "x"}, priority="LOW")
    assert running(h) == {other}
    assert reason(h, held) == "CONCURRENCY_LIMIT"


def test_raising_a_limit_assigns_at_once(h):
    put_ok(h, maxRunning=1)
    h.register(0, "w", capacity=10)
    jobs = [submit_ok(h) for _ in range(3)]
    assert len(running(h)) == 1
    put_ok(h, 1, maxRunning=3)
    assert running(h) == set(jobs)


def test_deleting_a_limit_assigns_at_once_and_answers_the_last_state(h):
    put_ok(h, maxRunning=1)
    h.register(0, "w", capacity=10)
    jobs = [submit_ok(h) for _ in range(3)]
    reply = h.request(1, m.LimitDelete(T))
    h.step(1)
    assert reply.limit["maxRunning"] == 1 and reply.limit["running"] == 1
    assert running(h) == set(jobs)
    assert h.request(1, m.LimitList()).limits == []
    assert h.request(1, m.LimitGet(T)).limit["maxRunning"] is None


# ==== maxRunningPerKey: no head-of-line blocking across keys ===================================


def test_a_key_at_its_limit_never_holds_back_another_key(h):
    put_ok(h, maxRunningPerKey=1)
    h.register(0, "w", capacity=10)
    a1 = submit_ok(h, ckey="acme", priority="HIGH")
    a2 = submit_ok(h, ckey="acme", priority="HIGH")
    b1 = submit_ok(h, ckey="bolt", priority="LOW")
    free = submit_ok(h, priority="LOW")  # no key: not limited by maxRunningPerKey
    assert running(h) == {a1, b1, free}
    assert reason(h, a2) == "KEY_CONCURRENCY_LIMIT"
    h.report(3, a1)
    assert running(h) == {a2, b1, free}


def test_within_what_limits_allow_priority_and_fifo_order_hold_across_keys(h):
    put_ok(h, maxRunningPerKey=1)
    jobs = [submit_ok(h, ckey="k%d" % i, priority=p) for i, p in enumerate(["LOW", "NORMAL", "HIGH", "NORMAL"])]
    h.register(0, "w", capacity=1)
    assert running(h) == {jobs[2]}  # HIGH first
    h.report(1, jobs[2])
    assert running(h) == {jobs[1]}  # then NORMAL, first come first
    h.report(2, jobs[1])
    assert running(h) == {jobs[3]}


def test_many_blocked_keys_are_set_aside_not_scanned(h):
    put_ok(h, maxRunningPerKey=1)
    h.register(0, "w", capacity=100)
    for i in range(50):
        submit_ok(h, ckey="k%d" % i)
        submit_ok(h, ckey="k%d" % i)
    assert len(running(h)) == 50
    queue = h.core.json.queued._by_type[T]
    assert len(queue._blocked) == 50  # each key looked at once, then set aside
    h.register(1, "w2", capacity=100)
    assert len(running(h)) == 50  # none of them may start
    assert all(len(heap) == 0 for heap in queue._heads)  # their stale entries are gone: nothing left to scan


# ==== rate limits ==================================================================================


def test_rate_limit_lets_a_burst_then_one_start_per_token_and_wakes_at_the_token_time(h):
    put_ok(h, ratePerSecond=2, burst=3)
    h.register(0, "w", capacity=100)
    jobs = [submit_ok(h) for _ in range(6)]
    assert running(h) == set(jobs[:3])  # the bucket starts full
    assert reason(h, jobs[3]) == "RATE_LIMIT"
    assert h.core.limits.next_wake() == 500  # one token every 500 ms
    h.apply(499, ev.TOKENS_DUE)
    h.step(499)
    assert len(running(h)) == 3
    h.apply(500, ev.TOKENS_DUE)
    h.step(500)
    assert running(h) == set(jobs[:4])
    assert h.core.limits.next_wake() == 1000


def test_rate_per_key_holds_that_key_only(h):
    put_ok(h, ratePerKeyPerSecond=1)
    h.register(0, "w", capacity=100)
    a1, a2 = submit_ok(h, ckey="a"), submit_ok(h, ckey="a")
    b1 = submit_ok(h, ckey="b")
    assert running(h) == {a1, b1}
    assert reason(h, a2) == "RATE_LIMIT"
    h.apply(1000, ev.TOKENS_DUE)
    h.step(1000)
    assert a2 in running(h)


def test_burst_defaults_to_the_rate_rounded_up(h):
    assert put_ok(h, ratePerSecond=2.5)["burst"] == 3
    assert put_ok(h, ratePerSecond=0.1)["burst"] == 1


# ==== pause ====================================================================================


def test_pause_stops_new_starts_lets_running_go_on_and_accepts_submits(h):
    h.register(0, "w", capacity=10)
    first = submit_ok(h)
    reply = h.request(1, m.TypePause(T))
    h.step(1)
    assert reply.limit["paused"] is True and reply.limit["running"] == 1
    later = submit_ok(h, 2)
    assert reason(h, later) == "TYPE_PAUSED" and running(h) == {first}
    h.report(3, first)
    assert h.state(first) == "COMPLETED" and h.state(later) == "QUEUED"
    h.request(4, m.TypeResume(T))
    h.step(4)
    assert running(h) == {later}


def test_put_keeps_paused_unless_given(h):
    h.request(0, m.TypePause(T))
    assert put_ok(h, maxRunning=3)["paused"] is True
    assert put_ok(h, maxRunning=3, paused=False)["paused"] is False


def test_the_first_reason_that_holds_is_shown(h):
    put_ok(h, maxRunning=1, maxRunningPerKey=1, ratePerSecond=1, paused=True)
    h.register(0, "w", capacity=10)
    job = submit_ok(h, ckey="k")
    assert reason(h, job) == "TYPE_PAUSED"
    put_ok(h, 1, maxRunning=0, maxRunningPerKey=0, ratePerSecond=1, paused=False)
    assert reason(h, job) == "CONCURRENCY_LIMIT"
    put_ok(h, 2, maxRunning=5, maxRunningPerKey=0, ratePerSecond=1)
    assert reason(h, job) == "KEY_CONCURRENCY_LIMIT"
    assert h.core.metrics().jobs_held == {(T, "KEY_CONCURRENCY_LIMIT"): 1}
    from jobmesh.coordinator.core.figures import METRICS, RuntimeFigures
    from jobmesh.coordinator.ports.http import family

    [held] = [metric for metric in METRICS if metric.name == "jobmesh_jobs_held"]
    [sample] = family(held, h.core.metrics(), cast(RuntimeFigures, None)).samples
    assert sample.labels == {"taskType": T, "reason": "KEY_CONCURRENCY_LIMIT"} and sample.value == 1


# ==== validation ================================================================================


@pytest.mark.parametrize("fields", [
    {"taskType": "NO_SUCH_TYPE", "maxRunning": 1},
    {"maxRunning": -1}, {"maxRunning": 1.5}, {"maxRunning": True}, {"maxRunningPerKey": "2"},
    {"ratePerSecond": 0}, {"ratePerSecond": -1}, {"ratePerKeyPerSecond": 0}, {"burst": 3},
    {"ratePerSecond": 1, "burst": -1}, {"paused": "yes"}, {"maxrunning": 1},
])
def test_a_bad_limit_is_an_error_and_changes_nothing(h, fields):
    put_ok(h, maxRunning=4)
    reply = put(h, 1, **fields)
    assert isinstance(reply, m.Error), reply
    assert h.request(1, m.LimitGet(T)).limit["maxRunning"] == 4


def test_changes_of_an_unknown_type_are_errors(h):
    for msg in (m.TypePause("NOPE"), m.TypeResume("NOPE"), m.LimitDelete("NOPE")):
        assert isinstance(h.request(0, msg), m.Error)
    assert h.request(0, m.LimitGet("NOPE")).limit["paused"] is False  # a read: all null
    assert h.request(0, m.LimitList()).limits == []


# ==== uniqueness ================================================================================


def test_a_unique_key_answers_the_live_job_until_it_ends(h):
    h.register(0, "w", capacity=1, task_types=[T, "ECHO"])
    first = submit_ok(h, ukey="report-7")
    again = submit(h, 1, ukey="report-7")
    assert again == m.JobSubmitted(first, duplicate=True)
    assert h.core.table.active_count == 1
    assert submit_ok(h, 1, task_type="ECHO", ukey="report-7") != first  # per type
    h.report(2, first)
    assert submit_ok(h, 3, ukey="report-7") != first  # free again once it ended
    snap = h.status(first)
    assert snap["uniqueKey"] == "report-7" and snap["concurrencyKey"] is None


def test_the_idempotency_key_is_checked_before_the_unique_key(h):
    first = submit_ok(h, ukey="u", idem="i")
    assert submit(h, 1, ukey="u", idem="i") == m.JobSubmitted(first)  # the resend answers its own job
    assert submit(h, 1, ukey="u", idem="other") == m.JobSubmitted(first, duplicate=True)


@pytest.mark.parametrize("kw", [{"ckey": ""}, {"ukey": ""}, {"ckey": "x" * 257}, {"ukey": "a\x00b"}])
def test_bad_keys_are_errors(h, kw):
    assert isinstance(submit(h, **kw), m.Error)


# ==== restarts: limits, kept leases and unique keys survive ======================================


def test_limits_kept_leases_and_unique_keys_survive_a_restart(tmp_path):
    path = str(tmp_path / "db.sqlite")
    h = Harness(SQLiteStore(path), lease_grace_millis=5000)
    put_ok(h, maxRunning=2, maxRunningPerKey=1)
    h.register(0, "w", capacity=10)
    a = submit_ok(h, ckey="a", ukey="ua")
    b = submit_ok(h, ckey="b")
    c = submit_ok(h, ckey="c")
    assert running(h) == {a, b}
    h.store.close()

    h2 = Harness(SQLiteStore(path), prefix="re", lease_grace_millis=5000)
    h2.core.recover(10)
    h2.commit()
    assert h2.request(10, m.LimitGet(T)).limit["maxRunning"] == 2
    assert h2.core.table.unclaimed == {a, b}
    h2.register(10, "other", capacity=10)
    assert running(h2) == set()  # the two kept leases count: nothing more starts
    assert h2.status(c)["waitingReason"] == "CONCURRENCY_LIMIT"
    assert submit(h2, 11, ukey="ua") == m.JobSubmitted(a, duplicate=True)
    h2.sweep(5011)  # the grace ends: both requeued, and the limit lets two start
    assert len(running(h2)) == 2


# ==== the Periodic port's jobs obey the limit of their func ======================================


def test_a_periodic_func_obeys_the_limit_of_its_name():
    from jobmesh.periodic import codec as pc
    from tests.unit.test_core_periodic import T0, H, assigns

    p = H()
    w = Conn("pw")
    p.worker(T0, w, "f", tokens=4)  # the func is known: its limit may be set
    p.request(T0, m.LimitPut({"taskType": "f", "maxRunning": 1}))
    p.finish(T0)
    out = p.submit(T0, name="a") + p.submit(T0, name="b")
    assert len(assigns(out)) == 1  # one of the four tokens: the limit holds the other job
    held = p.job(name="b")
    assert p.core.requests.snapshot(held)["waitingReason"] == "CONCURRENCY_LIMIT"
    out = p.send(T0 + 5, w, pc.WorkDone(9, pc.Handle(b"f", b"a"), b"ok"))  # its run ends: the next starts
    assert [a.job.name for a in assigns(out)] == [b"b"]
    p.request(T0 + 6, m.TypePause("f"))
    p.finish(T0 + 6)
    out = p.submit(T0 + 7, name="c")
    assert assigns(out) == [] and p.core.requests.snapshot(p.job(name="c"))["waitingReason"] == "TYPE_PAUSED"
    p.request(T0 + 8, m.TypeResume("f"))
    p.send(T0 + 8, w, pc.WorkDone(10, pc.Handle(b"f", b"b"), b"ok"))
    assert p.job(name="c").state is JobState.RUNNING


def test_after_a_recovery_with_nothing_to_keep_a_unique_key_or_a_limit_is_still_kept():
    # Given a core recovered from an empty store (nothing limited, no unique key held)
    h = Harness()
    h.core.recover(0)
    h.register(0, "w", capacity=1)
    # Then a unique key is held while its job lives, and freed when it ends
    first = submit_ok(h, ukey="u")
    assert submit(h, 1, ukey="u") == m.JobSubmitted(first, duplicate=True)
    h.report(2, first)
    assert submit_ok(h, 3, ukey="u") != first
    # ... and a limit set now counts the job already running
    put_ok(h, 4, maxRunning=1)
    queued = submit_ok(h, 5)
    assert reason(h, queued) == "CONCURRENCY_LIMIT"
