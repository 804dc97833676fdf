"""What a task type and a job may ask for: ``@task`` options kept per type, a job's own
deadline, and a result's time to live (CONTRACT.md "What a task can say and ask for").

Real coordinators and real ``jobmesh worker --tasks=jm_user_tasks,jm_task_options``
processes (``tests/user_tasks_module.py``, and ``tests/task_options_module.py`` whose
ONCE, HASTY and PATIENT types declare options).
The stateless tests share one coordinator and one worker; those that restart or need no
worker connected start their own.
"""

from __future__ import annotations

import shutil
import uuid

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.errors import RequestFailed
from tests.support.peers import RegistrationRefused, wait_registered
from tests.support.processes import WorkerProcs
from tests.support.waiting import wait_until
from tests.integration.test_user_tasks import MODULE_SOURCE

OPTIONS_SOURCE = MODULE_SOURCE.parent / "task_options_module.py"
TASKS = "jm_user_tasks,jm_task_options"


def copy_modules(where) -> None:
    shutil.copy(MODULE_SOURCE, where / "jm_user_tasks.py")
    shutil.copy(OPTIONS_SOURCE, where / "jm_task_options.py")
from tests.pg_support import on_both_stores

WEEK_MILLIS = 7 * 24 * 3600 * 1000
TEN_YEARS_MILLIS = 315_360_000_000


@pytest.fixture(scope="module")
def shared(module_coordinator, tmp_path_factory):
    """The module's coordinator with one real worker running both modules (capacity 2)."""
    where = tmp_path_factory.mktemp("user-worker")
    copy_modules(where)
    procs = WorkerProcs(where)
    procs.start(module_coordinator, "w-defaults", capacity=2, tasks=TASKS, cwd=where)
    with CoordinatorClient(*module_coordinator.client_addr, timeout=10) as client:
        wait_registered(client, ["w-defaults"])
    yield module_coordinator
    procs.cleanup()


@pytest.fixture
def client(shared):
    with CoordinatorClient(*shared.client_addr, timeout=10) as c:
        yield c


def purged(client: CoordinatorClient, job_id: str) -> bool:
    try:
        client.status(job_id)
    except RequestFailed as exc:
        assert "unknown job" in str(exc), exc
        return True
    return False


# ---- the type's defaults, from @task options --------------------------------------------


def test_a_types_max_attempts_applies_to_a_submit_that_names_none(client):
    # Given ONCE declared with max_attempts=1 (the coordinator's default is 3)
    # When a ONCE job is submitted without maxAttempts, and one with its own
    job = client.wait(client.submit("ONCE", {}), timeout=15)
    own = client.wait(client.submit("ONCE", {}, max_attempts=2), timeout=15)
    # Then the first fails after its type's single attempt; the second makes its own two
    assert (job["state"], job["attempts"], job["maxAttempts"]) == ("FAILED", 1, 1), job
    assert job["error"] == "RuntimeError: once is enough"
    assert (own["state"], own["attempts"], own["maxAttempts"]) == ("FAILED", 2, 2), own


def test_a_schedule_that_names_no_max_attempts_makes_jobs_with_their_types(client):
    # Given schedules of ONCE (max_attempts=1): one naming no maxAttempts, one naming 2
    plain = client.schedules.put("once-plain", "ONCE", {}, every=3600, paused=True)
    own = client.schedules.put("once-own", "ONCE", {}, every=3600, paused=True, max_attempts=2)
    # Then each shows the budget its jobs get
    assert (plain["maxAttempts"], own["maxAttempts"]) == (1, 2), (plain, own)
    # And a job each makes has that budget: the type's single attempt, or the schedule's two
    jobs = [client.wait(client.schedules.trigger(name), timeout=15) for name in ("once-plain", "once-own")]
    assert [(job["state"], job["attempts"], job["maxAttempts"]) for job in jobs] == [("FAILED", 1, 1),
                                                                                    ("FAILED", 2, 2)], jobs


def test_a_types_timeout_ends_its_attempts_and_a_jobs_own_timeout_beats_it(client):
    # Given HASTY declared with timeout=0.3 s (the coordinator's --task-timeout-millis is 60 s)
    # When a HASTY job runs far longer than that
    late = client.wait(client.submit("HASTY", {"seconds": 30}), timeout=30)
    # Then its attempt times out at its type's deadline
    assert (late["state"], late["attempts"]) == ("FAILED", 1), late
    assert late["error"] == "attempt 1 exceeded its execution deadline of 300 ms", late
    events = [e["event"] for e in client.events(late["jobId"])]
    assert "LEASE_EXPIRED" in events, events
    # And a job of the same type with its own timeoutMillis runs past 300 ms to its end
    own = client.wait(client.submit("HASTY", {"seconds": 1}, timeout_millis=60_000), timeout=30)
    assert (own["state"], own["result"]) == ("COMPLETED", {"cancelled": False}), own


def test_a_types_retry_backoff_sets_the_wait_before_its_next_attempt(client):
    # Given PATIENT declared with retry_backoff=(1.5, 1.5) (the coordinator's: 20 ms .. 200 ms)
    job = client.wait(client.submit("PATIENT", {}), timeout=30)
    assert (job["state"], job["attempts"], job["maxAttempts"]) == ("COMPLETED", 2, 2), job
    # Then the retry waited its type's 1.5 s, as the timeline's RETRY_WAIT event says
    retry = next(e for e in client.events(job["jobId"]) if e["event"] == "RETRY_WAIT")
    assert retry["retryAtMillis"] - retry["atMillis"] == 1500, retry


# ---- a job's own fields -------------------------------------------------------------------


def test_a_finished_job_is_purged_with_its_timeline_once_its_time_to_live_ends(client):
    # Given jobs that end: one kept no time at all, one kept an hour, one without a time to live
    gone = client.submit("GREET", {"name": "brief"}, result_ttl_millis=0)
    kept = client.submit("GREET", {"name": "kept"}, result_ttl_millis=3_600_000)
    plain = client.submit("GREET", {"name": "plain"})
    for job_id in (kept, plain):
        assert client.wait(job_id, timeout=15)["state"] == "COMPLETED"
    # Then the first is purged by a sweep (its status and timeline: unknown job)
    wait_until(lambda: purged(client, gone), timeout=15, message="the job with no time to live purged")
    with pytest.raises(RequestFailed, match="unknown job"):
        client.events(gone)
    # And the others stay, the kept one showing its time to live
    assert client.status(kept)["resultTtlMillis"] == 3_600_000
    assert "resultTtlMillis" not in client.status(plain)


@pytest.mark.parametrize("fields, error", [
    ({"timeoutMillis": 0}, "timeoutMillis must be 1..604800000"),
    ({"timeoutMillis": WEEK_MILLIS + 1}, "timeoutMillis must be 1..604800000"),
    ({"resultTtlMillis": -1}, "resultTtlMillis must be 0..315360000000"),
    ({"resultTtlMillis": TEN_YEARS_MILLIS + 1}, "resultTtlMillis must be 0..315360000000"),
    ({"timeoutMillis": "60"}, "field 'timeoutMillis' must be an integer or null"),
])
def test_a_submit_with_a_field_out_of_bounds_is_refused(shared, peers, fields, error):
    client = peers.client(shared)
    reply = client.submit("GREET", {"name": "x"}, **fields)
    assert reply["type"] == "ERROR" and error in reply["message"], reply


def test_the_bounds_themselves_are_accepted(shared, peers):
    client = peers.client(shared)
    for fields in ({"timeoutMillis": 1}, {"timeoutMillis": WEEK_MILLIS}, {"resultTtlMillis": TEN_YEARS_MILLIS}):
        assert client.submit("GREET", {"name": "x"}, **fields)["type"] == "JOB_SUBMITTED", fields


# ---- who may declare what -------------------------------------------------------------------


@pytest.mark.parametrize("defaults, error", [
    ({"NOT_MINE": {"maxAttempts": 2}}, "which this worker does not declare"),
    ({"DECLARED": {"timeoutMillis": 0}}, "timeoutMillis must be an integer 1..604800000"),
    ({"DECLARED": {"timeoutMillis": WEEK_MILLIS + 1}}, "timeoutMillis must be an integer 1..604800000"),
    ({"DECLARED": {"maxAttempts": 0}}, "maxAttempts must be an integer 1..1000000"),
    ({"DECLARED": {"maxAttempts": 1_000_001}}, "maxAttempts must be an integer 1..1000000"),
    ({"DECLARED": {"retryBaseMillis": -1}}, "retryBaseMillis must be an integer 0..315360000000"),
    ({"DECLARED": {"retryCapMillis": TEN_YEARS_MILLIS + 1}}, "retryCapMillis must be an integer 0..315360000000"),
    ({"DECLARED": {"retryBaseMillis": 500, "retryCapMillis": 100}}, "retryBaseMillis 500 is above retryCapMillis 100"),
    ({"DECLARED": {"maxAttempts": True}}, "maxAttempts must be an integer"),
    ({"DECLARED": [1]}, "must be an object"),
], ids=["undeclared-type", "timeout-0", "timeout-over-7-days", "attempts-0", "attempts-over-limit",
        "negative-base", "cap-over-ten-years", "base-over-cap", "bool", "not-an-object"])
def test_a_registration_with_bad_task_defaults_is_refused_and_keeps_nothing(shared, peers, defaults, error):
    # Given a worker declaring DECLARED (a fresh name per case) with taskDefaults at fault
    name = "DECLARED-%s" % uuid.uuid4().hex[:12]
    defaults = {name if key == "DECLARED" else key: value for key, value in defaults.items()}
    worker = peers.worker(shared, "w-bad-%s" % name, register=False)
    # When it registers, it gets an ERROR naming the fault, and its connection is closed
    with pytest.raises(RegistrationRefused) as refused:
        worker.register(task_types=[name], extra={"taskDefaults": defaults})
    assert refused.value.reply["type"] == "ERROR" and error in refused.value.reply["message"], refused.value.reply
    assert worker.conn.is_closed()
    # And nothing was kept: the type is unknown (its declaration was refused with the rest)
    reply = peers.client(shared).submit(name, {})
    assert reply["type"] == "ERROR" and "unknown task type" in reply["message"], reply


# ---- kept durably, by the latest declaration ------------------------------------------------


@on_both_stores
def test_defaults_survive_a_restart_and_apply_while_no_worker_is_connected(coordinator_factory, worker_procs,
                                                                           tmp_path, peers):
    # Given a worker that declared ONCE (max_attempts=1) and HASTY (timeout 0.3 s), then left
    coord = coordinator_factory()
    copy_modules(tmp_path)
    worker = worker_procs.start(coord, "w-first", capacity=1, tasks=TASKS, cwd=tmp_path)
    with CoordinatorClient(*coord.client_addr, timeout=10) as client:
        wait_registered(client, ["w-first"])
        assert worker.terminate() == 0
        # and a job with a time to live, queued while no worker runs its type
        brief = client.submit("GREET", {"name": "brief"}, result_ttl_millis=0)
    # When the coordinator restarts and a ONCE job is submitted with no worker connected
    assert coord.terminate() == 0
    coord.start()
    with CoordinatorClient(*coord.client_addr, timeout=10) as client:
        assert client.workers() == []
        once = client.submit("ONCE", {})
        # Then it has its type's budget, kept from the registration before the restart
        assert client.status(once)["maxAttempts"] == 1
        # and the queued job kept its time to live
        assert client.status(brief)["resultTtlMillis"] == 0
        # When a worker registers with no taskDefaults at all, running ONCE
        scripted = peers.worker(coord, "w-plain", task_types=["ONCE"])
        # Then the kept defaults stand: a new ONCE job gets one attempt, and fails after it
        again = client.submit("ONCE", {})
        for _ in range(2):
            scripted.fail(scripted.await_assign(timeout=15), "no")
        assert [client.wait(job_id, timeout=15)["state"] for job_id in (once, again)] == ["FAILED"] * 2
        assert client.status(again)["maxAttempts"] == 1
        # And the job with a time to live, once it ends, is purged by a sweep
        greeter = peers.worker(coord, "w-greet", task_types=["GREET"])
        greeter.complete(greeter.await_assign(timeout=15), {"greeting": "hi"})
        wait_until(lambda: purged(client, brief), timeout=15, message="the queued job with no time to live purged")
        # When a later registration declares ONCE differently, the latest declaration wins
        earlier = client.submit("ONCE", {}, delay=3600)
        client.schedules.put("once-later", "ONCE", {}, every=3600, paused=True)
        newer = peers.worker(coord, "w-newer", register=False)
        newer.register(task_types=["ONCE"], extra={"taskDefaults": {"ONCE": {"maxAttempts": 4}}})
        assert client.status(client.submit("ONCE", {}))["maxAttempts"] == 4
        # for new jobs, a schedule's too; a job made before keeps the budget it was given
        assert client.status(client.schedules.trigger("once-later"))["maxAttempts"] == 4
        assert client.status(earlier)["maxAttempts"] == 1
