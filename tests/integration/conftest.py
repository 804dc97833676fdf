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
