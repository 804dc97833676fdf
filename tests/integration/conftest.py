"""The integration tier's own fixtures; the shared ones are in tests/conftest.py."""

import pytest

from jobmesh.client import CoordinatorClient
from tests.helpers import UpProc, wait_registered, wait_until
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


@pytest.fixture(scope="module")
def module_coordinators(tmp_path_factory):
    """``module_coordinators(**flags)``: coordinators shared by a module's tests that take
    their isolation from data (task types, keys and worker ids of their own, and job checks
    that compare before with after); all stopped after the module. On PostgreSQL when
    JOBMESH_TEST_STORE=postgres, as ``coordinator_factory``'s are."""
    import os

    from tests import pg_support
    from tests.helpers import CoordinatorProc

    started = []

    def make(**flags):
        if os.environ.get("JOBMESH_TEST_STORE") == "postgres" and "db" not in flags:
            flags["db"] = pg_support.server().schema()
            flags.setdefault("lease_grace_millis", 0)
        proc = CoordinatorProc(tmp_path_factory.mktemp("shared"), **flags)
        started.append(proc)
        return proc.start()

    yield make
    for proc in started:
        proc.cleanup()


@pytest.fixture(scope="module")
def shared_coordinator(module_coordinators):
    """One coordinator (FAST_FLAGS) shared by a module's tests (``module_coordinators``)."""
    return module_coordinators()
