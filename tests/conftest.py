"""Shared fixtures. The test process is never monkey-patched (docs/ARCHITECTURE.md)."""
import pytest

from tests.helpers import CoordinatorProc


@pytest.fixture(scope="module")
def module_coordinator(tmp_path_factory):
    """One coordinator (FAST_FLAGS, port 0, a temp database) shared by a module's tests."""
    proc = CoordinatorProc(tmp_path_factory.mktemp("coord"))
    proc.start()
    yield proc
    proc.cleanup()
