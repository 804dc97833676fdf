"""Shared fixtures: real coordinators, scripted peers and worker processes. The test
process is never monkey-patched (docs/ARCHITECTURE.md)."""
import os

import pytest

from tests import pg_support
from tests.support.inprocess import InProcessCoordinator
from tests.support.peers import Peers
from tests.support.processes import CoordinatorProc, WorkerProcs


@pytest.fixture(scope="session")
def postgres_server():
    """A throwaway PostgreSQL server for the whole session (tests/pg_support.py); the
    tests that use it skip loudly when none can be started."""
    yield pg_support.server()
    pg_support.stop()


@pytest.fixture
def postgres_url(postgres_server):
    """The URL of a fresh, empty schema on the session's PostgreSQL server."""
    return postgres_server.schema()


@pytest.fixture(scope="module")
def module_coordinator(tmp_path_factory):
    """One coordinator (FAST_FLAGS, port 0, a temp database) shared by a module's tests."""
    proc = CoordinatorProc(tmp_path_factory.mktemp("coord"))
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture(scope="module")
def inprocess_coordinator(tmp_path_factory):
    """One coordinator in the test process (FAST_FLAGS, port 0, a temp SQLite file) shared
    by a module's tests (tests/support/inprocess.py)."""
    host = InProcessCoordinator(tmp_path_factory.mktemp("inproc")).start()
    yield host
    host.stop()


@pytest.fixture
def inprocess_factory(tmp_path):
    """Start coordinators in the test process with ``inprocess_factory(**flags)``
    (``InProcessCoordinator``: no process start); all are stopped at teardown."""
    started = []

    def make(**flags):
        host = InProcessCoordinator(tmp_path, name="inproc%d" % len(started), **flags)
        started.append(host)
        return host.start()

    yield make
    for host in reversed(started):
        host.stop()


@pytest.fixture
def db_kind(request):
    """The store the test's coordinators use: "sqlite" unless the test is parametrized
    with ``pg_support.on_both_stores``, or JOBMESH_TEST_STORE=postgres runs every
    coordinator_factory test on PostgreSQL."""
    return getattr(request, "param", os.environ.get("JOBMESH_TEST_STORE", "sqlite"))


@pytest.fixture
def coordinator_factory(tmp_path, db_kind):
    """Start coordinators with ``coordinator_factory(**flags)``; all are stopped at teardown.
    Each gets its own database: a file, or a fresh PostgreSQL schema (``db_kind``)."""
    started = []

    def make(**flags):
        if db_kind == "postgres" and "db" not in flags:
            flags["db"] = pg_support.server().schema()
            # The lease grace SQLite starts with (PostgreSQL's default, the heartbeat timeout,
            # is for takeovers: tests/integration/test_standby.py), so that a restart's
            # recovery decides the same on both stores.
            flags.setdefault("lease_grace_millis", 0)
        proc = CoordinatorProc(tmp_path, name="coord%d" % len(started), **flags)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.cleanup()


@pytest.fixture
def coordinator(coordinator_factory):
    """A running coordinator with FAST_FLAGS on port 0 and a temp database."""
    return coordinator_factory()


@pytest.fixture
def peers():
    """Stdlib clients, scripted workers and raw connections, all closed at teardown."""
    p = Peers()
    yield p
    p.close_all()


@pytest.fixture
def worker_procs(tmp_path):
    """``worker_procs.start(coord, worker_id, capacity=...)``: real workers, stopped at teardown."""
    procs = WorkerProcs(tmp_path)
    yield procs
    procs.cleanup()
