"""The worker agent in-process against a scripted coordinator (a gevent server on 127.0.0.1).

The agent uses gevent's socket explicitly, so it runs here without monkey-patching the
test process: the scripted coordinator and the agent share this process's hub. These
cover what a real coordinator never does on purpose: over-assigning, cancelling a
superseded attempt, an invalid payload on the wire, refusing a registration.
"""

from __future__ import annotations

import time

import gevent
import pytest
from gevent.queue import Empty, Queue
from gevent.server import StreamServer

from jobmesh.addresses import Address, parse_address
from jobmesh.config import WorkerConfig
from jobmesh.protocol.framing import FrameReader, encode_frame
from jobmesh.worker.agent import WorkerAgent
from tests.support.processes import closed_address
from tests.support.waiting import wait_until


class ScriptedCoordinator:
    """Accepts worker connections; ``next_conn()`` hands each over as a ``Conn``."""

    def __init__(self):
        self.conns: Queue = Queue()
        self.server = StreamServer(("127.0.0.1", 0), self._handle)
        self.server.start()

    def _handle(self, sock, _addr):
        conn = Conn(sock)
        self.conns.put(conn)
        conn.read_all()

    def next_conn(self, timeout=5.0) -> "Conn":
        return self.conns.get(timeout=timeout)

    def stop(self):
        self.server.stop(timeout=1)


class Conn:
    def __init__(self, sock):
        self.sock = sock
        self.frames: Queue = Queue()
        self.closed = gevent.event.Event()

    def read_all(self):
        reader = FrameReader(self.sock.recv)
        try:
            while True:
                frame = reader.read_frame()
                if frame is None:
                    break
                self.frames.put(frame)
        except OSError:
            pass
        finally:
            self.closed.set()

    def send(self, obj):
        self.sock.sendall(encode_frame(obj))

    def next(self, type_, timeout=2.0) -> dict:
        """The next frame of this type, skipping heartbeats."""
        while True:
            frame = self.frames.get(timeout=timeout)
            if frame["type"] == type_:
                return frame
            assert frame["type"] == "HEARTBEAT", frame

    def no_result(self, duration) -> None:
        """Assert nothing but heartbeats arrives for ``duration`` seconds."""
        deadline = time.monotonic() + duration
        while (left := deadline - time.monotonic()) > 0:
            try:
                frame = self.frames.get(timeout=left)
            except Empty:
                return
            assert frame["type"] == "HEARTBEAT", "unexpected %r" % (frame,)

    def accept_registration(self) -> dict:
        register = self.next("WORKER_REGISTER")
        self.send({"type": "WORKER_REGISTERED", "workerId": register["workerId"]})
        return register

    def close(self):
        self.sock.close()


@pytest.fixture
def coordinator():
    c = ScriptedCoordinator()
    yield c
    c.stop()


@pytest.fixture
def start_agent(coordinator):
    running = []

    def start(capacity=1, heartbeat_millis=50, keep_running_millis=30_000):
        cfg = WorkerConfig((Address("127.0.0.1", coordinator.server.server_port),), "w-t", capacity,
                           heartbeat_millis, keep_running_millis=keep_running_millis)
        agent = WorkerAgent(cfg)
        running.append(gevent.spawn(agent.run))
        return agent

    yield start
    gevent.killall(running, timeout=5)


def assign(conn, job, attempt, task_type, payload, number=1):
    conn.send({"type": "TASK_ASSIGN", "jobId": job, "attemptId": attempt, "attemptNumber": number,
               "taskType": task_type, "payload": payload})


def test_registers_then_heartbeats_on_its_own(coordinator, start_agent):
    start_agent(capacity=3, heartbeat_millis=30)
    conn = coordinator.next_conn()
    assert conn.accept_registration() == {"type": "WORKER_REGISTER", "workerId": "w-t", "capacity": 3,
                                         "taskTypes": None}
    beats = [conn.frames.get(timeout=1) for _ in range(3)]
    assert beats == [{"type": "HEARTBEAT", "workerId": "w-t"}] * 3


def test_result_echoes_the_lease(coordinator, start_agent):
    start_agent()
    conn = coordinator.next_conn()
    conn.accept_registration()
    assign(conn, "j1", "a1", "FAIL", {"failUntilAttempt": 3}, number=2)
    assert conn.next("TASK_RESULT") == {"type": "TASK_RESULT", "workerId": "w-t", "jobId": "j1", "attemptId": "a1",
                                        "success": False, "result": None,
                                        "error": "attempt 2 failed on purpose (failUntilAttempt=3)"}
    assign(conn, "j2", "a2", "WORD_COUNT", {"text": "two words"})
    assert conn.next("TASK_RESULT") == {"type": "TASK_RESULT", "workerId": "w-t", "jobId": "j2", "attemptId": "a2",
                                        "success": True, "result": {"words": 2}, "error": None}


def test_invalid_payload_on_the_wire_fails_the_attempt(coordinator, start_agent):
    start_agent()
    conn = coordinator.next_conn()
    conn.accept_registration()
    assign(conn, "j1", "a1", "PRIME_COUNT", {"limit": 10**12})
    result = conn.next("TASK_RESULT")
    assert result["success"] is False and result["error"].startswith("invalid payload: ")
    assign(conn, "j2", "a2", "RUN_SHELL", {"cmd": "true"})
    assert "unknown task type" in conn.next("TASK_RESULT")["error"]


def test_over_assignment_is_refused_at_once_and_cancel_matches_both_ids(coordinator, start_agent):
    agent = start_agent(capacity=1)
    conn = coordinator.next_conn()
    conn.accept_registration()
    # Given the only slot busy
    assign(conn, "j1", "a1", "SLEEP", {"durationMillis": 60_000})
    # When the coordinator over-assigns, the reply is immediate
    assign(conn, "j2", "a2", "SHA256", {"text": "x"})
    refused = conn.next("TASK_RESULT", timeout=1)
    assert (refused["jobId"], refused["success"]) == ("j2", False)
    assert "worker at capacity" in refused["error"]
    # A cancel for another attempt of the same job touches nothing
    conn.send({"type": "TASK_CANCEL", "jobId": "j1", "attemptId": "a0"})
    conn.no_result(0.1)
    assert ("j1", "a1") in agent.in_flight
    # The matching cancel stops it silently and frees the slot for the very next assignment
    conn.send({"type": "TASK_CANCEL", "jobId": "j1", "attemptId": "a1"})
    assign(conn, "j3", "a3", "SHA256", {"text": ""})
    result = conn.next("TASK_RESULT", timeout=1)
    assert (result["jobId"], result["success"]) == ("j3", True)
    conn.no_result(0.1)
    assert len(agent.in_flight) == 0


def test_refused_registration_is_retried(coordinator, start_agent):
    start_agent()
    first = coordinator.next_conn()
    first.next("WORKER_REGISTER")
    first.send({"type": "ERROR", "message": "worker w-t is already registered"})
    first.close()
    second = coordinator.next_conn(timeout=3)
    assert second.accept_registration()["workerId"] == "w-t"


def lose_connection_while_running(coordinator, agent, *attempts) -> Conn:
    """Register, start SLEEP ``attempts`` ((job, attempt, millis) each), then close the
    connection; returns the next one (not answered yet)."""
    first = coordinator.next_conn()
    first.accept_registration()
    for job, attempt, millis in attempts:
        assign(first, job, attempt, "SLEEP", {"durationMillis": millis})
    wait_until(lambda: len(agent.in_flight) == len(attempts), timeout=5, message="the attempts in flight",
               sleep=gevent.sleep)
    first.close()
    return coordinator.next_conn(timeout=3)


def held_result(coordinator, start_agent) -> tuple[WorkerAgent, Conn]:
    """An agent whose attempt finished while it waits for its second registration's answer."""
    agent = start_agent(capacity=1)
    second = lose_connection_while_running(coordinator, agent, ("j1", "a1", 300))
    assert second.next("WORKER_REGISTER")["running"] == [{"jobId": "j1", "attemptId": "a1"}]
    wait_until(lambda: ("j1", "a1") in agent.results, timeout=5, message="the result held", sleep=gevent.sleep)
    return agent, second


def test_connection_loss_abandons_attempts_at_once_without_keep_running(coordinator, start_agent):
    agent = start_agent(capacity=2, keep_running_millis=0)
    # When the coordinator goes away
    second = lose_connection_while_running(coordinator, agent, ("j1", "a1", 60_000))
    # Then the agent registers again naming nothing, the old attempt is gone and reports nothing
    assert "running" not in second.accept_registration()
    assert len(agent.in_flight) == 0
    second.no_result(0.2)
    assert agent.registrations == 2


def test_running_attempts_are_kept_across_a_lost_connection_and_named_again(coordinator, start_agent):
    agent = start_agent(capacity=2)
    # When the coordinator goes away, the attempts run on and the agent names them registering again
    second = lose_connection_while_running(coordinator, agent, ("j1", "a1", 60_000), ("j2", "a2", 60_000))
    register = second.accept_registration()
    assert register["running"] == [{"jobId": "j1", "attemptId": "a1"}, {"jobId": "j2", "attemptId": "a2"}]
    assert ("j1", "a1") in agent.in_flight and ("j2", "a2") in agent.in_flight
    # A lease the coordinator did not keep is cancelled: that attempt stops, the other runs on
    second.send({"type": "TASK_CANCEL", "jobId": "j2", "attemptId": "a2"})
    wait_until(lambda: len(agent.in_flight) == 1, timeout=5, message="the cancelled attempt gone", sleep=gevent.sleep)
    assert ("j1", "a1") in agent.in_flight
    second.no_result(0.1)


def test_a_result_finished_while_disconnected_is_sent_after_registering_again(coordinator, start_agent):
    agent, second = held_result(coordinator, start_agent)
    # When the registration is answered, the held result follows it
    second.send({"type": "WORKER_REGISTERED", "workerId": "w-t"})
    result = second.next("TASK_RESULT")
    assert (result["jobId"], result["attemptId"], result["success"]) == ("j1", "a1", True)
    assert agent.results == {}


def test_a_held_result_the_coordinator_did_not_keep_is_dropped(coordinator, start_agent):
    agent, second = held_result(coordinator, start_agent)
    # The answer and the cancel arrive together, before the writer ran: the result is not sent
    second.sock.sendall(encode_frame({"type": "WORKER_REGISTERED", "workerId": "w-t"})
                        + encode_frame({"type": "TASK_CANCEL", "jobId": "j1", "attemptId": "a1"}))
    wait_until(lambda: agent.registrations == 2, timeout=5, message="registered", sleep=gevent.sleep)
    second.no_result(0.2)
    assert agent.results == {}


def test_a_sent_result_is_held_until_acknowledged_and_named_at_the_next_registration(coordinator):
    # Given a worker with a second address (where nothing listens), and a coordinator that
    # agreed to acknowledge results
    cfg = WorkerConfig((Address("127.0.0.1", coordinator.server.server_port),
                        parse_address(closed_address())), "w-t", 2, 50)
    agent = WorkerAgent(cfg)
    runner = gevent.spawn(agent.run)
    try:
        first = coordinator.next_conn()
        assert first.next("WORKER_REGISTER")["resultAcks"] is True
        first.send({"type": "WORKER_REGISTERED", "workerId": "w-t", "resultAcks": True})
        assign(first, "j1", "a1", "WORD_COUNT", {"text": "one"})
        assign(first, "j2", "a2", "WORD_COUNT", {"text": "two"})
        assert {first.next("TASK_RESULT")["attemptId"], first.next("TASK_RESULT")["attemptId"]} == {"a1", "a2"}
        # When only a1's result is acknowledged (a2's went into a coordinator that then went away)
        first.send({"type": "RESULT_ACK", "attemptIds": ["a1", 7]})
        wait_until(lambda: list(agent.unacked) == ["a2"], timeout=5, message="a1 forgotten", sleep=gevent.sleep)
        first.close()
        # Then the next registration names a2, and the result follows it again
        second = coordinator.next_conn()
        assert second.next("WORKER_REGISTER")["running"] == [{"jobId": "j2", "attemptId": "a2"}]
        second.send({"type": "WORKER_REGISTERED", "workerId": "w-t", "resultAcks": True})
        result = second.next("TASK_RESULT")
        assert (result["jobId"], result["attemptId"], result["result"]) == ("j2", "a2", {"words": 1})
        # and it is dropped once acknowledged there
        second.send({"type": "RESULT_ACK", "attemptIds": ["a2"]})
        wait_until(lambda: agent.kept() == [], timeout=5, message="nothing held", sleep=gevent.sleep)
    finally:
        gevent.killall([runner], timeout=5)


def test_a_coordinator_that_does_not_acknowledge_leaves_nothing_held(coordinator, start_agent):
    agent = start_agent()
    conn = coordinator.next_conn()
    assert "resultAcks" not in conn.accept_registration()  # one address: not asked, and not agreed
    assign(conn, "j1", "a1", "WORD_COUNT", {"text": "one"})
    conn.next("TASK_RESULT")
    assert agent.kept() == [] and agent.unacked == {}


def test_kept_attempts_are_stopped_when_no_registration_succeeds_in_time(coordinator, start_agent):
    agent = start_agent(capacity=1, keep_running_millis=300)
    first = coordinator.next_conn()
    first.accept_registration()
    assign(first, "j1", "a1", "SLEEP", {"durationMillis": 60_000})
    wait_until(lambda: len(agent.in_flight) == 1, timeout=5, message="the attempt in flight", sleep=gevent.sleep)
    # When the coordinator is gone for good
    coordinator.stop()
    first.close()
    # Then the attempt is stopped once the keep time has passed
    wait_until(lambda: len(agent.in_flight) == 0, timeout=10, message="the kept attempt stopped",
               sleep=gevent.sleep)
    assert agent.kept() == []


def test_after_a_lost_connection_the_next_address_is_tried_first_and_kept_attempts_named_there():
    # Given two coordinators that both accept connections, and a worker given both
    first, second = ScriptedCoordinator(), ScriptedCoordinator()
    cfg = WorkerConfig((Address("127.0.0.1", first.server.server_port),
                        Address("127.0.0.1", second.server.server_port)), "w-t", 1, 50)
    agent = WorkerAgent(cfg)
    runner = gevent.spawn(agent.run)
    try:
        conn = first.next_conn()
        conn.accept_registration()
        assign(conn, "j1", "a1", "SLEEP", {"durationMillis": 60_000})
        wait_until(lambda: len(agent.in_flight) == 1, timeout=5, message="the attempt running", sleep=gevent.sleep)
        # When the first closes the connection (it is still listening)
        conn.close()
        # Then the worker registers with the second, naming its running attempt
        register = second.next_conn().accept_registration()
        assert register["running"] == [{"jobId": "j1", "attemptId": "a1"}]
        with pytest.raises(Empty):
            first.next_conn(timeout=0)
    finally:
        gevent.killall([runner], timeout=5)
        first.stop()
        second.stop()
