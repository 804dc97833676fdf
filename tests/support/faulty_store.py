"""Storage faults on demand, for tests: the two stores with a fault file, and a
coordinator process that opens them (production code has no such hook).

A fault file is read before each write transaction (commits, probes, migrations):

* ``full``: the database cannot grow, as on a full disk (SQLite: ``PRAGMA
  max_page_count`` set to 1, which SQLite raises to the current size);
* ``readonly``: the writer refuses writes (SQLite: ``PRAGMA query_only``; PostgreSQL:
  read-only transactions);
* anything else, or no file: healthy.

The faults reach the writer's own connection on the thread that writes, so the store
meets real driver errors and classifies them as it would on a real full disk or
read-only database. ``FaultySQLiteStore`` and ``FaultyPostgresStore`` are the real
stores with that one step added before each transaction; unit tests make them with
a ``fault_file``. A coordinator process runs ``tests/support/faulty_coordinator.py`` (``ENTRY``)
instead of ``python -m jobmesh``, which opens them with the fault file named by
``FAULT_FILE_ENV`` (tests/integration/test_storage_faults.py starts such processes).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from jobmesh.store import sqlite
from jobmesh.store.sqlite import SQLiteStore

FAULT_FILE_ENV = "JOBMESH_TEST_STORAGE_FAULT_FILE"
ENTRY = str(Path(__file__).resolve().parent / "faulty_coordinator.py")


def read_fault(path: str | None) -> str:
    if path is None:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


class FaultySQLiteStore(SQLiteStore):
    """``SQLiteStore`` whose writes fail as ``fault_file`` says (default: the file
    ``FAULT_FILE_ENV`` names)."""

    def __init__(self, path: str, synchronous: str = "FULL", fault_file: str | None = None) -> None:
        self.fault_file = fault_file if fault_file is not None else os.environ.get(FAULT_FILE_ENV)
        self._max_pages: int | None = None
        super().__init__(path, synchronous)

    @contextmanager
    def _transaction(self, begin: str) -> Iterator[None]:
        with sqlite.faults():
            fault = read_fault(self.fault_file)
            if self._max_pages is None:
                self._max_pages = int(self.conn.execute("PRAGMA max_page_count").fetchone()[0])
            self.conn.execute("PRAGMA max_page_count=%d" % (1 if fault == "full" else self._max_pages))
            self.conn.execute("PRAGMA query_only=%d" % (fault == "readonly"))
        with super()._transaction(begin):
            yield


def faulty_postgres_store() -> Any:
    """``FaultyPostgresStore``: ``PostgresStore`` whose write transactions are read-only
    while the fault file says ``readonly`` (psycopg is imported only when asked, after a
    coordinator process's monkey-patching)."""
    from jobmesh.store.postgres import DEFAULT_SESSION_TIMEOUT_MILLIS, PostgresStore

    class FaultyPostgresStore(PostgresStore):
        def __init__(self, url: str, session_timeout_millis: int = DEFAULT_SESSION_TIMEOUT_MILLIS,
                     fault_file: str | None = None) -> None:
            self.fault_file = fault_file if fault_file is not None else os.environ.get(FAULT_FILE_ENV)
            self._fault = ""
            super().__init__(url, session_timeout_millis)

        def _transaction(self, statements: list[tuple[str, Any]]) -> None:
            fault = read_fault(self.fault_file)
            if fault != self._fault:
                self.conn.execute("SET default_transaction_read_only = %s" % ("on" if fault == "readonly" else "off"))
                self._fault = fault
            super()._transaction(statements)

    return FaultyPostgresStore


def install() -> None:
    """Make ``open_store`` open the faulty stores (in a coordinator process, after its
    monkey-patching)."""
    from jobmesh.store import opening, postgres

    opening.SQLiteStore = FaultySQLiteStore  # type: ignore[misc]
    postgres.PostgresStore = faulty_postgres_store()  # type: ignore[misc]
