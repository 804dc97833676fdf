"""Two coordinators on one PostgreSQL database: one leads, the other stands by and takes
over (docs/SCALING.md; CONTRACT.md, "A standby coordinator (PostgreSQL)").

Real coordinators and workers as processes, a real PostgreSQL server (tests/pg_support.py,
one per session; each test gets a fresh schema). The coordinators listen on ports picked
here, so that workers and clients can be given both addresses before the standby leads.
A takeover under load keeps the limits of a type exact (the load and checks of
test_limits_exact.py).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import ClientError
from jobmesh.protocol import messages as m
from tests.support.connections import RawConn
from tests.support.peers import ScriptedWorker, wait_registered
from tests.support.processes import CoordinatorProc, WorkerProc, child_env, unused_port
from tests.support.waiting import wait_until
from tests.integration.test_limits_exact import MAX_RUNNING, TYPE, check_timelines, set_limit, submit_load
from tests.integration.test_workflows_crash import run_under_crashes

STANDING_BY = "jobmesh coordinator standing by"
EXIT_LEADERSHIP_LOST = 75
TAKEOVER = 60.0  # generous: a freeze is noticed after the session timeout, then recovery runs




class Node(CoordinatorProc):
    """A coordinator on a PostgreSQL URL, on ports chosen before it starts (a standby
    opens them only once it leads)."""

    def __init__(self, tmp_path, url: str, name: str, metrics: bool = False, **flags):
        flags.setdefault("heartbeat_timeout_millis", 3000)  # and so the lease grace (the default on PostgreSQL)
        flags.setdefault("db_session_timeout_millis", 1000)
        super().__init__(tmp_path, db=url, name=name, **flags)
        self.url = url
        self.ports = (unused_port(), unused_port())
        self.metrics_port = unused_port() if metrics else None

    def launch(self) -> "Node":
        self._n += 1
        self.out_path = self.tmp_path / ("%s-%d.out" % (self.name, self._n))
        self.err_path = self.tmp_path / ("%s-%d.err" % (self.name, self._n))
        args = [sys.executable, "-m", "jobmesh", "coordinator", "--db=%s" % self.url,
                "--worker-port=%d" % self.ports[0], "--client-port=%d" % self.ports[1]]
        if self.metrics_port is not None:
            args.append("--metrics-port=%d" % self.metrics_port)
        args += ["--%s=%s" % (k, v) for k, v in self.flags.items() if v is not None]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(args, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())
        return self

    def await_listening(self, timeout: float = TAKEOVER) -> "Node":
        wait_until(self._listening, timeout=timeout, message="%s's listening line" % self.name)
        return self

    def await_standing_by(self, timeout: float = 30.0) -> "Node":
        def standing_by() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError("%s exited rc=%s\n%s" % (self.name, self.proc.returncode, self.stderr()))
            return STANDING_BY in self.stdout()

        wait_until(standing_by, timeout=timeout, message="%s's standing-by line" % self.name)
        return self

    @property
    def worker_target(self) -> str:
        return "127.0.0.1:%d" % self.ports[0]

    @property
    def client_target(self) -> str:
        return "127.0.0.1:%d" % self.ports[1]

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.metrics_port, path), timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


@pytest.fixture
def nodes(tmp_path, postgres_url):
    """``nodes(name, **flags)``: a Node on the test's schema (or ``url=``); all stopped at teardown."""
    made: list[Node] = []

    def make(name: str, url: str = postgres_url, **flags) -> Node:
        node = Node(tmp_path, url, name, **flags)
        made.append(node)
        return node

    yield make
    for node in made:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
        node.cleanup()


@pytest.fixture
def workers(tmp_path):
    started: list[WorkerProc] = []

    def start(target: str, worker_id: str, **kwargs) -> WorkerProc:
        w = WorkerProc(tmp_path, target, worker_id=worker_id, **kwargs).start()
        started.append(w)
        return w

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(10)


def refuses(target: str) -> bool:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def cli_wait(job_id: str, coordinators: str) -> subprocess.Popen:
    """``jobmesh wait JOB --json`` running, its output in pipes (read with ``communicate``)."""
    env = child_env()
    env.pop("GEVENT_MONITOR_THREAD_ENABLE", None)
    argv = [sys.executable, "-m", "jobmesh", "wait", job_id, "--json", "--coordinator=%s" % coordinators]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=env)


def table_state(server, url: str) -> str:
    """Every job row's id, state and last update, read straight from the schema."""
    parts = urllib.parse.urlsplit(url)
    schema = urllib.parse.parse_qs(parts.query)["options"][0].split("=", 1)[1]
    return server.sql("SELECT job_id, state, updated_at FROM %s.jobmesh_jobs ORDER BY job_id" % schema,
                      parts.path.lstrip("/"))


def test_a_standby_opens_no_job_port_and_takes_over_when_the_leader_stops(nodes):
    # Given a leader with a job and a task type's declared defaults, and a second
    # coordinator on the same database
    leader = nodes("leader").launch().await_listening()
    with CoordinatorClient(leader.client_target) as client:
        job_id = client.submit("WORD_COUNT", {"text": "before the takeover"})
    host, port = leader.worker_target.rsplit(":", 1)
    declaring = RawConn((host, int(port)))
    assert declaring.request({"type": "WORKER_REGISTER", "workerId": "w-declares", "capacity": 1,
                              "taskTypes": ["DECLARED"], "taskDefaults": {"DECLARED": {"maxAttempts": 1}}}
                             )["type"] == "WORKER_REGISTERED"
    declaring.close()
    standby = nodes("standby", metrics=True).launch().await_standing_by()

    # Then the second one stands by: no job port, not ready, but alive
    assert refuses(standby.worker_target) and refuses(standby.client_target)
    assert standby.http("/healthz")[0] == 200
    assert standby.http("/readyz")[0] == 503
    assert "jobmesh_leading 0.0" in standby.http("/metrics")[1]
    assert "listening" not in standby.stdout()
    assert "cannot end the session" not in standby.stderr()  # one role: a frozen leader it would end
    # ... and a standby stops at once when told to
    third = nodes("third").launch().await_standing_by()
    assert third.terminate() == 0

    # When the leader stops, the standby takes over with the leader's jobs
    assert leader.terminate() == 0
    standby.await_listening()
    assert standby.http("/readyz")[0] == 200
    assert "jobmesh_leading 1.0" in standby.http("/metrics")[1]
    with CoordinatorClient(standby.client_target) as client:
        assert client.status(job_id)["state"] == "QUEUED"
        # and the defaults it keeps: a job of that type takes them, no worker connected
        assert client.status(client.submit("DECLARED", {}))["maxAttempts"] == 1


def test_a_standby_whose_role_cannot_end_the_leaders_session_says_so_at_start(nodes, postgres_server, postgres_url):
    # Given a leader connected as the superuser, and a role that is no superuser
    leader = nodes("leader").launch().await_listening()
    parts = urllib.parse.urlsplit(postgres_url)
    schema = urllib.parse.parse_qs(parts.query)["options"][0].split("=", 1)[1]
    role = "standby_" + schema
    postgres_server.sql("CREATE ROLE %s LOGIN; GRANT USAGE ON SCHEMA %s TO %s" % (role, schema, role),
                        parts.path.lstrip("/"))
    # When a coordinator connected as that role stands by
    standby = nodes("standby", url=postgres_url.replace("//%s@" % parts.username, "//%s@" % role, 1))
    standby.launch().await_standing_by()
    # Then its log names both roles and what it means for a frozen leader, in one line
    line = wait_until(lambda: [x for x in standby.stderr().splitlines() if "cannot end the session" in x],
                      message="the warning")[0]
    assert "WARNING" in line and "role %s cannot end" % role in line and "role postgres, a superuser" in line
    assert "freezes, only PostgreSQL's own timeouts end its session" in line
    assert standby.terminate() == 0 and leader.terminate() == 0


def test_kill_9_of_the_leader_under_load_loses_nothing_and_keeps_running_work(nodes, workers):
    # Given a leader, a standby, and two workers on both addresses
    leader = nodes("leader").launch().await_listening()
    standby = nodes("standby").launch().await_standing_by()
    both_workers = "%s,%s" % (leader.worker_target, standby.worker_target)
    both_clients = "%s,%s" % (leader.client_target, standby.client_target)
    for n in (1, 2):
        workers(both_workers, "w-%d" % n, capacity=4)
    with CoordinatorClient(both_clients, timeout=30) as client:
        long_id = client.submit("SLEEP", {"durationMillis": 6000}, max_attempts=1)
        wait_until(lambda: client.status(long_id)["state"] == "RUNNING", timeout=30, message="the long job runs")
    # ... CLI waits for that job, given both addresses
    waiters = [cli_wait(long_id, both_clients) for _ in range(3)]

    # ... and clients submitting (each submit with its own key, sent again until answered)
    acknowledged: dict[str, str] = {}
    failures: list[BaseException] = []
    stop = threading.Event()
    after_takeover = threading.Event()

    def submitter(prefix: str) -> None:
        try:
            with CoordinatorClient(both_clients, timeout=30) as c:
                n = 0
                while not stop.is_set():
                    key = "%s-%d" % (prefix, n)
                    job_id = None
                    while job_id is None and not stop.is_set():
                        try:
                            job_id = c.submit("WORD_COUNT", {"text": "job %d" % n}, idempotency_key=key)
                        except ClientError:
                            stop.wait(0.05)  # the leader is gone: the same key again
                    if job_id is not None:
                        acknowledged[key] = job_id
                        if after_takeover.is_set() and n >= 10:
                            return
                    n += 1
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=submitter, args=("c%d" % i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(acknowledged) >= 40, timeout=60, message="submits before the kill")
        with CoordinatorClient(leader.client_target, timeout=30) as client:
            wait_until(lambda: client.stats().waits == 3, timeout=30, message="the CLI waits held by the leader")
            assert client.status(long_id)["state"] == "RUNNING"  # else this test shows no adoption

        # When the leader is killed mid-load
        leader.proc.kill()
        leader.proc.wait(10)
        standby.await_listening()
        after_takeover.set()
        for t in threads:
            t.join(TAKEOVER)
    finally:
        stop.set()
        for waiter in waiters:
            if waiter.poll() is None and not after_takeover.is_set():
                waiter.kill()
    assert not failures, failures
    # ... every CLI wait, sent again to the new leader, printed the job's end
    for waiter in waiters:
        out, err = waiter.communicate(timeout=TAKEOVER)
        assert waiter.returncode == 0, err
        assert json.loads(out)["state"] == "COMPLETED"

    # Then every acknowledged job completes exactly once, the long one still on attempt 1
    with CoordinatorClient(standby.client_target, timeout=60) as client:
        long_job = client.wait(long_id, timeout=TAKEOVER)
        assert long_job["state"] == "COMPLETED" and long_job["attempts"] == 1
        assert [e["event"] for e in client.events(long_id)].count("ASSIGNED") == 1
        for key, job_id in acknowledged.items():
            job = client.wait(job_id, timeout=TAKEOVER)
            assert job["state"] == "COMPLETED", job
            assert [e["event"] for e in client.events(job_id)].count("COMPLETED") == 1, key
        # one job per key, and no other
        listed = {j["jobId"] for j in client.iter_jobs()}
        assert listed == set(acknowledged.values()) | {long_id}


def test_a_frozen_leader_is_replaced_and_exits_75_without_committing(nodes, workers, postgres_server, postgres_url):
    # Given a leader with a worker on both addresses, and a standby
    leader = nodes("leader").launch().await_listening()
    standby = nodes("standby").launch().await_standing_by()
    worker = workers("%s,%s" % (leader.worker_target, standby.worker_target), "w-1", capacity=2)
    with CoordinatorClient(leader.client_target, timeout=30) as client:
        done = client.wait(client.submit("WORD_COUNT", {"text": "job %d" % 1}), timeout=30)
        assert done["state"] == "COMPLETED"
        queued = client.submit("SLEEP", {"durationMillis": 60000}, run_at=time.time() + 86400)  # far ahead: never due here
    # (a worker judges a coordinator by its silence only once it has answered a heartbeat)
    wait_until(lambda: "coordinator answers heartbeats" in worker.log().split("registered worker=w-1", 1)[-1],
               timeout=30, message="heartbeats answered by the leader")

    # When the leader is frozen, the standby takes over (its session timed out)
    leader.proc.send_signal(signal.SIGSTOP)
    standby.await_listening()
    # (its worker, whose heartbeats the frozen process leaves unanswered, moves over)
    with CoordinatorClient(standby.client_target, timeout=30) as client:
        assert client.cancel(queued)[0]  # the new leader writes
        after = client.wait(client.submit("WORD_COUNT", {"text": "job %d" % 2}), timeout=30)
        assert after["state"] == "COMPLETED"

    # Then, thawed, the old leader commits nothing and exits 75
    rows_before = table_state(postgres_server, postgres_url)
    leader.proc.send_signal(signal.SIGCONT)
    assert leader.proc.wait(TAKEOVER) == EXIT_LEADERSHIP_LOST
    assert "leadership lost" in leader.stderr()
    assert "Traceback" not in leader.stderr()
    assert table_state(postgres_server, postgres_url) == rows_before
    with CoordinatorClient(standby.client_target, timeout=30) as client:
        assert client.status(queued)["state"] == "CANCELLED"


def test_postgresql_restarted_under_the_leader_it_exits_75_and_the_standby_leads(nodes, workers, postgres_server):
    # Given a leader with work and a standby
    leader = nodes("leader").launch().await_listening()
    standby = nodes("standby").launch().await_standing_by()
    workers("%s,%s" % (leader.worker_target, standby.worker_target), "w-1", capacity=2)
    with CoordinatorClient(leader.client_target, timeout=30) as client:
        finished = client.wait(client.submit("WORD_COUNT", {"text": "job %d" % 1}), timeout=30)["jobId"]
        pending = [client.submit("WORD_COUNT", {"text": "job %d" % n}, run_at=time.time() + 86400) for n in range(5)]

    # When the database restarts under them
    postgres_server.restart()

    # Then the leader exits 75, and the standby (connecting again) leads with every job
    assert leader.proc.wait(TAKEOVER) == EXIT_LEADERSHIP_LOST
    standby.await_listening()
    with CoordinatorClient(standby.client_target, timeout=30) as client:
        assert client.status(finished)["state"] == "COMPLETED"
        assert [client.status(job_id)["state"] for job_id in pending] == ["SCHEDULED"] * 5
        assert client.wait(client.submit("WORD_COUNT", {"text": "job %d" % 2}), timeout=30)["state"] == "COMPLETED"


def test_up_stands_by_then_starts_its_workers_and_comes_back_after_losing_the_lead(nodes, postgres_url, postgres_server,
                                                                                  tmp_path):
    # Given a coordinator leading the database, and `jobmesh up` on the same database
    leader = nodes("leader").launch().await_listening()
    client_target = "127.0.0.1:%d" % unused_port()
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        up = subprocess.Popen([sys.executable, "-m", "jobmesh", "up", "--db=%s" % postgres_url, "--workers=1",
                               "--worker-port=%d" % unused_port(), "--client-port=%s" % client_target.split(":")[1],
                               "--heartbeat-timeout-millis=3000", "--sweep-interval-millis=20",
                               "--db-session-timeout-millis=1000"],
                              stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())
    waiters: list[subprocess.Popen] = []
    try:
        # Then up's coordinator stands by, and up starts no worker yet
        wait_until(lambda: STANDING_BY in out_path.read_text(), timeout=30, message="up's standing-by line")
        assert "worker started" not in err_path.read_text()

        # When the leader stops, up's coordinator leads and its worker runs jobs
        assert leader.terminate() == 0
        wait_until(lambda: "listening" in out_path.read_text(), timeout=TAKEOVER, message="up's listening line")
        with CoordinatorClient(client_target, timeout=30) as client:
            assert client.wait(client.submit("WORD_COUNT", {"text": "one"}), timeout=30)["state"] == "COMPLETED"

            # (and a job with CLI waits pending, given up's one address; it is not due before the test ends it)
            pending = client.submit("SLEEP", {"durationMillis": 1}, run_at=time.time() + 86400)
            waiters.extend(cli_wait(pending, client_target) for _ in range(2))
            wait_until(lambda: client.stats().waits == 2, timeout=30, message="the CLI waits held")

        # When PostgreSQL restarts under it, its coordinator exits 75 and up starts it again
        postgres_server.restart()
        wait_until(lambda: "rc=75" in err_path.read_text(), timeout=TAKEOVER, message="the coordinator's exit 75")
        wait_until(lambda: out_path.read_text().count("listening") == 2, timeout=TAKEOVER, message="listening again")
        with CoordinatorClient(client_target, timeout=30) as client:
            assert client.wait(client.submit("WORD_COUNT", {"text": "two"}), timeout=30)["state"] == "COMPLETED"
            assert client.cancel(pending)[0]
        # ... and the waits, sent again to it on the same address, printed the job's end (exit 1: CANCELLED)
        for waiter in waiters:
            out, err = waiter.communicate(timeout=TAKEOVER)
            assert waiter.returncode == 1 and "ended CANCELLED" in err, err
            assert json.loads(out)["state"] == "CANCELLED"
    finally:
        for waiter in waiters:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait(10)
        up.terminate()
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)


def test_up_stopped_while_its_coordinator_stands_by_exits_0(nodes, postgres_url, tmp_path):
    # A stop is no failed start: a service manager stopping a standby's unit must not see it fail.
    nodes("leader").launch().await_listening()
    out_path, err_path = tmp_path / "up.out", tmp_path / "up.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        up = subprocess.Popen([sys.executable, "-m", "jobmesh", "up", "--db=%s" % postgres_url, "--workers=1",
                               "--worker-port=%d" % unused_port(), "--client-port=%d" % unused_port()],
                              stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=child_env())
    try:
        wait_until(lambda: STANDING_BY in out_path.read_text(), timeout=30, message="up's standing-by line")
        up.terminate()
        assert up.wait(30) == 0, err_path.read_text()
        assert "did not start" not in err_path.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def test_a_leader_whose_core_is_behind_on_a_worker_still_answers_its_heartbeats(nodes, postgres_url):
    # A worker given several addresses leaves a coordinator that answers none of its
    # heartbeats for three intervals (a frozen one). A healthy leader whose core waits for
    # a commit (here: the jobs table locked by another session) stops reading a worker
    # connection that has MAX_BACKLOG events waiting; its heartbeats must still be answered.
    import psycopg

    from jobmesh.coordinator.ports.connection import MAX_BACKLOG

    leader = nodes("leader", heartbeat_timeout_millis=60_000).launch().await_listening()
    worker = RawConn(("127.0.0.1", leader.ports[0]), timeout=30)
    worker.send({"type": "WORKER_REGISTER", "workerId": "w-busy", "capacity": 1})
    assert worker.recv()["type"] == "WORKER_REGISTERED"
    worker.send({"type": "HEARTBEAT", "workerId": "w-busy", "ack": True})  # as such a worker's every heartbeat
    assert worker.recv()["type"] == "HEARTBEAT_ACK"
    def commits_waiting() -> int:
        return watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchone()[0]

    with psycopg.connect(postgres_url) as locker, psycopg.connect(postgres_url, autocommit=True) as watcher:
        locker.execute("LOCK TABLE jobmesh_jobs IN ACCESS EXCLUSIVE MODE")  # held until the transaction ends
        client = RawConn(("127.0.0.1", leader.ports[1]), timeout=30)
        client.send({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
        wait_until(lambda: commits_waiting() > 0, timeout=30, message="the leader's commit waiting for the lock")
        for n in range(MAX_BACKLOG + 8):  # results the core cannot take while it waits
            worker.send({"type": "TASK_RESULT", "workerId": "w-busy", "jobId": "j-%d" % n, "attemptId": "a",
                         "success": True, "result": {}})
        worker.send({"type": "HEARTBEAT", "workerId": "w-busy", "ack": True})
        frame = worker.recv()  # within the socket's 30 s, the lock still held
        assert frame is not None and frame["type"] == "HEARTBEAT_ACK"
        assert commits_waiting() > 0
    client.close()
    worker.close()


def test_a_result_written_into_a_frozen_leader_is_applied_by_the_standby(nodes, workers):
    # Given a leader, a standby that keeps leases for 20 s at its takeover, and a worker on
    # both addresses (heartbeats every second: it leaves a silent leader after three)
    leader = nodes("leader").launch().await_listening()
    standby = nodes("standby", lease_grace_millis=20_000).launch().await_standing_by()
    worker = workers("%s,%s" % (leader.worker_target, standby.worker_target), "w-1", capacity=1,
                     heartbeat_millis=1000)
    wait_until(lambda: "coordinator answers heartbeats" in worker.log(), timeout=30,
               message="heartbeats answered by the leader")
    with CoordinatorClient(leader.client_target, timeout=30) as client:
        job_id = client.submit("SLEEP", {"durationMillis": 800})
    wait_until(lambda: "task started job=%s" % job_id in worker.log(), timeout=30, message="the task started")

    # When the leader freezes while the task runs: its result goes into the frozen
    # process's socket, then the worker leaves for the standby, which takes over
    leader.proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: "coordinator silent" in worker.log(), timeout=30, message="the worker left the leader")
    log = worker.log()
    assert log.index("task finished job=%s" % job_id) < log.index("coordinator silent"), "finished after leaving"
    standby.await_listening()

    # Then the standby applies the result the worker still held: attempt 1, nothing re-run
    with CoordinatorClient(standby.client_target, timeout=30) as client:
        final = client.wait(job_id, timeout=TAKEOVER)
        assert (final["state"], final["attempts"], final["result"]) == ("COMPLETED", 1, {"sleptMillis": 800}), final
        assert [e["event"] for e in client.events(job_id)] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
    assert worker.count("task started job=%s" % job_id) == 1


def test_a_standby_taking_over_from_a_killed_leader_keeps_limits_exact(nodes, workers):
    # (the load and the checks: test_limits_exact.py)
    # Given a leader, a standby, and two workers on both addresses
    leader = nodes("leader").launch().await_listening()
    standby = nodes("standby").launch().await_standing_by()
    both_workers = "%s,%s" % (leader.worker_target, standby.worker_target)
    for n in (1, 2):
        workers(both_workers, "w-%d" % n, capacity=4)
    with CoordinatorClient(leader.client_target, timeout=30) as client:
        wait_registered(client, ["w-1", "w-2"])
        set_limit(client)
        job_ids = submit_load(client, 36)
        wait_until(lambda: client.request(m.LimitGet(TYPE), m.Limit).limit["running"] == MAX_RUNNING,
                   message="the limit reached")
    # When the leader is killed under load and the standby takes over
    leader.proc.kill()
    leader.proc.wait(10)
    standby.await_listening()
    with CoordinatorClient(standby.client_target, timeout=60) as client:
        assert client.request(m.LimitGet(TYPE), m.Limit).limit["maxRunning"] == MAX_RUNNING
        job_ids += submit_load(client, 12, offset=36)
        # Then no instant of any timeline passed a limit, and no unique key had two live jobs
        check_timelines(client, job_ids)


def test_a_standby_taking_over_a_workflow_releases_each_waiting_job_once_with_every_parent(nodes):
    # Given a leader running a diamond whose first job completed, and a standby
    leader = nodes("leader", lease_grace_millis=0).launch().await_listening()
    standby = nodes("standby", lease_grace_millis=0).launch().await_standing_by()
    worker = ScriptedWorker(tuple_of(leader.worker_target), "w-before", capacity=1)
    worker.register(task_types=["WF-TAKEOVER"])
    client = RawConn(tuple_of(leader.client_target))
    jobs = [{"ref": ref, "taskType": "WF-TAKEOVER", "payload": {"ref": ref}, "dependsOn": deps}
            for ref, deps in (("a", []), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"]))]
    submitted = client.request({"type": "SUBMIT_WORKFLOW", "jobs": jobs})
    assert submitted["type"] == "WORKFLOW_SUBMITTED", submitted
    ids = submitted["jobIds"]
    worker.complete(worker.await_assign(), {"v": "a"})
    worker.await_assign()  # a branch runs when the leader dies
    client.close()
    # When the leader is killed and the standby takes over
    leader.kill()
    worker.close()
    standby.await_listening()
    # Then the branches run with their parent's result, and the join once, with both of theirs
    after = ScriptedWorker(tuple_of(standby.worker_target), "w-after", capacity=4)
    after.register(task_types=["WF-TAKEOVER"])
    try:
        branches = [after.await_assign(TAKEOVER), after.await_assign(TAKEOVER)]
        assert {a["jobId"] for a in branches} == {ids["b"], ids["c"]}
        assert all(a["parents"] == {"a": {"v": "a"}} for a in branches)
        for a in branches:
            after.complete(a, {"v": a["payload"]["ref"]})
        join = after.await_assign()
        assert join["jobId"] == ids["d"] and join["parents"] == {"b": {"v": "b"}, "c": {"v": "c"}}
        after.complete(join, {})
        assert after.poll_assign(0.3) is None
    finally:
        after.close()


def test_takeovers_from_leaders_killed_at_random_points_of_a_fan_out_fan_in_lose_and_repeat_no_step(nodes, tmp_path):
    # (the workflow, the load and the checks: test_workflows_crash.py)
    # Given a leader and a standby that let workers keep their attempts at a takeover
    pair = [nodes(name, lease_grace_millis=10_000) for name in ("a", "b")]
    pair[0].launch().await_listening()
    pair[1].launch().await_standing_by()
    workers_on = ",".join(node.worker_target for node in pair)
    clients_on = ",".join(node.client_target for node in pair)
    started: list[WorkerProc] = []

    def crash(n: int) -> None:
        # When the leader is killed, the standby takes over, and the killed one stands by again
        leader, standby = pair[n % 2], pair[(n + 1) % 2]
        standby.await_standing_by()  # (launched again at the crash before, it is ready by now)
        leader.kill()
        standby.await_listening()
        leader.launch()

    try:
        # Then the workflow completes with every step once, with all its parents' results
        run_under_crashes(tmp_path, "postgres", clients_on, workers_on, crash, started)
    finally:
        for worker in started:
            worker.cleanup()


def tuple_of(target: str) -> tuple[str, int]:
    host, port = target.rsplit(":", 1)
    return host, int(port)
