"""One coordinator per database: an exclusive ``flock`` on ``<db>.lock``.

The coordinator takes the lock before it opens the database, so a second coordinator
on the same file stops before recovery could touch anything (recovery rewrites RUNNING
jobs, which would be the live coordinator's running work). The kernel drops the lock
when the process ends, however it ends, so a restart right after ``kill -9`` finds it
free: nothing here ever decides anything from the file's content. The file holds the
holder's pid as text, only so that the refusal can name it. The file is left in place
when the lock is released: deleting it could let two processes lock two different files.

An in-memory database (``:memory:``) belongs to one process anyway and takes no lock, and
a PostgreSQL store (``--db=postgresql://...``) is shared on purpose: its leadership lock
is the store's own (``Store.lead``).
"""

from __future__ import annotations

import errno
import fcntl
import os

from jobmesh.store.opening import is_postgres_url

LOCK_SUFFIX = ".lock"


class DatabaseInUse(Exception):
    """Another live process holds the database's lock; ``pid`` is its pid if it could be read."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        holder = "pid %d" % pid if pid is not None else "another process"
        super().__init__("database in use by %s (lock file %s)" % (holder, path))


def lock_path(db_path: str) -> str | None:
    """The lock file beside the database file ``db_path`` names, with symlinks and relative
    parts resolved (two names of one file must take one lock); None for an in-memory
    database or a PostgreSQL URL."""
    if db_path == ":memory:" or db_path.startswith("file::memory:") or is_postgres_url(db_path):
        return None
    if not db_path.startswith("file:"):
        db_path = os.path.realpath(db_path)
    return db_path + LOCK_SUFFIX


class DatabaseLock:
    """An exclusive, non-blocking lock on a database path, held until ``release`` or death.

    ``acquire`` raises ``DatabaseInUse`` if another process holds it, or ``OSError`` if
    the lock file cannot be created (e.g. its directory does not exist).
    """

    def __init__(self, db_path: str) -> None:
        self.path = lock_path(db_path)
        self._fd: int | None = None

    def acquire(self) -> None:
        if self.path is None or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            try:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise DatabaseInUse(self.path, _read_pid(fd)) from None
                raise
            finally:
                os.close(fd)
        # Ours now: say who holds it (a reader racing this write may see it empty).
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)  # no stale pid for anyone to misread
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the lock

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except (OSError, ValueError):
        return None
