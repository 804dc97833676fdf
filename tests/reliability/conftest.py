"""The integration tier's fixtures (real coordinators, scripted peers, worker processes)."""

from tests.integration.conftest import coordinator, coordinator_factory, peers  # noqa: F401
from tests.helpers import worker_procs  # noqa: F401
