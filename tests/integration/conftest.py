"""The integration tier's own fixtures; the shared ones are in tests/conftest.py."""

import pytest

from jobmesh.client import CoordinatorClient
from tests.support.cli import UpProc
from tests.support.peers import wait_registered
from tests.support.waiting import wait_until
from tests.integration.periodic_support import PeerSet


@pytest.fixture
def live(coordinator, worker_procs):
    """A coordinator with one real worker attached; yields the coordinator."""
    worker_procs.start(coordinator, "w-cli", capacity=2)
    with CoordinatorClient(*coordinator.client_addr) as client:
        wait_registered(client, ["w-cli"])
    return coordinator


@pytest.fixture
def start_up(tmp_path):
    """``start_up(*flags, new_session=False)``: ``jobmesh up`` as a subprocess, killed at teardown."""
    started = []

    def make(*extra, new_session=False):
        up = UpProc(tmp_path, *extra, new_session=new_session)
        started.append(up)
        m = wait_until(up.listening, timeout=15, message="up's listening line")
        up.client_addr = (m["c"], int(m["cp"]))
        return up

    yield make
    for up in started:
        up.cleanup()


@pytest.fixture
def coord(coordinator_factory):
    """A coordinator with its Periodic port open."""
    return coordinator_factory(periodic_port=0)


@pytest.fixture
def periodic_peers():
    """aio-periodic workers and clients in subprocesses (``PeerSet``), all ended at teardown."""
    made = PeerSet()
    yield made
    made.close()


class ModuleCoordinators:
    """Coordinators a module's tests share (see ``module_coordinators``)."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.started = []
        self.by_store = {}

    @staticmethod
    def store(store=None) -> str:
        """``store``, or by default the one JOBMESH_TEST_STORE names, as for ``coordinator_factory``."""
        import os

        return store or os.environ.get("JOBMESH_TEST_STORE", "sqlite")

    def __call__(self, store=None, **flags):
        """A new coordinator with ``flags`` on ``store`` ("sqlite" or "postgres")."""
        from tests import pg_support
        from tests.support.processes import CoordinatorProc

        if self.store(store) == "postgres" and "db" not in flags:
            flags["db"] = pg_support.server().schema()
            flags.setdefault("lease_grace_millis", 0)
        proc = CoordinatorProc(self.tmp_path_factory.mktemp("shared"), **flags)
        self.started.append(proc)
        return proc.start()

    def shared(self, store=None):
        """The one coordinator with FAST_FLAGS the module's tests share on ``store``."""
        store = self.store(store)
        if store not in self.by_store:
            self.by_store[store] = self(store)
        return self.by_store[store]

    def cleanup(self):
        for proc in self.started:
            proc.cleanup()


@pytest.fixture(scope="module")
def module_coordinators(tmp_path_factory):
    """``module_coordinators(**flags)``: coordinators shared by a module's tests that take
    their isolation from data: the jobs of a test are of a task type its own workers
    declare (so no other test's worker takes them, and its workers take no other test's),
    or carry keys of its own, and job checks compare before with after. All are stopped
    after the module."""
    made = ModuleCoordinators(tmp_path_factory)
    yield made
    made.cleanup()


@pytest.fixture(scope="module")
def shared_coordinator(module_coordinators):
    """The coordinator (FAST_FLAGS) a module's tests share (``module_coordinators``)."""
    return module_coordinators.shared()


@pytest.fixture
def shared_on_store(module_coordinators, db_kind):
    """The coordinator a module's tests share on the test's store (``db_kind``), so that a
    test parametrized with ``pg_support.on_both_stores`` shares one on each store."""
    return module_coordinators.shared(db_kind)
