"""Counting locks held by jobs: the bookkeeping behind Periodic's ACQUIRE / RELEASE.

Pure (no gevent, no clock, no jobs): the core asks and applies the answers. A lock is a
name with a maximum number of holders (the largest ever asked for that name, as
periodicd does), its holders, and a FIFO of refused jobs. A refused job waits (the core
keeps it QUEUED with waitingReason LOCK_WAIT, out of its dispatch queue); a release hands
the freed place to the first job of the FIFO, which the core then dispatches again; its
worker asks again and, already a holder, is granted at once. A refused job gives up the
locks it held (``release_held``): its run ended, and keeping them could leave two jobs
waiting for each other for good. A lock with no holder and no one waiting is forgotten.
"""

from __future__ import annotations

from collections import deque


class _Lock:
    __slots__ = ("max_holders", "holders", "fifo")

    def __init__(self, max_holders: int) -> None:
        self.max_holders = max_holders
        self.holders: set[str] = set()
        self.fifo: deque[str] = deque()


class LockTable:
    def __init__(self) -> None:
        self.locks: dict[str, _Lock] = {}
        self.held: dict[str, set[str]] = {}  # job id -> names of the locks it holds
        self.waiting: dict[str, str] = {}  # job id -> the lock it waits for (at most one)

    def __len__(self) -> int:
        return len(self.locks)

    def acquire(self, name: str, max_holders: int, job_id: str) -> tuple[bool, list[str]]:
        """(whether ``job_id`` holds ``name`` now, the waiting jobs a larger max let in
        first). A refused job joins the lock's FIFO."""
        lock = self.locks.get(name)
        promoted: list[str] = []
        if lock is None:
            lock = self.locks[name] = _Lock(max(1, max_holders))
        elif max_holders > lock.max_holders:
            lock.max_holders = max_holders
            promoted = self._fill(name, lock)
        if job_id in lock.holders:
            return True, promoted
        if self.waiting.get(job_id) == name:
            return False, promoted
        if len(lock.holders) < lock.max_holders:
            lock.holders.add(job_id)
            self.held.setdefault(job_id, set()).add(name)
            return True, promoted
        self._unwait(job_id)  # a job waits for one lock at a time: the one it asked for last
        lock.fifo.append(job_id)
        self.waiting[job_id] = name
        return False, promoted

    def max_holders(self, name: str) -> int:
        """The most holders the lock may have (the largest ever asked for it)."""
        return self.locks[name].max_holders

    def _fill(self, name: str, lock: _Lock) -> list[str]:
        """Free places go to the first jobs of the FIFO; the jobs promoted."""
        promoted: list[str] = []
        while lock.fifo and len(lock.holders) < lock.max_holders:
            first = lock.fifo.popleft()
            del self.waiting[first]
            lock.holders.add(first)
            self.held.setdefault(first, set()).add(name)
            promoted.append(first)
        return promoted

    def release(self, name: str, job_id: str) -> list[str]:
        """``job_id`` lets go of ``name`` (or stops waiting for it); the jobs promoted to holder."""
        lock = self.locks.get(name)
        if lock is None:
            return []
        promoted: list[str] = []
        if job_id in lock.holders:
            lock.holders.discard(job_id)
            mine = self.held.get(job_id)
            if mine is not None:
                mine.discard(name)
                if not mine:
                    del self.held[job_id]
            promoted = self._fill(name, lock)
        elif self.waiting.get(job_id) == name:
            self._unwait(job_id)  # forgets the lock too if that left it empty
            return promoted
        if not lock.holders and not lock.fifo:
            del self.locks[name]
        return promoted

    def release_held(self, job_id: str) -> list[str]:
        """The job stopped running: every lock it holds lets go of it; the jobs promoted."""
        promoted: list[str] = []
        for name in sorted(self.held.get(job_id, ())):
            promoted += self.release(name, job_id)
        return promoted

    def release_all(self, job_id: str) -> list[str]:
        """The job ended: it holds and waits for nothing any more; the jobs promoted."""
        if job_id in self.waiting:
            self._unwait(job_id)
        return self.release_held(job_id)

    def _unwait(self, job_id: str) -> None:
        name = self.waiting.pop(job_id, None)
        if name is not None:
            lock = self.locks[name]
            lock.fifo.remove(job_id)  # O(waiting jobs of that lock)
            if not lock.holders and not lock.fifo:
                del self.locks[name]
