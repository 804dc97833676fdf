"""PostgresStore specifics: leadership (the advisory lock, the epoch fence), how errors
split (lost leadership, storage fault, bug), the writer session's timeouts and its
keepalive, the idempotency key filter, column types, and choosing the store by --db.

What every store does is in test_store_contract.py. Each test gets a fresh schema of the
session's throwaway server (tests/pg_support.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import gevent
import gevent.event
import pytest

from jobmesh.cli import COORDINATOR_OPTIONS
from jobmesh.protocol.jobs import JobState, Priority
from jobmesh.store.base import SCHEMA_VERSION, Batch, Done, LeadershipLost, StorageFault
from jobmesh.store.columns import insert_row
from jobmesh.store.job import Job
from jobmesh.store.opening import CannotOpen, open_store, shown
from tests.support.waiting import wait_until

psycopg = pytest.importorskip("psycopg")
REPO_ROOT = Path(__file__).resolve().parents[2]

from jobmesh.store import postgres as postgres_module  # noqa: E402
from jobmesh.store.postgres import (BUMP_SQL, FENCE_SQLSTATE, INSERT_SQL, UPDATE_SQL, KeyFilter,  # noqa: E402
                                    PostgresStore)
from tests.support.faulty_store import faulty_postgres_store  # noqa: E402


def make_job(job_id: str, seq: int, **kw) -> Job:
    fields = dict(job_id=job_id, seq=seq, task_type="SLEEP", payload={"durationMillis": 5}, max_attempts=3,
                  priority=Priority.NORMAL, created_at=1000 + seq)
    fields.update(kw)
    return Job(**fields)


def batch(*jobs: Job) -> Batch:
    return Batch([insert_row(j) for j in jobs], [])


@pytest.fixture
def url(postgres_url):
    return postgres_url


@pytest.fixture
def stores(url):
    """``stores()`` opens a PostgresStore on the test's schema; all are closed at teardown."""
    opened: list[PostgresStore] = []

    def make(**kw) -> PostgresStore:
        store = PostgresStore(url, **kw)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def leader(stores):
    store = stores()
    store.lead(lambda: pytest.fail("nobody else leads"))
    return store


@pytest.fixture
def admin(url):
    """Another session on the same schema: what a DBA, or another coordinator, does."""
    with psycopg.connect(url, autocommit=True) as conn:
        yield conn


def ids(store: PostgresStore) -> list[str]:
    return [job.job_id for _, job in store.list_page(100, None, None)]


# ---- the fence -------------------------------------------------------------------------------


def test_a_batch_after_another_leader_bumped_the_epoch_raises_and_commits_nothing(leader, admin):
    leader.write(batch(make_job("before", 1)))
    admin.execute(BUMP_SQL, (10_000,))  # what a new leader does once it holds the lock
    with pytest.raises(LeadershipLost) as caught:
        leader.write(batch(make_job("after", 2)))
    assert getattr(caught.value.__cause__, "sqlstate", None) == FENCE_SQLSTATE
    assert ids(leader) == ["before"]
    # From then on nothing is tried: the store says it lost leadership.
    failure = leader.commit(batch(make_job("later", 3))).get()
    assert isinstance(failure, LeadershipLost)
    assert isinstance(leader.commit_probe().get(), LeadershipLost)
    assert ids(leader) == ["before"]


def test_a_batch_after_the_epoch_row_was_deleted_raises_and_commits_nothing(leader, admin):
    admin.execute("DELETE FROM jobmesh_leader")
    failure = leader.commit(batch(make_job("a", 1))).get()
    assert isinstance(failure, LeadershipLost) and getattr(failure.__cause__, "sqlstate", None) == FENCE_SQLSTATE
    assert ids(leader) == []


def test_the_next_leader_gets_a_larger_epoch_even_after_the_row_was_deleted(stores, admin):
    first = stores()
    first.lead(lambda: None)
    epoch = first.epoch
    first.close()
    admin.execute("DELETE FROM jobmesh_leader")
    second = stores()
    second.lead(lambda: None)
    assert second.epoch is not None and epoch is not None and second.epoch > epoch
    second.write(batch(make_job("a", 1)))
    assert ids(second) == ["a"]


def test_a_store_that_does_not_lead_writes_nothing(stores):
    store = stores()
    with pytest.raises(LeadershipLost):
        store.write(batch(make_job("a", 1)))
    assert isinstance(store.commit(batch(make_job("a", 1))).get(), LeadershipLost)
    assert ids(store) == []


# ---- lead() ----------------------------------------------------------------------------------

STANDBY = textwrap.dedent("""
    from gevent import monkey
    monkey.patch_all()
    import sys, gevent
    from jobmesh.store.postgres import PostgresStore
    ticks = []
    ticker = gevent.spawn(lambda: [ticks.append(gevent.sleep(0.01)) for _ in iter(int, 1)])
    store = PostgresStore(sys.argv[1], session_timeout_millis=int(sys.argv[2]))
    calls = []
    store.lead(lambda: (calls.append(1), print("standing by", flush=True)))
    print("leading calls=%d ticks=%d" % (len(calls), len(ticks)), flush=True)
    sys.stdin.read()
    store.close()
""")


def test_a_second_store_stands_by_green_and_leads_once_the_first_closes(tmp_path, url, stores):
    # The first leads and stays healthy (this process runs its hub: gevent.sleep). Its
    # session timeout is longer than the standby's: the standby judges the holder by the
    # holder's own (its keepalive comes every 2 s, twice the standby's timeout).
    first = stores(session_timeout_millis=8000)
    first.lead(lambda: None)
    first.write(batch(make_job("a", 1)))
    out = tmp_path / "standby.out"
    with open(out, "w") as sink:
        standby = subprocess.Popen([sys.executable, "-c", STANDBY, url, "1000"], stdin=subprocess.PIPE,
                                   stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT, text=True)
    try:
        wait_until(lambda: "standing by" in out.read_text(), timeout=30, message="the second store stands by",
                   sleep=gevent.sleep)
        # It waits in pg_advisory_lock: its session is blocked on the lock.
        with psycopg.connect(url, autocommit=True) as conn:
            wait_until(lambda: conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                            " AND NOT granted").fetchone()[0] == 1, message="the lock wait",
                       sleep=gevent.sleep)
        # A healthy leader keeps the lock however long the standby waits.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            gevent.sleep(0.1)
        assert "leading" not in out.read_text()
        assert first.commit(batch(make_job("b", 2))).get() is None
        first.close()  # its session ends: the lock is free
        wait_until(lambda: "leading" in out.read_text(), timeout=30, message="the second store leads")
        line = out.read_text().split("leading ")[1].split()
        assert line[0] == "calls=1"  # standing_by called once
        assert int(line[1].split("=")[1]) > 0  # the hub ran while it waited
    finally:
        standby.communicate("", timeout=30)
    assert standby.returncode == 0, out.read_text()


# ---- how errors split --------------------------------------------------------------------------


def test_a_killed_writer_session_is_leadership_lost(leader, admin):
    leader.write(batch(make_job("a", 1)))
    pid = leader.conn.info.backend_pid
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    failure = leader.commit(batch(make_job("b", 2))).get()
    assert isinstance(failure, LeadershipLost) and failure.__cause__ is not None
    # The lock went with the session: another session takes it.
    second = PostgresStore(leader.url)
    try:
        second.lead(lambda: pytest.fail("the killed leader's lock is still held"))
        assert ids(second) == ["a"]
    finally:
        second.close()


def test_a_failed_statement_with_the_session_intact_is_a_storage_fault(tmp_path, url):
    fault = tmp_path / "fault"
    store = faulty_postgres_store()(url, fault_file=str(fault))
    try:
        store.lead(lambda: None)
        fault.write_text("readonly")
        failure = store.commit(batch(make_job("a", 1))).get()
        assert isinstance(failure, StorageFault) and failure.reason == "database is read-only"
        assert failure.__cause__ is not None and failure.__cause__.sqlstate == "25006"
        fault.write_text("")
        assert store.commit_probe().get() is None
        store.write(batch(make_job("a", 1)))
        assert ids(store) == ["a"]
    finally:
        store.close()


def test_a_misuse_of_the_driver_is_neither(leader):
    misuse = psycopg.ProgrammingError("the query has 1 placeholder but 2 parameters were passed")
    assert leader.typed(misuse) is misuse
    assert leader.typed(ValueError("x")).__class__ is ValueError
    refused = leader.typed(psycopg.errors.DiskFull("no space left on device"))
    assert isinstance(refused, StorageFault) and refused.reason == "disk full"


# ---- the writer session ------------------------------------------------------------------------


def test_the_writer_session_carries_the_timeouts(stores):
    store = stores(session_timeout_millis=4000)
    store.lead(lambda: None)
    settings = {name: store.conn.execute("SHOW %s" % name).fetchone()[0] for name in (
        "idle_session_timeout", "idle_in_transaction_session_timeout", "tcp_user_timeout", "tcp_keepalives_idle",
        "tcp_keepalives_count")}
    assert settings == {"idle_session_timeout": "4s", "idle_in_transaction_session_timeout": "4s",
                        "tcp_user_timeout": "4000", "tcp_keepalives_idle": "1", "tcp_keepalives_count": "3"}
    # The reader has none of them: an idle reader is no leader.
    assert store.reader.execute("SHOW idle_session_timeout").fetchone()[0] == "0"
    # Every connection's client side gives up on a vanished server in bounded time.
    for conn in (store.conn, store.reader, store._deferred.conn):
        options = conn.info.get_parameters()
        assert (options.get("keepalives"), options.get("tcp_user_timeout")) == ("1", "4000"), options


def test_a_healthy_leader_keeps_its_session_and_a_frozen_one_loses_it_to_a_standby(stores):
    store = stores(session_timeout_millis=1000)
    store.lead(lambda: None)
    # The hub runs (gevent.sleep): the commit greenlet keeps the session busy, well past
    # the idle timeout.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        gevent.sleep(0.1)
    assert store.commit(batch(make_job("a", 1))).get() is None
    # Frozen: from now on the hub does not run while the standby waits (its lead() holds
    # this thread), so the leader's greenlets never run again. The standby ends the idle
    # session and leads.
    standby = stores(session_timeout_millis=1000)
    calls: list[int] = []
    standby.lead(lambda: calls.append(1))
    assert calls == [1]
    failure = store.commit(batch(make_job("b", 2))).get()
    assert isinstance(failure, LeadershipLost)
    assert ids(standby) == ["a"]


@pytest.mark.parametrize("slow", ["decoding", "the core"])
def test_a_recovery_longer_than_the_session_timeout_keeps_the_leadership(stores, monkeypatch, slow):
    # Given a leader with a short session timeout and more active jobs than it takes in
    # within that timeout: each row's decoding, or each job the core's table adopts, holds
    # the hub (as recovery's CPU does: a million jobs in the core outlast 5 s)
    from jobmesh.config import CoreConfig
    from jobmesh.coordinator.core.face import CoordinatorCore
    from jobmesh.coordinator.core.table import JobTable

    monkeypatch.setattr(postgres_module, "RECOVERY_SLICE", 100)  # a slice of rows: a tenth of a second below
    count = 2000
    first = stores()
    first.lead(lambda: None)
    first.write(batch(*[make_job("j%05d" % i, i + 1) for i in range(count)]))
    first.close()
    store = stores(session_timeout_millis=1000)
    store.lead(lambda: None)  # a takeover: the new leader's session timeouts are armed

    def slowly(step):
        def slow_step(*args):
            time.sleep(2.0 / count)  # blocks the thread, hub included
            return step(*args)
        return slow_step

    if slow == "decoding":
        monkeypatch.setattr(postgres_module, "read_row", slowly(postgres_module.read_row))
        recover = lambda: len(list(store.load_active()))
    else:
        monkeypatch.setattr(JobTable, "adopt", slowly(JobTable.adopt))
        recover = lambda: CoordinatorCore(store, CoreConfig()).recover(0).queued
    # When it recovers (about twice the timeout)
    started = time.monotonic()
    assert recover() == count
    assert time.monotonic() - started > 1.0
    # Then its session lived through it: the next batch commits
    failure = store.commit(batch(make_job("after", count + 1))).get()
    assert failure is None, failure


def test_text_holding_nul_is_stored_with_a_replacement_and_found_by_the_same_key(leader):
    # JSON carries NUL (\u0000) into keys, worker ids and errors; PostgreSQL text cannot hold it.
    job = make_job("j\x00", 1, idempotency_key="k\x00ey", worker_id="w\x00", error="boom\x00",
                   state=JobState.RUNNING)
    leader.write(batch(job))
    stored = leader.find_by_key("k\x00ey")
    assert stored is not None and stored.error == "boom\ufffd" and stored.worker_id == "w\ufffd"
    assert leader.get("j\x00").job_id == "j\ufffd"
    list(leader.load_active())  # the key filter
    read = leader.read_later(key="k\x00ey")
    wait_until(read.ready, message="the read")
    assert read.result().job_id == "j\ufffd"
    assert [j.job_id for j in leader.load_active()] == ["j\ufffd"]


# ---- deferred reads ----------------------------------------------------------------------------


def test_deferred_reads_finish_on_the_hub_one_after_another_and_queued(leader):
    leader.write(batch(make_job("a", 1), make_job("b", 2)))
    for wanted in (["a"], ["b"], ["a", "missing", "b"]):  # the watcher must wake for every read
        reads = [leader.read_later(job_id=job_id) for job_id in wanted]
        woken = [gevent.event.Event() for _ in reads]
        for read, event in zip(reads, woken):
            read.then(event.set)
        assert all(event.wait(10) for event in woken)  # only the hub ran: ready() was never asked
        assert [None if r.result() is None else r.result().job_id for r in reads] == [
            None if job_id == "missing" else job_id for job_id in wanted]


def test_a_read_the_server_refuses_fails_alone_and_later_reads_work(leader, admin):
    # A failed statement (here: the table gone for a moment; in production a
    # statement_timeout, a cancel) fails that read only: the connection is intact.
    leader.write(batch(make_job("a", 1)))
    admin.execute("ALTER TABLE jobmesh_jobs RENAME TO jobmesh_jobs_away")
    refused = leader.read_later(job_id="a")
    wait_until(refused.ready, message="the refused read")
    with pytest.raises(StorageFault) as caught:
        refused.result()
    assert isinstance(caught.value.__cause__, psycopg.Error)
    admin.execute("ALTER TABLE jobmesh_jobs_away RENAME TO jobmesh_jobs")
    for _ in range(2):
        read = leader.read_later(job_id="a")
        wait_until(read.ready, message="a read after the refused one")
        assert read.result() is not None and read.result().job_id == "a"


def test_a_later_read_returns_before_it_runs_and_its_failure_is_typed(leader, admin):
    # Listings and the purge walks are read on a greenlet of their own: the caller (the
    # core) goes on, and is woken once the read is done
    leader.write(batch(make_job("a", 1)))
    read = leader.later(partial(leader.list_page, 10, None, None))
    woken: list[int] = []
    read.then(lambda: woken.append(1))
    assert not read.ready() and woken == []
    wait_until(read.ready, message="the page", sleep=gevent.sleep)
    assert [job.job_id for _, job in read.result()] == ["a"] and woken == [1]
    admin.execute("ALTER TABLE jobmesh_jobs RENAME TO jobmesh_jobs_away")
    try:
        refused = leader.later(partial(leader.purgeable, 0, 10**15, 10))
        wait_until(refused.ready, message="the refused walk", sleep=gevent.sleep)
        with pytest.raises(StorageFault):
            refused.result()
    finally:
        admin.execute("ALTER TABLE jobmesh_jobs_away RENAME TO jobmesh_jobs")


# ---- the idempotency key filter ----------------------------------------------------------------


def test_a_new_key_needs_no_read_once_recovery_built_the_filter(leader):
    leader.write(batch(make_job("a", 1, idempotency_key="stored")))
    assert not isinstance(leader.read_later(key="never"), Done)  # no filter before recovery: a read
    list(leader.load_active())  # the key filter
    assert isinstance(leader.read_later(key="never"), Done) and leader.read_later(key="never").result() is None
    for key, expected in (("stored", "a"), ("added", "b")):
        if key == "added":
            leader.write(batch(make_job("b", 2, idempotency_key="added")))
        read = leader.read_later(key=key)
        wait_until(read.ready, message="the read")
        assert read.result().job_id == expected


def test_the_filter_holds_every_key_added_and_few_others():
    keys = KeyFilter(10_000)
    added = ["key-%d" % i for i in range(10_000)]
    for key in added:
        keys.add(key)
    assert all(key in keys for key in added)
    others = sum("other-%d" % i in keys for i in range(10_000))
    assert others < 200  # about 0.1% at this fill, deterministic (MD5)
    assert len(keys.bits) == (1 << 23) // 8  # 1 MiB: its smallest size


# ---- schema and statements -----------------------------------------------------------------------


def test_milliseconds_are_bigint_and_batches_of_jobs_are_one_json_parameter(leader, admin):
    types = dict(admin.execute("SELECT column_name, data_type FROM information_schema.columns"
                               " WHERE table_schema = current_schema() AND table_name = 'jobmesh_jobs'").fetchall())
    assert types["created_at"] == types["updated_at"] == types["seq"] == types["deadline"] == "bigint"
    assert types["payload"] == types["job_id"] == "text"
    assert "jsonb_array_elements(" in INSERT_SQL and "jsonb_array_elements(" in UPDATE_SQL
    assert "VALUES" not in INSERT_SQL
    big = make_job("big", 2**40, created_at=2**62, deadline=2**62 + 5, state=JobState.RUNNING)
    leader.write(batch(big))
    assert leader.get("big").deadline == 2**62 + 5 and leader.max_seq() == 2**40


def test_opening_twice_creates_the_schema_once_and_migrates_nothing(stores, admin):
    first = stores()
    second = stores()
    assert first.migrated == [] and second.migrated == []
    assert first.migrations == list(range(1, SCHEMA_VERSION + 1)) and second.migrations == []
    assert [row[0] for row in admin.execute("SELECT version FROM jobmesh_migrations ORDER BY version")] == list(
        range(1, SCHEMA_VERSION + 1))


def test_a_schema_from_a_newer_jobmesh_is_not_opened(stores, admin, url):
    stores().close()
    admin.execute("INSERT INTO jobmesh_migrations (version, applied_at) VALUES (%s, 0)", (SCHEMA_VERSION + 1,))
    with pytest.raises(CannotOpen, match="newer than this jobmesh knows"):
        open_store(url)


def older_schema(stores, admin, last: int, *undo: str) -> None:
    """The schema holding job "old", taken back by the statements ``undo`` to what a
    coordinator whose last migration was ``last`` left."""
    first = stores()
    first.lead(lambda: None)
    first.write(batch(make_job("old", 1)))
    first.close()
    for statement in undo:
        admin.execute(statement)
    admin.execute("DELETE FROM jobmesh_migrations WHERE version > %s", (last,))


def test_a_schema_from_before_limits_gets_their_table_and_columns_on_opening(stores, admin):
    # Given a schema as a coordinator before limits left it (a job in it; its last migration was 10)
    older_schema(stores, admin, 10, "DROP TABLE jobmesh_limits",
                 "ALTER TABLE jobmesh_jobs DROP COLUMN concurrency_key, DROP COLUMN unique_key")
    # When a coordinator opens it
    store = stores()
    store.lead(lambda: None)
    # Then the migrations after 10 alone run: 11's columns and table are added (12's are there),
    # and the old row reads with no keys
    assert store.migrations == [11, 12] and store.migrated == ["concurrency_key", "unique_key"]
    assert store.load_limits() == []
    store.write(Batch([], [], limits=[("SLEEP", '{"maxRunning": 1}')]))
    assert store.load_limits() == [("SLEEP", '{"maxRunning": 1}')]
    old = store.get("old")
    assert old is not None and (old.concurrency_key, old.unique_key) == (None, None)


def test_a_schema_from_before_workflows_gains_their_table_and_columns_on_opening(stores, admin):
    # Given a schema as a coordinator before workflows left it (a job in it; its last migration was 11)
    older_schema(stores, admin, 11, "DROP TABLE jobmesh_workflows",
                 "ALTER TABLE jobmesh_jobs DROP COLUMN workflow_id, DROP COLUMN ref, DROP COLUMN depends_on,"
                 " DROP COLUMN parents")
    # When a coordinator opens it, migration 12 alone runs
    store = stores()
    store.lead(lambda: None)
    assert store.migrations == [12] and store.migrated == ["workflow_id", "ref", "depends_on", "parents"]
    old = store.get("old")
    assert old is not None and (old.workflow_id, old.ref, old.depends_on, old.parents) == (None, None, None, None)
    store.write(Batch([], [], workflows=[("wf", "{}")]))
    assert store.load_workflow("wf") == ("{}", [])


def test_a_table_from_before_time_to_live_gains_its_columns_index_and_defaults_table(stores, admin):
    # Given a schema as the coordinator made it before jobs asked for a time to live or a backoff
    # (and from before the migrations table: what it lacks is told by no column, each
    # migration creates only what is missing)
    first = stores()
    first.close()
    admin.execute("DROP INDEX jobmesh_jobs_expiry")
    admin.execute("DROP TABLE jobmesh_task_defaults, jobmesh_limits, jobmesh_migrations")
    for column in ("result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key"):
        admin.execute("ALTER TABLE jobmesh_jobs DROP COLUMN %s" % column)
    # When a store opens it, every migration runs; the columns come first and then the index over them
    store = stores()
    assert store.migrations == list(range(1, SCHEMA_VERSION + 1))
    assert store.migrated == ["result_ttl", "retry_base", "retry_cap", "concurrency_key", "unique_key"]
    store.lead(lambda: None)
    store.write(Batch([insert_row(make_job("done", 1, state=JobState.COMPLETED, updated_at=10, result_ttl=5))], [],
                      task_defaults=[("GREET", "{}")]))
    assert store.expired(15, 10) == [("done", None)] and store.load_task_defaults() == [("GREET", "{}")]
    # And the expired jobs are read through the index, not by a scan of the table
    admin.execute("SET enable_seqscan = off")
    plan = " ".join(row[0] for row in admin.execute(("EXPLAIN " + store.EXPIRED_SQL) % (15, 10)))
    assert "jobmesh_jobs_expiry" in plan, plan


# ---- choosing the store --------------------------------------------------------------------------


def test_a_postgres_url_opens_a_postgres_store_and_anything_else_sqlite(url, tmp_path):
    store = open_store(url.replace("postgresql://", "postgres://"))
    try:
        assert isinstance(store, PostgresStore) and store.shared
    finally:
        store.close()
    other = open_store(str(tmp_path / "jobs.db"))
    try:
        assert not other.shared
    finally:
        other.close()


def test_a_postgres_url_takes_no_file_lock_and_the_usage_text_says_it_is_accepted(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(url)
    try:
        store.lead(lambda: None)
    finally:
        store.close()
    assert not list(tmp_path.iterdir())  # no lock file anywhere near
    assert "PostgreSQL URL" in " ".join(COORDINATOR_OPTIONS.split())


def test_without_psycopg_a_postgres_url_is_a_one_line_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.delitem(sys.modules, "jobmesh.store.postgres")
    with pytest.raises(CannotOpen) as caught:
        open_store("postgresql://u:secret@127.0.0.1:1/db")
    message = str(caught.value)
    assert "jobmesh[postgres]" in message and "\n" not in message and "secret" not in message


def test_an_unreachable_server_is_a_one_line_error_without_the_password():
    with pytest.raises(CannotOpen) as caught:
        open_store("postgresql://u:secret@127.0.0.1:1/db?connect_timeout=5")
    assert "cannot open the database" in str(caught.value) and "secret" not in str(caught.value)
    assert shown("postgresql://u:pw@h/db?password=x&a=1") == "postgresql://u:***@h/db?password=***&a=1"


@pytest.mark.parametrize("url", ["postgresql://u:secret@[::1/db", "POSTGRESQL://u:secret@127.0.0.1:1/db",
                                 "postgresql:///db?host=[::1&password=secret"])


def test_a_url_libpq_cannot_parse_is_a_one_line_error_without_the_password(url):
    # libpq quotes the URL it could not parse in its message.
    with pytest.raises(CannotOpen) as caught:
        open_store(url)
    assert "cannot open the database" in str(caught.value) and "secret" not in str(caught.value)
    assert "\n" not in str(caught.value)


def test_tables_of_a_later_schema_in_the_search_path_are_not_taken_for_ours(postgres_server, leader, admin):
    # Given jobmesh tables in one schema (the leader's), a store whose search path puts
    # another schema first creates its own tables there and uses only those.
    leader.write(batch(make_job("theirs", 1)))
    theirs = admin.execute("SELECT current_schema()").fetchone()[0]
    ours = postgres_server.schema().split("%3D")[-1]
    store = PostgresStore(postgres_server.url("jobmesh_schemas", "%s,%s" % (ours, theirs)))
    try:
        store.lead(lambda: pytest.fail("a lock of another schema"))
        assert ids(store) == []
        store.write(batch(make_job("ours", 1)))
        assert ids(store) == ["ours"] and ids(leader) == ["theirs"]
    finally:
        store.close()
