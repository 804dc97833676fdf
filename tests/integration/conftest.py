import pytest

from tests.helpers import CoordinatorProc, Peers
from tests.helpers import worker_procs  # noqa: F401  (a fixture: real worker processes)


@pytest.fixture
def coordinator_factory(tmp_path):
    """Start coordinators with ``coordinator_factory(**flags)``; all are stopped at teardown."""
    started = []

    def make(**flags):
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
