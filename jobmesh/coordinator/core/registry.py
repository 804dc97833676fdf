"""Worker sessions: identity, advertised capacity and task types, last heartbeat.

Owned by the core (plain dicts, safe by confinement to the core greenlet). ``conn`` is
the session's connection (``connection.OutboundConnection``); the core only uses it as a
key and as the address of outbound frames. Which jobs a session runs is the job table's
(``JobTable.running``): it gives and ends every lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # a protocol only: the registry stays free of gevent
    from jobmesh.coordinator.core.peers import OutboundConnection


class Session:
    __slots__ = ("worker_id", "capacity", "conn", "last_heartbeat", "connected_at", "task_types",
                 "stale_since", "stale_count", "acks")

    def __init__(self, worker_id: str, capacity: int, conn: OutboundConnection, now_millis: int,
                 task_types: frozenset[str] = frozenset(), result_acks: bool = False) -> None:
        self.worker_id = worker_id
        self.capacity = capacity
        self.conn = conn
        self.task_types = task_types  # what this worker declared it runs
        self.last_heartbeat = now_millis
        self.connected_at = now_millis
        self.stale_since = now_millis  # the window in which stale results are counted
        self.stale_count = 0
        # The attempt ids of this batch's results to acknowledge (RESULT_ACK), for a
        # worker that asked; None for one that did not.
        self.acks: list[str] | None = [] if result_acks else None

    def snapshot(self, running: int, drift: int = 0) -> dict[str, Any]:
        """The worker item, running ``running`` jobs; ``drift`` turns the core-time stamps
        into wall-clock instants."""
        return {
            "workerId": self.worker_id,
            "capacity": self.capacity,
            "activeJobs": running,
            "lastHeartbeatMillis": self.last_heartbeat + drift,
            "connectedAtMillis": self.connected_at + drift,
            "taskTypes": sorted(self.task_types),
            "protocol": "json",
        }


class WorkerRegistry:
    """Live sessions by worker id and by connection."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_conn: dict[OutboundConnection, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def get(self, worker_id: str) -> Session | None:
        return self._by_id.get(worker_id)

    def by_conn(self, conn: OutboundConnection) -> Session | None:
        return self._by_conn.get(conn)

    def add(self, session: Session) -> None:
        self._by_id[session.worker_id] = session
        self._by_conn[session.conn] = session

    def remove(self, session: Session) -> None:
        if self._by_id.get(session.worker_id) is session:
            del self._by_id[session.worker_id]
        if self._by_conn.get(session.conn) is session:
            del self._by_conn[session.conn]


class PeriodicSession(Session):
    """A Periodic worker connection (docs/PERIODIC.md). It lives exactly as long as its
    connection (no heartbeats). Its slots are its grab tokens: the msgids of its GRAB_JOB
    requests, each usable for one JOB_ASSIGN. Its funcs (CAN_DO / BROADCAST) are a
    namespace of their own: ``task_types`` mirrors them only for WORKER_LIST, which shows
    them as ``taskTypes`` with ``protocol: "periodic"``; no JSON job ever goes to it."""

    __slots__ = ("tokens", "funcs", "new_funcs", "assigned")

    def __init__(self, worker_id: str, conn: OutboundConnection, now_millis: int) -> None:
        super().__init__(worker_id, 0, conn, now_millis)
        self.tokens: list[int] = []  # held grab tokens, oldest first (the newest is used first)
        self.funcs: set[str] = set()  # what it declared with CAN_DO / BROADCAST
        self.new_funcs = 0  # funcs its declarations brought into the listing, over its life
        self.assigned: dict[int, str] = {}  # token -> the job last assigned on it (JOB_UNASSIGNED)

    def snapshot(self, running: int, drift: int = 0) -> dict[str, Any]:
        """Its capacity is what it can take now and what it runs (tokens + running);
        ``lastHeartbeatMillis`` is its last worker request (Periodic has no heartbeat)."""
        item = super().snapshot(running, drift)
        item["capacity"] = len(self.tokens) + running
        item["protocol"] = "periodic"
        return item
