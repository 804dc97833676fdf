"""A real PostgreSQL for the tests: one throwaway server per test session
(``bench/pgserver.py``, shared with the benchmarks), a fresh schema per store.

Without PostgreSQL's binaries (Debian's ``postgresql`` package, installed by ``.ci/run``)
or psycopg, the tests that need a server skip, and say why loudly: on stderr, and in
pytest's summary of skips.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys

import pytest

from bench.pgserver import PostgresServer, ServerFailed, missing_reason

# A test, or a module's ``pytestmark``, decorated with it runs once per store: its
# coordinators (tests/conftest.py ``coordinator_factory``) on an SQLite file, then on a
# fresh schema of the session's PostgreSQL server.
on_both_stores = pytest.mark.parametrize("db_kind", ["sqlite", "postgres"], indirect=True)

_server: PostgresServer | None = None
_failure: str | None = None


def unavailable() -> str | None:
    """Why the PostgreSQL tests cannot run here (None: they can)."""
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    return missing_reason()


def server() -> PostgresServer:
    """The session's server, started on first use; skips the calling test when none can run."""
    global _server, _failure
    if _server is None and _failure is None:
        reason = unavailable()
        if reason is None:
            try:
                _server = PostgresServer(durable=False).start()
                atexit.register(stop)  # however the session ends, even if no test used the fixture
            except ServerFailed as exc:
                reason = "the PostgreSQL server did not start: %s" % exc
        if reason is not None:
            _failure = "PostgreSQL tests SKIPPED: " + reason
            print("\n" + "!" * 30 + "\n" + _failure + "\n" + "!" * 30, file=sys.stderr, flush=True)
    if _server is None:
        pytest.skip(_failure or "no PostgreSQL server")
    return _server


def stop() -> None:
    """Stop the session's server (at exit, and at the session fixture's teardown)."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None
