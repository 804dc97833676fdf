"""The ``Store`` contract (jobmesh/store/base.py): what every store must do, whatever its
backend. Each test runs once per backend in ``BACKENDS``; a new store passes this module
unchanged once it adds a backend entry (how to open it, how to make its writes fail).

Backend specifics (schema, migrations, SQL plans) live beside the backend's own tests
(test_store.py for SQLite); each backend here breaks writes with the fault file of its
test-only store (tests/support/faulty_store.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.store.base import Batch, StorageFault, Store, merge_batches
from jobmesh.store.columns import insert_row, update_row
from jobmesh.store.job import Job
from tests import pg_support
from tests.support.faulty_store import FaultySQLiteStore, faulty_postgres_store


class SQLiteBackend:
    """A file database; writes fail while the fault file says ``readonly``."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = str(tmp_path / "jobs.db")
        self.fault = tmp_path / "fault"

    def open(self) -> Store:
        return FaultySQLiteStore(self.path, "FULL", str(self.fault))

    def break_writes(self) -> None:
        self.fault.write_text("readonly")

    def heal(self) -> None:
        self.fault.write_text("")


class PostgresBackend:
    """A fresh schema on the session's PostgreSQL server (tests/pg_support.py), led by the
    store opened; writes fail (read-only transactions) while the fault file says ``readonly``."""

    def __init__(self, tmp_path: Path) -> None:
        self.url = pg_support.server().schema()
        self.fault = tmp_path / "fault"

    def open(self) -> Store:
        store = faulty_postgres_store()(self.url, fault_file=str(self.fault))
        store.lead(lambda: None)
        return store

    def break_writes(self) -> None:
        self.fault.write_text("readonly")

    def heal(self) -> None:
        self.fault.write_text("")


BACKENDS: dict[str, Callable[[Path], SQLiteBackend | PostgresBackend]] = {
    "sqlite": SQLiteBackend, "postgres": PostgresBackend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, tmp_path):
    return BACKENDS[request.param](tmp_path)


@pytest.fixture
def store(backend):
    s = backend.open()
    yield s
    s.close()


def make_job(job_id: str, seq: int, **kw) -> Job:
    fields = dict(job_id=job_id, seq=seq, task_type="SLEEP", payload={"durationMillis": 5}, max_attempts=3,
                  priority=Priority.NORMAL, created_at=1000 + seq)
    fields.update(kw)
    return Job(**fields)


def fields_of(job: Job | None) -> dict:
    assert job is not None
    return {name: getattr(job, name) for name in Job.__slots__ if name not in ("event_count", "event_last_at")}


def insert(store: Store, *jobs: Job) -> None:
    store.write(Batch([insert_row(j) for j in jobs], []))


def ids(pairs: list[tuple[int, Job]]) -> list[str]:
    return [job.job_id for _, job in pairs]


# ---- empty ---------------------------------------------------------------------------------


def test_a_new_store_is_empty(store):
    assert store.max_seq() == 0
    assert list(store.load_active()) == []
    assert store.load_task_types() == []
    assert store.list_page(10, None, None) == []
    assert store.get("nope") is None
    assert store.find_by_key("nope") is None
    assert store.purgeable(0, 10**15, 10) == ([], 0)
    store.write(Batch([], []))  # an empty batch is fine
    assert store.max_seq() == 0


# ---- writes and reads ----------------------------------------------------------------------


def test_every_field_round_trips_including_json_and_unicode(store):
    job = make_job(
        "ジョブ-1", 42, task_type="WORD_COUNT",
        payload={"text": "héllo wörld ✓ 😀 / \"quoted\" \\ back\nslash", "extra": [1, {"n": None}]},
        max_attempts=7, priority=Priority.HIGH, created_at=1_700_000_000_123,
        idempotency_key="clé-😀", state=JobState.RUNNING, attempts=2, worker_id="wörker",
        attempt_id="att-1", result={"words": 3, "nested": {"ü": ["a", 1.5, True, None]}},
        error="boom: ünïcode 💥", updated_at=1_700_000_000_999, execution_timeout=600_000,
        deadline=2**62, run_at=1_700_000_000_500, retry_of="older", name="nightly",
        periodic={"workload": "d29yaw==", "b64": True, "count": 1, "timeout": 30, "sched": 5},
        events='[5,"S"],[7,"A",1,"wörker"]', result_ttl=315_360_000_000, retry_base=1500, retry_cap=2**40,
    )
    insert(store, job)
    got = store.get("ジョブ-1")
    assert fields_of(got) == fields_of(job)
    assert got.state is JobState.RUNNING and got.priority is Priority.HIGH
    assert fields_of(store.find_by_key("clé-😀")) == fields_of(job)
    assert got.snapshot() == job.snapshot()


def test_an_update_writes_the_changed_fields_and_keeps_the_rest(store):
    job = make_job("j1", 9, priority=Priority.LOW, idempotency_key="k", execution_timeout=50)
    insert(store, job)
    job.state = JobState.RETRY_WAIT
    job.attempts = 1
    job.error = "nope"
    job.retry_at = 5000
    job.updated_at = 4000
    job.events = '[4000,"R"]'
    store.write(Batch([], [update_row(job)]))
    assert fields_of(store.get("j1")) == fields_of(job)
    job.state = JobState.COMPLETED
    job.retry_at = None
    job.result = {"sleptMillis": 5}
    store.write(Batch([], [update_row(job)]))
    assert fields_of(store.get("j1")) == fields_of(job)
    assert fields_of(store.find_by_key("k")) == fields_of(job)


def test_reads_return_a_new_record_each_time(store):
    insert(store, make_job("j1", 1))
    first = store.get("j1")
    first.state = JobState.CANCELLED
    assert store.get("j1").state is JobState.QUEUED


def test_a_failing_batch_writes_nothing_and_the_store_stays_usable(store):
    a = make_job("a", 1)
    insert(store, a)
    changed = make_job("a", 1, state=JobState.CANCELLED, updated_at=9)
    with pytest.raises(Exception):  # the same job inserted twice: whatever the driver raises
        store.write(Batch([insert_row(make_job("b", 2)), insert_row(make_job("b", 3))], [update_row(changed)],
                          [("NEW_TYPE", 5)], ["a"]))
    assert store.get("b") is None
    assert fields_of(store.get("a")) == fields_of(a)
    assert store.load_task_types() == []
    store.write(Batch([insert_row(make_job("b", 2))], [update_row(changed)]))
    assert store.get("a").state is JobState.CANCELLED and store.get("b") is not None


def test_idempotency_keys_are_unique_but_jobs_without_one_are_many(store):
    insert(store, make_job("a", 1), make_job("b", 2))
    insert(store, make_job("k1", 3, idempotency_key="k"))
    with pytest.raises(Exception):
        insert(store, make_job("k2", 4, idempotency_key="k"))
    assert store.find_by_key("k").job_id == "k1"
    assert store.get("k2") is None
    assert store.find_by_key("other") is None


def test_task_types_keep_their_first_sighting_and_list_sorted(store):
    store.write(Batch([], [], [("GREET", 5)]))
    store.write(Batch([], [], [("GREET", 6), ("ALPHA", 6)]))
    assert store.load_task_types() == ["ALPHA", "GREET"]


def fill(store: Store) -> list[Job]:
    """Eight jobs in two commits, sequences 10..80, two task types, mixed states."""
    states = [JobState.QUEUED, JobState.RUNNING, JobState.COMPLETED, JobState.RETRY_WAIT, JobState.FAILED,
              JobState.QUEUED, JobState.CANCELLED, JobState.SCHEDULED]
    jobs = [make_job("j%d" % i, i * 10, state=s, task_type="SLEEP" if i % 2 else "ECHO")
            for i, s in enumerate(states, start=1)]
    insert(store, *jobs[:3])
    insert(store, *jobs[3:])
    return jobs


def test_load_active_and_max_seq(store):
    fill(store)
    active = {j.job_id: j.state for j in store.load_active()}
    assert active == {"j1": JobState.QUEUED, "j2": JobState.RUNNING, "j4": JobState.RETRY_WAIT,
                      "j6": JobState.QUEUED, "j8": JobState.SCHEDULED}
    assert store.max_seq() == 80


# ---- listing pages -------------------------------------------------------------------------


def test_pages_are_newest_first_and_a_sequence_is_the_cursor(store):
    jobs = fill(store)
    newest_first = [j.job_id for j in reversed(jobs)]
    page = store.list_page(3, None, None)
    assert ids(page) == newest_first[:3]
    assert [seq for seq, _ in page] == [80, 70, 60]
    assert all(seq == job.seq for seq, job in page)
    seen: list[str] = []
    before = None
    while True:
        page = store.list_page(3, None, before)
        if not page:
            break
        seen += ids(page)
        before = page[-1][0]
    assert seen == newest_first
    assert ids(store.list_page(100, None, 45)) == ["j4", "j3", "j2", "j1"]  # strictly below the cursor
    assert store.list_page(100, None, 10) == []


def test_pages_filter_by_state_and_task_type(store):
    fill(store)
    assert ids(store.list_page(100, "QUEUED", None)) == ["j6", "j1"]
    assert ids(store.list_page(100, None, None, "ECHO")) == ["j8", "j6", "j4", "j2"]
    assert ids(store.list_page(100, "QUEUED", None, "ECHO")) == ["j6"]
    assert ids(store.list_page(1, None, 60, "ECHO")) == ["j4"]
    assert store.list_page(100, "NOPE", None) == []
    assert store.list_page(100, None, None, "NOPE") == []


def test_an_update_moves_a_job_between_states_but_not_in_the_order(store):
    jobs = fill(store)
    jobs[0].state = JobState.RUNNING
    store.write(Batch([], [update_row(jobs[0])]))
    assert ids(store.list_page(100, "RUNNING", None)) == ["j2", "j1"]
    assert ids(store.list_page(100, None, None))[-1] == "j1"
    cursor = store.list_page(1, "RUNNING", None)[0][0]
    assert ids(store.list_page(100, "RUNNING", cursor)) == ["j1"]


# ---- retention -----------------------------------------------------------------------------


def finished(job_id: str, seq: int, updated_at: int, key: str | None = None) -> Job:
    return make_job(job_id, seq, state=JobState.COMPLETED, updated_at=updated_at, idempotency_key=key)


def test_purgeable_walks_oldest_first_and_steps_over_active_jobs(store):
    insert(store, finished("f1", 1, 100, "k1"), make_job("a2", 2), finished("f3", 3, 100),
           finished("f4", 4, 900), finished("f5", 5, 100))
    # A walk stops at the first finished job not old enough yet (the rest are newer).
    assert store.purgeable(0, 500, 10) == ([("f1", "k1"), ("f3", None)], 0)
    # A walk that examines its limit continues past the rows it examined.
    found, cursor = store.purgeable(0, 500, 2)
    assert found == [("f1", "k1")]
    assert cursor == 2
    # The next one meets f4, finished too recently: it stops there and starts over next time.
    assert store.purgeable(cursor, 500, 2) == ([("f3", None)], 0)
    # Everything old enough: the walk reaches the end.
    assert store.purgeable(0, 1000, 10) == ([("f1", "k1"), ("f3", None), ("f4", None), ("f5", None)], 0)


def test_a_purge_deletes_rows_and_frees_their_keys(store):
    insert(store, finished("f1", 1, 100, "k1"), make_job("a2", 2), finished("f3", 3, 100))
    found, _ = store.purgeable(0, 500, 10)
    store.write(Batch([], [], [], [job_id for job_id, _ in found]))
    assert store.get("f1") is None and store.get("f3") is None
    assert store.find_by_key("k1") is None
    assert ids(store.list_page(10, None, None)) == ["a2"]
    assert store.purgeable(0, 500, 10) == ([], 0)
    insert(store, make_job("again", 4, idempotency_key="k1"))  # the key is free again
    assert store.find_by_key("k1").job_id == "again"
    assert store.max_seq() == 4


# ---- where commits run ---------------------------------------------------------------------


def test_commits_run_in_order_and_report_success(store):
    job = make_job("j1", 1)
    first = store.commit(Batch([insert_row(job)], []))
    job.state = JobState.CANCELLED
    job.updated_at = 2000
    second = store.commit(Batch([], [update_row(job)]))
    probe = store.commit_probe()
    assert second.get() is None and first.get() is None and probe.get() is None
    assert first.ready() and second.ready() and probe.ready()
    assert fields_of(store.get("j1")) == fields_of(job)


def test_a_failed_commit_returns_its_error_and_writes_nothing(store):
    insert(store, make_job("j1", 1))
    failure = store.commit(Batch([insert_row(make_job("j1", 2))], [])).get()  # the id exists
    assert isinstance(failure, Exception)
    assert store.get("j1").seq == 1 and store.max_seq() == 1


# ---- storage faults ------------------------------------------------------------------------


def test_storage_faults_are_typed_and_writes_resume_when_storage_heals(backend, store):
    insert(store, make_job("j1", 1))
    backend.break_writes()
    with pytest.raises(StorageFault) as caught:
        store.probe()
    assert caught.value.reason == "database is read-only" and caught.value.__cause__ is not None
    with pytest.raises(StorageFault):
        store.write(Batch([insert_row(make_job("j2", 2))], []))
    failure = store.commit(Batch([insert_row(make_job("j2", 2))], [])).get()
    assert isinstance(failure, StorageFault) and failure.reason == "database is read-only"
    assert isinstance(store.commit_probe().get(), StorageFault)
    # Reads go on while writes fail.
    assert store.get("j1") is not None and store.get("j2") is None
    assert ids(store.list_page(10, None, None)) == ["j1"]
    backend.heal()
    assert store.commit_probe().get() is None
    insert(store, make_job("j2", 2))
    assert ids(store.list_page(10, None, None)) == ["j2", "j1"]


def test_a_bug_in_a_batch_is_raised_as_it_is_not_as_a_storage_fault(store):
    # Rows that are no rows: the program's bug, not the database's
    failure = store.commit(Batch([None], [])).get()  # type: ignore[list-item]
    assert isinstance(failure, TypeError)


# ---- close and reopen ----------------------------------------------------------------------


def test_reopening_keeps_everything(backend, store):
    jobs = fill(store)
    keyed = make_job("keyed", 90, idempotency_key="key-1", state=JobState.COMPLETED, result={"ok": True},
                     events='[1,"S"],[2,"C"]')
    insert(store, keyed)
    store.write(Batch([], [], [("ECHO", 1), ("SLEEP", 2)]))
    store.close()
    again = backend.open()
    try:
        for job in jobs + [keyed]:
            assert fields_of(again.get(job.job_id)) == fields_of(job)
        assert fields_of(again.find_by_key("key-1")) == fields_of(keyed)
        assert ids(again.list_page(100, None, None)) == ["keyed"] + [j.job_id for j in reversed(jobs)]
        assert {j.job_id for j in again.load_active()} == {"j1", "j2", "j4", "j6", "j8"}
        assert again.load_task_types() == ["ECHO", "SLEEP"]
        assert again.max_seq() == 90
        assert again.migrated == []
    finally:
        again.close()


def test_a_read_later_gives_what_get_and_find_by_key_give_and_wakes_its_caller(store):
    insert(store, make_job("a", 1, idempotency_key="k"), make_job("b", 2))
    for read, expected in ((store.read_later(job_id="a"), "a"), (store.read_later(key="k"), "a"),
                           (store.read_later(job_id="missing"), None), (store.read_later(key="nope"), None)):
        woken: list[int] = []
        read.then(lambda: woken.append(1))
        deadline = time.monotonic() + 10
        while not read.ready() and time.monotonic() < deadline:
            time.sleep(0.001)  # a networked store finishes the read on its own
        assert read.ready() and woken == [1]
        job = read.result()
        assert (job.job_id if job is not None else None) == expected
        if job is not None:
            assert fields_of(job) == fields_of(store.get("a"))


def test_a_batch_deletes_before_it_inserts_so_a_new_job_may_take_a_purged_key(store):
    insert(store, finished("old", 1, 100, key="k"))
    store.write(Batch([insert_row(make_job("new", 2, idempotency_key="k"))], [], (), ["old"]))
    assert store.get("old") is None and store.find_by_key("k").job_id == "new"


def test_schedules_are_written_replaced_and_deleted_with_the_jobs_of_their_batch(backend, store):
    # A new store has none; a batch writes a schedule and the job its fire made together.
    assert store.load_schedules() == []
    fired = make_job("f1", 1, idempotency_key="schedule:b:60000", schedule_name="b", scheduled_for=60_000)
    store.write(Batch([insert_row(fired)], [], schedules=[("b", '{"cursor": 60000}'), ("a", '{"x": "é"}')]))
    assert store.load_schedules() == [("a", '{"x": "é"}'), ("b", '{"cursor": 60000}')]
    assert fields_of(store.get("f1")) == fields_of(fired)
    # A later row replaces a schedule's body; None deletes it.
    store.write(Batch([], [], schedules=[("b", '{"cursor": 120000}'), ("a", None)]))
    assert store.load_schedules() == [("b", '{"cursor": 120000}')]
    # A batch that fails writes neither the job nor the schedule's advance.
    with pytest.raises(Exception):
        store.write(Batch([insert_row(make_job("f2", 2, idempotency_key="schedule:b:60000"))], [],
                          schedules=[("b", '{"cursor": 180000}')]))
    assert store.load_schedules() == [("b", '{"cursor": 120000}')] and store.get("f2") is None
    store.close()
    again = backend.open()
    try:
        assert again.load_schedules() == [("b", '{"cursor": 120000}')]
    finally:
        again.close()


def test_merged_batches_keep_the_newest_row_of_each_schedule():
    older = Batch([], [], schedules=[("a", "1"), ("b", "1")])
    newer = Batch([], [], schedules=[("a", None), ("c", "2")])
    assert sorted(merge_batches(older, newer).schedules, key=lambda r: r[0]) == [("a", None), ("b", "1"), ("c", "2")]


def test_limits_are_written_replaced_and_deleted_with_their_batch_and_kept_on_reopening(backend, store):
    # A new store has none; a batch writes limits and jobs with both keys together.
    assert store.load_limits() == []
    job = make_job("k1", 1, concurrency_key="acme", unique_key="report-ü")
    store.write(Batch([insert_row(job)], [], limits=[("SLEEP", '{"maxRunning": 2}'), ("EXPORT", '{"paused": true}')]))
    assert store.load_limits() == [("EXPORT", '{"paused": true}'), ("SLEEP", '{"maxRunning": 2}')]
    got = store.get("k1")
    assert got is not None and (got.concurrency_key, got.unique_key) == ("acme", "report-ü")
    # A later row replaces a type's limit; None deletes it.
    store.write(Batch([], [], limits=[("SLEEP", '{"maxRunning": 3}'), ("EXPORT", None)]))
    assert store.load_limits() == [("SLEEP", '{"maxRunning": 3}')]
    # A batch that fails writes neither its jobs nor its limits.
    with pytest.raises(Exception):
        store.write(Batch([insert_row(make_job("k1", 2))], [], limits=[("SLEEP", None)]))
    assert store.load_limits() == [("SLEEP", '{"maxRunning": 3}')]
    store.close()
    again = backend.open()
    try:
        assert again.load_limits() == [("SLEEP", '{"maxRunning": 3}')]
        assert [(j.job_id, j.concurrency_key, j.unique_key) for j in again.load_active()] == [
            ("k1", "acme", "report-ü")]
    finally:
        again.close()


def test_task_defaults_are_kept_per_type_the_latest_winning_and_survive_a_reopen(backend, store):
    assert store.load_task_defaults() == []
    store.write(Batch([], [], [("GREET", 1)], task_defaults=[("GREET", '{"maxAttempts": 1}'), ("ALPHA", "{}")]))
    # A later batch replaces one type's body and leaves the other's alone.
    store.write(Batch([], [], task_defaults=[("GREET", '{"maxAttempts": 2, "timeoutMillis": 5}')]))
    assert store.load_task_defaults() == [("ALPHA", "{}"), ("GREET", '{"maxAttempts": 2, "timeoutMillis": 5}')]
    # A batch that fails keeps none of its defaults.
    with pytest.raises(Exception):
        store.write(Batch([insert_row(make_job("x", 1)), insert_row(make_job("x", 2))], [],
                          task_defaults=[("ALPHA", '{"maxAttempts": 9}')]))
    store.close()
    again = backend.open()
    try:
        assert again.load_task_defaults() == [("ALPHA", "{}"), ("GREET", '{"maxAttempts": 2, "timeoutMillis": 5}')]
    finally:
        again.close()


def test_merged_batches_keep_the_newest_row_of_each_limit():
    older = Batch([], [], limits=[("A", "1"), ("B", "1")])
    newer = Batch([], [], limits=[("A", None), ("C", "2")])
    assert sorted(merge_batches(older, newer).limits, key=lambda r: r[0]) == [("A", None), ("B", "1"), ("C", "2")]


def test_merged_batches_keep_the_newest_defaults_of_each_type():
    older = Batch([], [], task_defaults=[("a", "1"), ("b", "1")])
    newer = Batch([], [], task_defaults=[("a", "2")])
    assert sorted(merge_batches(older, newer).task_defaults) == [("a", "2"), ("b", "1")]


def test_expired_finds_finished_jobs_past_their_time_to_live_earliest_first(store):
    insert(store,
           make_job("late", 1, state=JobState.FAILED, updated_at=100, result_ttl=900),  # expires at 1000
           make_job("soon", 2, state=JobState.COMPLETED, updated_at=300, result_ttl=0, idempotency_key="k"),  # 300
           make_job("mid", 3, state=JobState.CANCELLED, updated_at=200, result_ttl=400),  # 600
           make_job("running", 4, state=JobState.RUNNING, updated_at=100, result_ttl=0),  # active: never
           make_job("plain", 5, state=JobState.COMPLETED, updated_at=100))  # no time to live: retention's
    assert store.expired(299, 10) == []
    # Retention's walk steps over them (their own time to live decides), PURGE_JOBS does not
    assert store.purgeable(0, 10**6, 10, own_ttl=False) == ([("plain", None)], 0)
    assert store.purgeable(0, 10**6, 10) == ([("late", None), ("soon", "k"), ("mid", None), ("plain", None)], 0)
    assert store.expired(600, 10) == [("soon", "k"), ("mid", None)]
    assert store.expired(10_000, 2) == [("soon", "k"), ("mid", None)]
    assert store.expired(10_000, 10) == [("soon", "k"), ("mid", None), ("late", None)]
    # A job that ends enters the index; purged ones leave it.
    job = make_job("running", 4, state=JobState.COMPLETED, updated_at=5000, result_ttl=0)
    store.write(Batch([], [update_row(job)], purges=["soon", "mid"]))
    assert store.expired(10_000, 10) == [("late", None), ("running", None)]


# ---- workflows -----------------------------------------------------------------------------


def flow_job(job_id: str, seq: int, flow: str, ref: str, *depends: str, **kw) -> Job:
    return make_job(job_id, seq, workflow_id=flow, ref=ref, depends_on=list(depends) or None, **kw)


def test_a_workflow_is_stored_with_its_jobs_and_read_back_in_order(backend, store):
    jobs = [flow_job("w-a", 1, "wf", "a", state=JobState.COMPLETED, result={"n": 1}),
            flow_job("w-b", 2, "wf", "b", "a", parents={"a": {"n": 1}}),
            flow_job("w-c", 3, "wf", "c", "a", "b", state=JobState.WAITING)]
    store.write(Batch([insert_row(j) for j in jobs], [], workflows=[("wf", '{"name": "etl"}')]))
    assert store.load_workflow("nope") is None
    body, read = store.load_workflow("wf")
    assert body == '{"name": "etl"}'
    assert [fields_of(j) for j in read] == [fields_of(j) for j in jobs]
    assert read[2].state is JobState.WAITING and read[2].snapshot()["waitingReason"] == "DEPENDENCIES"
    assert {j.job_id for j in store.load_active()} == {"w-b", "w-c"}
    jobs[2].parents = {"a": {"n": 1}, "b": {}}
    jobs[2].state = JobState.QUEUED
    store.write(Batch([], [update_row(jobs[2])]))
    store.close()
    reopened = backend.open()
    try:
        assert fields_of(reopened.load_workflow("wf")[1][2]) == fields_of(jobs[2])
    finally:
        reopened.close()


def test_a_workflow_is_purged_whole_once_every_job_of_it_is_old_enough(store):
    jobs = [flow_job("w-a", 1, "wf", "a", state=JobState.COMPLETED, updated_at=100, idempotency_key="ka"),
            finished("lone", 2, 100),
            flow_job("w-b", 3, "wf", "b", "a", state=JobState.WAITING)]
    store.write(Batch([insert_row(j) for j in jobs], [], workflows=[("wf", "{}")]))
    # a finished job of a workflow not finished is stepped over, like an active job
    assert store.purgeable(0, 500, 10) == ([("lone", None)], 0)
    jobs[2].state, jobs[2].updated_at = JobState.CANCELLED, 900
    store.write(Batch([], [update_row(jobs[2])]))
    assert store.purgeable(0, 500, 10) == ([("lone", None)], 0)  # its last job not old enough
    found, _ = store.purgeable(0, 1000, 10)
    assert found == [("w-a", "ka"), ("w-b", None), ("lone", None)]  # the workflow whole, where the walk met it
    store.write(Batch([], [], [], [job_id for job_id, _ in found]))
    assert store.load_workflow("wf") is None and store.get("w-b") is None and store.find_by_key("ka") is None
