"""Tokens with roles against a real coordinator (--auth-file): AUTH on both JSON ports,
every role against every request kind, wrong, missing and removed tokens, SIGHUP,
per-type limits, submittedBy, the metrics port, real workers and the CLI with a token.

The stateless checks share one coordinator (``authed``); tests that change the auth file
or the process start their own.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobmesh import auth
from jobmesh.client import CoordinatorClient
from jobmesh.errors import RequestFailed
from jobmesh.protocol import messages as m
from tests.integration import test_dashboard_browser as dashboard_browser
from tests.support.cli import run_cli
from tests.support.connections import RawConn, read_until_closed, stranger
from tests.support.peers import ScriptedWorker
from tests.support.processes import CoordinatorProc, closed_address
from tests.support.waiting import wait_until

ROLES = ("worker", "reader", "client", "admin")
LIMITED = ("GREET", "etl.*")  # the taskTypes of the "etl" client, "etl-admin" and "etl-worker" tokens


class Tokens:
    """An auth file made with ``jobmesh.auth.new_token``, and the token of each entry."""

    def __init__(self, path):
        self.path = str(path)
        self.by_name: dict[str, str] = {}

    def new(self, name: str, role: str, task_types=None) -> str:
        self.by_name[name] = auth.new_token(self.path, name, role, task_types)
        return self.by_name[name]

    def __getitem__(self, name: str) -> str:
        return self.by_name[name]


def make_tokens(directory) -> Tokens:
    tokens = Tokens(directory / "auth.toml")
    for role in ROLES:
        tokens.new(role, role)
    tokens.new("etl", "client", LIMITED)
    tokens.new("etl-admin", "admin", LIMITED)
    tokens.new("etl-worker", "worker", LIMITED)
    return tokens


@pytest.fixture(scope="module")
def authed(tmp_path_factory):
    """One coordinator with --auth-file and --metrics-port, shared; ``.tokens`` on it."""
    directory = tmp_path_factory.mktemp("authed")
    tokens = make_tokens(directory)
    proc = CoordinatorProc(directory, auth_file=tokens.path, metrics_port=0)
    proc.start()
    proc.tokens = tokens
    yield proc
    proc.cleanup()


def connect(addr, token: str | None, opened: list) -> RawConn:
    """A raw connection that has sent AUTH (when ``token``) and had AUTH_OK back."""
    conn = RawConn(addr)
    opened.append(conn)
    if token is not None:
        reply = conn.request({"type": "AUTH", "token": token})
        assert reply["type"] == "AUTH_OK", reply
    return conn


def etl_worker(authed, opened: list, worker_id: str) -> ScriptedWorker:
    """A scripted worker that has authenticated with the "etl-worker" token (not registered yet)."""
    worker = ScriptedWorker(authed.worker_addr, worker_id)
    opened.append(worker)
    assert worker.conn.request({"type": "AUTH", "token": authed.tokens["etl-worker"]})["type"] == "AUTH_OK"
    return worker


@pytest.fixture
def opened():
    conns: list = []
    yield conns
    for conn in conns:
        conn.close()


def admin_client(coord) -> CoordinatorClient:
    return CoordinatorClient(*coord.client_addr, token=coord.tokens["admin"])


# ---- every role against every request kind ----------------------------------------------

# The least role that may make each kind: the contract's "Roles" (worker is its own).
LEAST_ROLE = {
    "GET_JOB_STATUS": "reader", "LIST_JOBS": "reader", "LIST_WORKERS": "reader", "GET_JOB_EVENTS": "reader",
    "WAIT_JOB": "reader", "GET_STATS": "reader", "GET_JOB_PAYLOAD": "reader", "SCHEDULE_GET": "reader", "SCHEDULE_LIST": "reader",
    "SCHEDULE_PREVIEW": "reader",
    "SUBMIT_JOB": "client", "CANCEL_JOB": "client",
    "RETRY_JOB": "admin", "PURGE_JOBS": "admin", "SCHEDULE_PUT": "admin", "SCHEDULE_PAUSE": "admin",
    "SCHEDULE_RESUME": "admin", "SCHEDULE_DELETE": "admin", "SCHEDULE_TRIGGER": "admin",
    "LIMIT_GET": "reader", "LIMIT_LIST": "reader", "LIMIT_PUT": "admin", "LIMIT_DELETE": "admin",
    "TYPE_PAUSE": "admin", "TYPE_RESUME": "admin",
    "SUBMIT_WORKFLOW": "client", "WORKFLOW_CANCEL": "client", "WORKFLOW_STATUS": "reader", "WAIT_WORKFLOW": "reader",
}
RANK = {"reader": 1, "client": 2, "admin": 3}


def may(role: str, kind: str) -> bool:
    return role != "worker" and RANK[role] >= RANK[LEAST_ROLE[kind]]


def request_of(kind: str, job_id: str, finished_id: str) -> dict:
    """A well-formed request of each client-port kind (schedule kinds by the contract's names)."""
    return {
        "SUBMIT_JOB": {"taskType": "SLEEP", "payload": {"durationMillis": 1}},
        "GET_JOB_STATUS": {"jobId": job_id},
        "LIST_JOBS": {"limit": 5},
        "LIST_WORKERS": {},
        "CANCEL_JOB": {"jobId": job_id},
        "GET_JOB_EVENTS": {"jobId": job_id},
        "GET_JOB_PAYLOAD": {"jobId": job_id},
        "RETRY_JOB": {"jobId": finished_id},
        "PURGE_JOBS": {"olderThanMillis": 10 ** 12},
        "WAIT_JOB": {"jobId": job_id, "timeoutMillis": 0},
        "GET_STATS": {},
        "SCHEDULE_PUT": {"schedule": {"name": "nightly", "everyMillis": 60000, "taskType": "SLEEP",
                                      "payload": {"durationMillis": 1}}},
        "SCHEDULE_GET": {"name": "nightly"},
        "SCHEDULE_LIST": {},
        "SCHEDULE_PAUSE": {"name": "nightly"},
        "SCHEDULE_RESUME": {"name": "nightly"},
        "SCHEDULE_DELETE": {"name": "nightly"},
        "SCHEDULE_TRIGGER": {"name": "nightly"},
        "SCHEDULE_PREVIEW": {"everyMillis": 60000, "timezone": "UTC", "fromMillis": 0, "count": 2},
        "LIMIT_PUT": {"limit": {"taskType": "NO_SUCH_TYPE", "maxRunning": 1}},  # ERROR: unknown type
        "LIMIT_GET": {"taskType": "NO_SUCH_TYPE"},
        "LIMIT_LIST": {},
        "LIMIT_DELETE": {"taskType": "NO_SUCH_TYPE"},
        "TYPE_PAUSE": {"taskType": "NO_SUCH_TYPE"},
        "TYPE_RESUME": {"taskType": "NO_SUCH_TYPE"},
        "SUBMIT_WORKFLOW": {"jobs": [{"ref": "a", "taskType": "SLEEP", "payload": {"durationMillis": 1}}]},
        "WORKFLOW_STATUS": {"workflowId": "no-such-workflow"},  # ERROR: unknown workflow
        "WORKFLOW_CANCEL": {"workflowId": "no-such-workflow"},
        "WAIT_WORKFLOW": {"workflowId": "no-such-workflow", "timeoutMillis": 0},
    }[kind]


@pytest.fixture(scope="module")
def jobs(authed):
    """A queued job and a finished (cancelled) one, made by the admin."""
    with admin_client(authed) as client:
        queued = client.submit("SLEEP", {"durationMillis": 1})
        finished = client.submit("SLEEP", {"durationMillis": 1})
        client.cancel(finished)
    return queued, finished


def test_every_client_port_kind_has_a_role():
    assert set(m.CLIENT_PORT_REQUESTS) <= set(LEAST_ROLE)


@pytest.mark.parametrize("kind", sorted(m.CLIENT_PORT_REQUESTS))
@pytest.mark.parametrize("role", ROLES)
def test_each_role_may_make_exactly_the_contracts_requests(authed, jobs, opened, role, kind):
    # Given a connection authenticated with a token of ``role``
    conn = connect(authed.client_addr, authed.tokens[role], opened)
    # When it makes a request of ``kind``
    reply = conn.request(dict(request_of(kind, *jobs), type=kind))
    # Then a role that may not gets "forbidden" and the connection stays open; one that
    # may gets the request's own answer (which may be an ERROR of its own, never forbidden)
    forbidden = reply["type"] == "ERROR" and reply["message"].startswith("forbidden: ")
    assert forbidden is not may(role, kind), reply
    if forbidden:
        assert role in reply["message"] and kind in reply["message"]
    follow_up = conn.request({"type": "GET_STATS"})
    assert follow_up["type"] == ("STATS" if role != "worker" else "ERROR"), follow_up


def test_a_reader_reads_a_jobs_payload(authed, jobs, opened):
    queued, _ = jobs
    # A reader gets the payload (as the dashboard's job view shows it), on a raw
    # connection and through the library
    conn = connect(authed.client_addr, authed.tokens["reader"], opened)
    assert conn.request({"type": "GET_JOB_PAYLOAD", "jobId": queued}) == {
        "type": "JOB_PAYLOAD", "jobId": queued, "payload": {"durationMillis": 1}}
    with CoordinatorClient(*authed.client_addr, token=authed.tokens["reader"]) as reader:
        assert reader.payload(queued) == {"durationMillis": 1}
    # a worker token on the client port may not
    worker = connect(authed.client_addr, authed.tokens["worker"], opened)
    reply = worker.request({"type": "GET_JOB_PAYLOAD", "jobId": queued})
    assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), reply


@pytest.mark.parametrize("role", ROLES)
def test_only_a_worker_token_registers_a_worker(authed, opened, role):
    conn = connect(authed.worker_addr, authed.tokens[role], opened)
    register = {"type": "WORKER_REGISTER", "workerId": "w-%s" % role, "capacity": 1}
    reply = conn.request(register)
    if role == "worker":
        assert reply == {"type": "WORKER_REGISTERED", "workerId": "w-worker"}
        conn.send({"type": "HEARTBEAT", "workerId": "w-worker"})
        return
    # not even admin: forbidden, and the connection stays open (forbidden again)
    assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), reply
    assert conn.request({"type": "HEARTBEAT", "workerId": "x"})["message"].startswith("forbidden: ")
    assert conn.request(register)["message"].startswith("forbidden: ")


# ---- wrong, missing and malformed tokens --------------------------------------------------

@pytest.mark.parametrize("port", ["client", "worker"])
@pytest.mark.parametrize("first,says", [
    ({"type": "AUTH", "token": "not-a-token"}, "authentication failed"),
    ({"type": "AUTH", "token": ""}, "authentication failed"),
    ({"type": "AUTH", "token": 12}, "authentication failed"),
    ({"type": "AUTH"}, "authentication failed"),
    ({"type": "GET_STATS"}, "authentication required"),
    ({"type": "WORKER_REGISTER", "workerId": "w", "capacity": 1}, "authentication required"),
])
def test_anything_but_a_known_token_first_is_refused_and_closed(authed, opened, port, first, says):
    # (from an address of its own: the failures of these tests slow nobody else's AUTH)
    conn = RawConn(authed.client_addr if port == "client" else authed.worker_addr, source=stranger())
    opened.append(conn)
    conn.send(first)
    frames, closed = read_until_closed(conn, timeout=15)
    assert frames == [{"type": "ERROR", "message": says}] and closed


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                    max_leaves=8)
FIRST_FRAMES = (st.fixed_dictionaries({"type": st.just("AUTH")}, optional={"token": JSON}) |
                st.fixed_dictionaries({"type": st.just("AUTH"), "token": st.text(max_size=300)}) |
                st.dictionaries(st.text(max_size=20), JSON, max_size=4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=FIRST_FRAMES, port=st.sampled_from(["client", "worker"]))
def test_fuzzed_first_frames_never_authenticate(authed, first, port):
    """Whatever a first frame holds, only a known token is let in: anything else is one
    ERROR and the connection closes; the coordinator stays up."""
    opened: list = []
    try:
        conn = RawConn(authed.client_addr if port == "client" else authed.worker_addr, source=stranger())
        opened.append(conn)
        conn.send(first)
        frames, closed = read_until_closed(conn, timeout=15)
        assert closed and len(frames) == 1 and frames[0]["type"] == "ERROR", frames
        assert frames[0]["message"] in ("authentication failed", "authentication required")
        assert (frames[0]["message"] == "authentication required") is (first.get("type") != "AUTH")
    finally:
        for c in opened:
            c.close()
    assert authed.proc.poll() is None


@pytest.mark.parametrize("port", ["client", "worker"])
def test_a_second_auth_is_a_protocol_violation(authed, opened, port):
    role = "client" if port == "client" else "worker"
    conn = connect(authed.client_addr if port == "client" else authed.worker_addr, authed.tokens[role], opened)
    conn.send({"type": "AUTH", "token": authed.tokens[role]})
    frames, closed = read_until_closed(conn, timeout=15)
    assert frames == [{"type": "ERROR", "message": "AUTH comes once, as a connection's first frame"}] and closed


def test_the_sha256_in_the_file_is_not_itself_a_token(authed, opened):
    # the file's hex hash is not a password
    digest = auth.token_digest(authed.tokens["admin"])
    conn = RawConn(authed.client_addr)
    opened.append(conn)
    conn.send({"type": "AUTH", "token": digest})
    assert read_until_closed(conn, timeout=15) == ([{"type": "ERROR", "message": "authentication failed"}], True)


def test_the_library_and_the_cli_with_and_without_a_token(authed, tmp_path):
    target = authed.client_target
    with CoordinatorClient(*authed.client_addr) as anonymous:
        with pytest.raises(RequestFailed, match="authentication required"):
            anonymous.stats()
    with CoordinatorClient(*authed.client_addr, token="wrong") as wrong:
        with pytest.raises(RequestFailed, match="authentication failed"):
            wrong.stats()
    with CoordinatorClient(*authed.client_addr, token=authed.tokens["reader"]) as reader:
        assert reader.stats().submitted >= 0
        with pytest.raises(RequestFailed, match="forbidden"):
            reader.submit("SLEEP", {"durationMillis": 1})
    token_file = tmp_path / "client.token"
    token_file.write_text(authed.tokens["client"] + "\n")
    # a token serves every address of a list (the first here is closed, as a standby is)
    out = run_cli("submit", "SLEEP", '{"durationMillis": 1}', "--json", "--token-file=%s" % token_file,
                  coordinator="%s,%s" % (closed_address(), target))
    assert out.returncode == 0, out.stderr
    refused = run_cli("list", coordinator=target)
    assert refused.returncode == 1 and "authentication required" in refused.stderr
    assert "--token-file" in refused.stderr
    env_cli = run_cli_env({"JOBMESH_TOKEN": authed.tokens["reader"]}, "list", "--json", coordinator=target)
    assert env_cli.returncode == 0, env_cli.stderr
    env_file = run_cli_env({"JOBMESH_TOKEN_FILE": str(token_file)}, "workers", coordinator=target)
    assert env_file.returncode == 0, env_file.stderr


def test_the_cli_names_the_command_and_the_role_it_needs(authed, tmp_path):
    token_file = tmp_path / "reader.token"
    token_file.write_text(authed.tokens["reader"])
    os.chmod(token_file, 0o644)
    out = run_cli("schedule", "add", "nightly-reader", "--every-millis=60000", "SLEEP", '{"durationMillis": 1}',
                  "--token-file=%s" % token_file, coordinator=authed.client_target)
    assert out.returncode == 1
    assert "'jobmesh schedule add' needs a token of role admin, and this one is a reader token" in out.stderr
    assert "forbidden: token" in out.stderr  # the coordinator's own words are kept
    # and a token file others may read is named, with the fix
    assert "the token file %s is readable by other users (mode 0644)" % token_file in out.stderr
    assert "chmod 600" in out.stderr
    os.chmod(token_file, 0o600)
    out = run_cli("submit", "SLEEP", '{"durationMillis": 1}', "--token-file=%s" % token_file,
                  coordinator=authed.client_target)
    assert out.returncode == 1
    assert "'jobmesh submit' needs a token of role client or admin, and this one is a reader token" in out.stderr
    assert "readable by other users" not in out.stderr


def test_the_cli_names_the_limit_command_and_the_role_it_needs(authed, tmp_path):
    # Given a reader token and a client token
    files = {}
    for role in ("reader", "client"):
        files[role] = tmp_path / ("%s.token" % role)
        files[role].write_text(authed.tokens[role])
        os.chmod(files[role], 0o600)
    # Then changes name the command and admin, for either
    for role, argv, command in (("reader", ("limit", "set", "SLEEP", "--max-running=1"), "limit set"),
                                ("client", ("limit", "rm", "SLEEP"), "limit rm"),
                                ("client", ("pause", "SLEEP"), "pause"),
                                ("reader", ("resume", "SLEEP"), "resume")):
        out = run_cli(*argv, "--token-file=%s" % files[role], coordinator=authed.client_target)
        assert out.returncode == 1, out.stderr
        assert ("'jobmesh %s' needs a token of role admin, and this one is a %s token" % (command, role)
                in out.stderr), out.stderr
        assert out.stderr.count("\n") == 1
    # and reads are a reader's
    out = run_cli("limit", "list", "--json", "--token-file=%s" % files["reader"], coordinator=authed.client_target)
    assert out.returncode == 0, out.stderr
    out = run_cli("limit", "show", "SLEEP", "--token-file=%s" % files["reader"], coordinator=authed.client_target)
    assert out.returncode == 0 and "type      SLEEP" in out.stdout, out.stderr


def run_cli_env(env: dict, *args, coordinator: str):
    import subprocess
    import sys

    from tests.support.processes import child_env

    full = child_env()
    full.pop("GEVENT_MONITOR_THREAD_ENABLE", None)
    full.update(env)
    return subprocess.run([sys.executable, "-m", "jobmesh", *args, "--coordinator=%s" % coordinator],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20, env=full)


# ---- submittedBy and per-type limits -------------------------------------------------------

def test_snapshots_and_the_submitted_event_name_the_token(authed):
    with CoordinatorClient(*authed.client_addr, token=authed.tokens["client"]) as client:
        job_id = client.submit("SLEEP", {"durationMillis": 1})
        assert client.status(job_id)["submittedBy"] == "client"
        first = client.events(job_id)[0]
        assert first["event"] == "SUBMITTED" and "client" in first["detail"]
        client.cancel(job_id)
        listed = client.list_jobs(limit=1000)[0]
        assert {j["jobId"]: j["submittedBy"] for j in listed}[job_id] == "client"
    with admin_client(authed) as admin:
        retried = admin.retry(job_id)
        assert admin.status(retried)["submittedBy"] == "admin"
        # A trigger makes a job as a submit does: it names the token too
        admin.schedules.put("audited", "SLEEP", {"durationMillis": 1}, cron="0 3 * * *")
        triggered = admin.status(admin.schedules.trigger("audited"))
        assert triggered["scheduleName"] == "audited" and triggered["submittedBy"] == "admin", triggered
        assert "admin" in admin.events(triggered["jobId"])[0]["detail"]
        admin.schedules.delete("audited")


def test_task_type_limits_of_client_and_worker_tokens(authed, opened):
    # Given a worker token limited to GREET and etl.*: it may declare only those
    refused = etl_worker(authed, opened, "etl-w1")
    reply = refused.conn.request({"type": "WORKER_REGISTER", "workerId": "etl-w1", "capacity": 1})
    assert reply["type"] == "ERROR" and "forbidden" in reply["message"] and "declare" in reply["message"], reply
    reply = refused.conn.request({"type": "WORKER_REGISTER", "workerId": "etl-w1", "capacity": 1,
                                  "taskTypes": ["etl.load", "SLEEP"]})
    assert reply["type"] == "ERROR" and "'SLEEP'" in reply["message"], reply
    worker = refused  # the same connection, still open, registers within its limits
    worker.register(task_types=["etl.load", "GREET"])
    # And a client token limited the same way submits only those
    etl = connect(authed.client_addr, authed.tokens["etl"], opened)
    submitted = etl.request({"type": "SUBMIT_JOB", "taskType": "etl.load", "payload": {"n": 1}})
    assert submitted["type"] == "JOB_SUBMITTED", submitted
    for other in ("SLEEP", "etl", "etlx.load", "GREETING"):
        reply = etl.request({"type": "SUBMIT_JOB", "taskType": other, "payload": {"durationMillis": 1}})
        assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), (other, reply)
    assigned = worker.await_assign()
    assert assigned["jobId"] == submitted["jobId"]
    worker.complete(assigned, {"ok": True})
    status = etl.request({"type": "GET_JOB_STATUS", "jobId": submitted["jobId"]})["job"]
    assert status["submittedBy"] == "etl"
    worker.close()


def test_a_limited_client_token_submits_a_workflow_only_if_it_may_submit_every_job(authed, opened):
    # Given a client token limited to GREET and etl.*, and a worker that declares etl.load
    declares = etl_worker(authed, opened, "etl-w-flows")
    declares.register(task_types=["etl.load"])
    etl = connect(authed.client_addr, authed.tokens["etl"], opened)
    before = etl.request({"type": "LIST_JOBS", "limit": 1000})["jobs"]
    # A workflow with one job of another type is forbidden whole, and makes nothing
    reply = etl.request({"type": "SUBMIT_WORKFLOW", "jobs": [
        {"ref": "a", "taskType": "etl.load", "payload": {}},
        {"ref": "b", "taskType": "SLEEP", "payload": {"durationMillis": 1}, "dependsOn": ["a"]}]})
    assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), reply
    assert "may not submit task type 'SLEEP'" in reply["message"], reply
    assert etl.request({"type": "LIST_JOBS", "limit": 1000})["jobs"] == before
    # Within its types it may, and its jobs name it
    reply = etl.request({"type": "SUBMIT_WORKFLOW", "jobs": [{"ref": "a", "taskType": "etl.load", "payload": {}}]})
    assert reply["type"] == "WORKFLOW_SUBMITTED", reply
    job = etl.request({"type": "GET_JOB_STATUS", "jobId": reply["jobIds"]["a"]})["job"]
    assert (job["submittedBy"], job["workflowId"]) == ("etl", reply["workflowId"])
    assert etl.request({"type": "WORKFLOW_CANCEL", "workflowId": reply["workflowId"]})["state"] == "CANCELLED"
    # As CANCEL_JOB cancels anyone's job, WORKFLOW_CANCEL cancels anyone's workflow, of any type
    other = connect(authed.client_addr, authed.tokens["client"], opened)
    theirs = other.request({"type": "SUBMIT_WORKFLOW", "jobs": [
        {"ref": "s", "taskType": "SLEEP", "payload": {"durationMillis": 1}, "runAtMillis": 4_000_000_000_000}]})
    assert theirs["type"] == "WORKFLOW_SUBMITTED", theirs
    assert etl.request({"type": "WORKFLOW_CANCEL", "workflowId": theirs["workflowId"]})["state"] == "CANCELLED"


def test_a_limited_admin_token_limits_only_its_task_types(authed, opened):
    # Given an admin token limited to GREET and etl.*
    etl = connect(authed.client_addr, authed.tokens["etl-admin"], opened)
    # A limit of another type is forbidden, whichever request changes it; reads are not
    for request in ({"type": "LIMIT_PUT", "limit": {"taskType": "SLEEP", "maxRunning": 0}},
                    {"type": "TYPE_PAUSE", "taskType": "SLEEP"}, {"type": "TYPE_RESUME", "taskType": "SLEEP"},
                    {"type": "LIMIT_DELETE", "taskType": "SLEEP"}):
        reply = etl.request(request)
        assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), (request, reply)
        assert "may not limit task type 'SLEEP'" in reply["message"], reply
    assert etl.request({"type": "LIMIT_GET", "taskType": "SLEEP"})["limit"]["maxRunning"] is None
    # Within its limits it may (GREET: a type a worker of this module declared, or an ERROR of its own)
    for kind in ("TYPE_PAUSE", "TYPE_RESUME"):  # resumed: the module's other tests run GREET jobs
        reply = etl.request({"type": kind, "taskType": "GREET"})
        assert not (reply["type"] == "ERROR" and reply["message"].startswith("forbidden: ")), reply


def test_a_limited_admin_token_schedules_only_its_task_types(authed, opened):
    # Given an admin token limited to GREET and etl.*: a schedule's fires submit its
    # taskType, so a schedule of another type is as forbidden as submitting one (and a
    # worker has declared etl.load)
    worker = etl_worker(authed, opened, "etl-w2")
    worker.register(task_types=["etl.load"])
    etl = connect(authed.client_addr, authed.tokens["etl-admin"], opened)
    body = {"name": "etl-nightly", "cron": "0 3 * * *", "timezone": "UTC", "payload": {"durationMillis": 1}}
    reply = etl.request({"type": "SCHEDULE_PUT", "schedule": dict(body, taskType="SLEEP")})
    assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: ") and "'SLEEP'" in reply["message"], reply
    assert etl.request({"type": "SCHEDULE_GET", "name": "etl-nightly"})["type"] == "ERROR"
    # Within its limits it may
    reply = etl.request({"type": "SCHEDULE_PUT", "schedule": dict(body, taskType="etl.load")})
    assert reply["type"] == "SCHEDULE" and reply["schedule"]["taskType"] == "etl.load", reply
    triggered = etl.request({"type": "SCHEDULE_TRIGGER", "name": "etl-nightly"})
    assert triggered["type"] == "JOB_SUBMITTED", triggered
    assert etl.request({"type": "SCHEDULE_DELETE", "name": "etl-nightly"})["type"] != "ERROR"
    # Nor may it make jobs of other types through a trigger or a retry, whose type the
    # request does not name
    with admin_client(authed) as admin:
        admin.schedules.put("sleepy", "SLEEP", {"durationMillis": 1}, cron="0 3 * * *")
        sleeper = admin.submit("SLEEP", {"durationMillis": 1})
        admin.cancel(sleeper)
        for request in ({"type": "SCHEDULE_TRIGGER", "name": "sleepy"}, {"type": "RETRY_JOB", "jobId": sleeper}):
            reply = etl.request(request)
            assert reply["type"] == "ERROR" and reply["message"].startswith("forbidden: "), (request, reply)
            assert "'SLEEP'" in reply["message"], reply
        assert admin.schedules.get("sleepy")["firedCount"] == 0
        admin.schedules.delete("sleepy")
    assert etl.request({"type": "CANCEL_JOB", "jobId": triggered["jobId"]})["type"] == "JOB_CANCEL"
    retried = etl.request({"type": "RETRY_JOB", "jobId": triggered["jobId"]})
    assert retried["type"] == "JOB_SUBMITTED", retried
    etl.request({"type": "CANCEL_JOB", "jobId": retried["jobId"]})


# ---- the metrics port -----------------------------------------------------------------------

def http_get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def basic(user: str, token: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(("%s:%s" % (user, token)).encode()).decode()}


@pytest.mark.parametrize("path", ["/metrics", "/", "/api/summary", "/api/jobs", "/api/workers",
                                  "/api/workflows/nope", "/nope"])
def test_the_metrics_port_asks_for_a_token_but_for_health(authed, path):
    url = authed.metrics_url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, basic("x", "wrong"), basic(authed.tokens["reader"], ""),
                    {"Authorization": "Bearer " + authed.tokens["worker"]}, {"Authorization": "Token x"}):
        status, got, _body = http_get(url, headers)
        assert status == 401, (headers, status)
        assert got["WWW-Authenticate"] == 'Basic realm="jobmesh"'
    for role in ("reader", "client", "admin"):
        for headers in ({"Authorization": "Bearer " + authed.tokens[role]}, basic("anyone", authed.tokens[role]),
                        basic("", authed.tokens[role])):
            status, _got, _body = http_get(url, headers)
            assert status == (404 if path.endswith("/nope") else 200), (role, headers, status)
    for open_path in ("/healthz", "/readyz"):
        assert http_get(authed.metrics_url + open_path)[0] == 200


def test_failed_attempts_are_counted(authed, opened):
    def failures() -> float:
        body = http_get(authed.metrics_url + "/metrics", {"Authorization": "Bearer " + authed.tokens["reader"]})[2]
        for line in body.decode().splitlines():
            if line.startswith("jobmesh_auth_failures_total "):
                return float(line.split()[1])
        raise AssertionError("no jobmesh_auth_failures_total")

    before = failures()
    conn = RawConn(authed.client_addr)
    opened.append(conn)
    conn.send({"type": "AUTH", "token": "guess"})
    assert read_until_closed(conn, timeout=15)[1]
    assert http_get(authed.metrics_url + "/metrics", {"Authorization": "Bearer guess"})[0] == 401
    assert failures() == before + 2


def auth_answer_seconds(addr, token: str, source: str) -> tuple[float, str]:
    """How long an AUTH from ``source`` waits for its answer, and the answer's type."""
    conn = RawConn(addr, timeout=30, source=source)
    try:
        started = time.monotonic()
        reply = conn.request({"type": "AUTH", "token": token})
        return time.monotonic() - started, reply["type"]
    finally:
        conn.close()


def test_guesses_that_close_early_are_slowed_and_a_success_clears_only_its_own_token(authed):
    from jobmesh.coordinator.ports import guard

    def failures() -> float:
        body = http_get(authed.metrics_url + "/metrics", {"Authorization": "Bearer " + authed.tokens["reader"]})[2]
        return float(re.search(r"^jobmesh_auth_failures_total (\S+)$", body.decode(), re.M).group(1))

    # Given an address whose first AUTH, with a good token, is answered at once
    source = stranger()
    first, answer = auth_answer_seconds(authed.client_addr, authed.tokens["reader"], source)
    assert answer == "AUTH_OK"
    # When a guesser there sends more than the free wrong guesses, each closing without
    # waiting for the answer
    before = failures()
    for n in range(guard.FREE_FAILURES + 2):
        conn = RawConn(authed.client_addr, source=source)
        conn.send({"type": "AUTH", "token": "guess-%d" % n})
        conn.close()
    wait_until(lambda: failures() >= before + guard.FREE_FAILURES + 2, message="the guesses counted")
    # Then even a good token's AUTH_OK from there waits (an answer coming quickly says nothing)
    slowed, answer = auth_answer_seconds(authed.client_addr, authed.tokens["reader"], source)
    assert answer == "AUTH_OK" and slowed >= first + guard.FIRST_DELAY
    # and that success cleared nothing: the next wrong guess is still slowed
    slowed, answer = auth_answer_seconds(authed.client_addr, "guess-again", source)
    assert answer == "ERROR" and slowed >= first + guard.FIRST_DELAY
    # while other addresses are not slowed
    assert auth_answer_seconds(authed.client_addr, authed.tokens["reader"], stranger())[1] == "AUTH_OK"



def test_guesses_held_back_on_the_metrics_port_take_no_health_check_slot(authed):
    import socket

    from jobmesh.coordinator.ports import guard, http

    # Given an address that has used up its free wrong guesses on the metrics port
    source = stranger()
    wrong = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n\r\n"
    for _ in range(guard.FREE_FAILURES):
        assert http_get_from(authed.metrics_addr, source, wrong).startswith(b"HTTP/1.1 401")
    # When it opens more connections than the port serves, each with a guess it never waits for
    guesses = []
    try:
        for _ in range(http.MAX_CONNECTIONS + 8):
            sock = socket.create_connection(authed.metrics_addr, source_address=(source, 0))
            guesses.append(sock)
            sock.sendall(wrong)
        wait_until(lambda: authed.open_fds() > http.MAX_CONNECTIONS, message="the guesses held back")
        # Then health checks and scrapes from elsewhere are still answered
        assert http_get(authed.metrics_url + "/healthz")[0] == 200
        assert http_get(authed.metrics_url + "/metrics", {"Authorization": "Bearer " + authed.tokens["reader"]})[0] == 200
    finally:
        for sock in guesses:
            sock.close()


def http_get_from(addr, source: str, request: bytes) -> bytes:
    """The head of the response to raw ``request`` sent from local address ``source``."""
    import socket

    with socket.create_connection(addr, timeout=30, source_address=(source, 0)) as sock:
        sock.sendall(request)
        return sock.recv(4096)

# ---- SIGHUP, removed tokens ----------------------------------------------------------------

def test_sighup_closes_the_connections_of_a_removed_token(tmp_path, opened):
    # Given a coordinator whose clients and workers are connected with their tokens
    tokens = Tokens(tmp_path / "auth.toml")
    for name, role in (("ci", "client"), ("ops", "admin"), ("w1", "worker"), ("w2", "worker")):
        tokens.new(name, role)
    coord = CoordinatorProc(tmp_path, auth_file=tokens.path).start()
    try:
        ci = connect(coord.client_addr, tokens["ci"], opened)
        ops = connect(coord.client_addr, tokens["ops"], opened)
        w1 = ScriptedWorker(coord.worker_addr, "w1")
        w2 = ScriptedWorker(coord.worker_addr, "w2")
        opened.extend([w1, w2])
        for w, name in ((w1, "w1"), (w2, "w2")):
            assert w.conn.request({"type": "AUTH", "token": tokens[name]})["type"] == "AUTH_OK"
            w.register()
        # When "ci" and "w1" are removed and the coordinator gets SIGHUP
        auth.remove_token(tokens.path, "ci")
        auth.remove_token(tokens.path, "w1")
        coord.proc.send_signal(signal.SIGHUP)
        # Then their connections close, the others keep working, and the tokens no longer open any
        assert ci.is_closed(timeout=15)
        wait_until(w1.closed.is_set, timeout=15, message="w1's connection closed")
        assert ops.request({"type": "GET_STATS"})["type"] == "STATS"
        with CoordinatorClient(*coord.client_addr, token=tokens["ops"]) as admin:
            wait_until(lambda: [w["workerId"] for w in admin.workers()] == ["w2"], timeout=15,
                       message="only w2 left")
        again = RawConn(coord.client_addr)
        opened.append(again)
        again.send({"type": "AUTH", "token": tokens["ci"]})
        assert read_until_closed(again, timeout=15) == ([{"type": "ERROR", "message": "authentication failed"}],
                                                         True)
        # A token added meanwhile opens connections after the next SIGHUP
        tokens.new("late", "reader")
        coord.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "tokens=3" in coord.stderr(), timeout=15, message="the second reload")
        connect(coord.client_addr, tokens["late"], opened)
        # A file broken by hand keeps the tokens in force
        with open(tokens.path, "a") as f:
            f.write("[[token]]\nname = 'x'\n")
        coord.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "kept the tokens in force" in coord.stderr(), timeout=15, message="the refused reload")
        assert ops.request({"type": "GET_STATS"})["type"] == "STATS"
        connect(coord.client_addr, tokens["late"], opened)
        assert coord.proc.poll() is None
    finally:
        coord.cleanup()


# ---- real workers, the CLI, safe defaults ---------------------------------------------------

def test_a_real_worker_with_a_token_runs_jobs(tmp_path, worker_procs):
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("w", "worker")
    tokens.new("ci", "client")
    (tmp_path / "w.token").write_text(tokens["w"])
    (tmp_path / "bad.token").write_text("not-the-token")
    os.chmod(tokens.path, 0o644)  # as an editor or a copy may leave it
    os.chmod(tmp_path / "w.token", 0o640)
    os.chmod(tmp_path / "bad.token", 0o600)
    coord = CoordinatorProc(tmp_path, auth_file=tokens.path).start()
    try:
        real = worker_procs.start(SimpleNamespace(worker_target="%s,%s" % (closed_address(), coord.worker_target)),
                                  "w-real", extra=("--token-file=%s" % (tmp_path / "w.token"),))
        wrong = worker_procs.start(coord, "w-wrong", extra=("--token-file=%s" % (tmp_path / "bad.token"),))
        with CoordinatorClient(*coord.client_addr, token=tokens["ci"]) as client:
            job_id = client.submit("SHA256", {"text": "hello"})
            job = client.wait(job_id, timeout=30)
            assert job["state"] == "COMPLETED" and job["submittedBy"] == "ci"
            wait_until(lambda: "authentication failed" in wrong.log(), timeout=15, message="the refused worker")
            assert [w["workerId"] for w in client.workers()] == ["w-real"]
            # Rotation without a restart: a new token in the auth file and the worker's token
            # file, SIGHUP to the worker, the old token removed and SIGHUP to the coordinator
            # (the files others may read were named at start)
            assert "the auth file %s is readable by other users (mode 0644)" % tokens.path in coord.stderr()
            assert "the token file %s is readable by other users (mode 0640)" % (tmp_path / "w.token") in real.log()
            assert "readable by other users" not in wrong.log()
            tokens.new("w2", "worker")
            (tmp_path / "w.token").write_text(tokens["w2"])
            real.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "a new token, presented from the next connection on" in real.log(), timeout=15,
                       message="the worker read its token file again")
            auth.remove_token(tokens.path, "w")
            coord.proc.send_signal(signal.SIGHUP)
            # the worker reconnects with the new token and keeps working
            wait_until(lambda: "token=w2 role=worker" in real.log(), timeout=15, message="authenticated with w2")
            job_id = client.submit("SHA256", {"text": "rotated"})
            assert client.wait(job_id, timeout=30)["state"] == "COMPLETED"
        assert tokens["w"] not in wrong.log() + coord.stderr()
    finally:
        coord.cleanup()


def test_token_cli(tmp_path):
    path = str(tmp_path / "team.toml")
    made = run_cli("token", "new", "ci", "--role=client", "--task-types=GREET,etl.*", "--auth-file=%s" % path)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert len(token) >= 40 and "\n" not in token and token not in made.stderr
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert token not in open(path).read()
    assert auth.AuthFile.load(path).authenticate(token).name == "ci"
    assert run_cli("token", "new", "w1", "--role=worker", "--auth-file=%s" % path).returncode == 0
    # a token written with a plain > into a file others may read is called out; under umask 077 it is not
    for umask, warned in ((0o022, True), (0o077, False)):
        target = tmp_path / ("w-%o.token" % umask)
        shell = "umask %03o; %s -m jobmesh token new w-%o --role=worker --auth-file=%s > %s" % (
            umask, sys.executable, umask, tmp_path / "umask.toml", target)
        done = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=20)
        assert done.returncode == 0, done.stderr
        assert ("the token went into a file other users may read (mode 0644)" in done.stderr) is warned
        assert auth.AuthFile.load(str(tmp_path / "umask.toml")).authenticate(target.read_text().strip()).name \
            == "w-%o" % umask
    listed = run_cli("token", "list", "--auth-file=%s" % path)
    assert listed.returncode == 0 and "ci" in listed.stdout and "GREET, etl.*" in listed.stdout
    assert token not in listed.stdout
    as_json = run_cli("token", "list", "--json", "--auth-file=%s" % path)
    assert as_json.stdout.strip() == ('[{"name": "ci", "role": "client", "taskTypes": ["GREET", "etl.*"]}, '
                                      '{"name": "w1", "role": "worker", "taskTypes": null}]')
    duplicate = run_cli("token", "new", "ci", "--role=admin", "--auth-file=%s" % path)
    assert duplicate.returncode == 2 and "exists already" in duplicate.stderr and not duplicate.stdout
    bad_role = run_cli("token", "new", "x", "--role=root", "--auth-file=%s" % path)
    assert bad_role.returncode == 2 and "role must be one of" in bad_role.stderr
    assert len(bad_role.stderr.strip().splitlines()) == 1
    assert run_cli("token", "rm", "ci", "--auth-file=%s" % path).returncode == 0
    assert auth.AuthFile.load(path).names() == ["w1"]
    gone = run_cli("token", "rm", "ci", "--auth-file=%s" % path)
    assert gone.returncode == 2 and "no token named 'ci'" in gone.stderr
    # the default file, in the current directory
    default = run_cli_in(tmp_path, "token", "new", "ops", "--role=admin")
    assert default.returncode == 0 and (tmp_path / "jobmesh-auth.toml").exists()
    # JOBMESH_AUTH_FILE names the coordinator's file: `token` edits that one, unless given --auth-file
    shared = tmp_path / "shared.toml"
    from_env = run_cli("token", "new", "svc", "--role=reader", cwd=tmp_path, env={"JOBMESH_AUTH_FILE": str(shared)})
    assert from_env.returncode == 0, from_env.stderr
    assert auth.AuthFile.load(str(shared)).names() == ["svc"]
    assert "svc" not in auth.AuthFile.load(str(tmp_path / "jobmesh-auth.toml")).names()
    flag_wins = run_cli("token", "list", "--auth-file=%s" % path, env={"JOBMESH_AUTH_FILE": str(shared)})
    assert "w1" in flag_wins.stdout and "svc" not in flag_wins.stdout


def run_cli_in(cwd, *args):
    import subprocess
    import sys

    from tests.support.processes import child_env

    return subprocess.run([sys.executable, "-m", "jobmesh", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=20, env=child_env())


def test_a_reachable_bind_needs_tokens_or_insecure(tmp_path):
    refused = run_cli("coordinator", "--bind=0.0.0.0", "--worker-port=0", "--client-port=0",
                      "--db=%s" % (tmp_path / "x.db"))
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "--auth-file" in refused.stderr
    assert "--insecure" in refused.stderr
    bad_file = run_cli("coordinator", "--worker-port=0", "--client-port=0", "--db=%s" % (tmp_path / "x.db"),
                       "--auth-file=%s" % (tmp_path / "missing.toml"))
    assert bad_file.returncode == 2 and "missing.toml" in bad_file.stderr
    assert len(bad_file.stderr.strip().splitlines()) == 1


def test_tokens_on_a_reachable_address_without_tls_warn(tmp_path):
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("ops", "admin")
    coord = CoordinatorProc(tmp_path, bind="0.0.0.0", auth_file=tokens.path).start()
    try:
        assert "tokens travel in plaintext" in coord.stderr()
    finally:
        coord.cleanup()


def test_tokens_on_a_reachable_periodic_port_without_a_periodic_key_warn_under_tls(tmp_path):
    # TLS covers the JSON and metrics ports, not the Periodic port's registration tokens
    from tests.tls_support import make_certs

    certs = make_certs(tmp_path / "certs")
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("ops", "admin")
    coord = CoordinatorProc(tmp_path, bind="0.0.0.0", auth_file=tokens.path, tls_cert=certs.server,
                            tls_key=certs.server_key, periodic_port=0).start()
    try:
        assert "Periodic tokens travel in plaintext" in coord.stderr()
    finally:
        coord.cleanup()


# ---- the dashboard in a browser, through Basic ------------------------------------------------

browser = dashboard_browser.browser  # the headless Chromium fixture


def test_the_dashboard_works_through_basic_auth(browser, authed, opened):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    # Given a queued job and a live worker
    with CoordinatorClient(*authed.client_addr, token=authed.tokens["client"]) as client:
        queued = client.submit("SHA256", {"text": "through basic"}, priority="LOW")
    host, port = authed.metrics_addr
    wait = WebDriverWait(browser, 20)
    # With the token as the Basic password (any user name), the page and every fetch it makes work
    browser.get("http://viewer:%s@%s:%d/" % (authed.tokens["reader"], host, port))
    wait.until(lambda d: d.find_element(By.ID, "ready").text == "ready")
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#jobs tr[data-job='%s']" % queued)))
    browser.find_element(By.CSS_SELECTOR, "#jobs tr[data-job='%s'] a" % queued).click()
    wait.until(lambda d: d.find_element(By.ID, "jv-id").text == queued)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#timeline li[data-event='SUBMITTED']")))


# ---- jobmesh up --------------------------------------------------------------------------------

def test_up_gives_its_workers_the_worker_token(tmp_path, start_up):
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("local-workers", "worker")
    tokens.new("ci", "client")
    (tmp_path / "worker.token").write_text(tokens["local-workers"] + "\n")
    up = start_up("--auth-file=%s" % tokens.path, "--token-file=%s" % (tmp_path / "worker.token"), "--workers=2")
    with CoordinatorClient(*up.client_addr, token=tokens["ci"]) as client:
        wait_until(lambda: len(client.workers()) == 2, timeout=20, message="up's two workers registered")
        job = client.wait(client.submit("WORD_COUNT", {"text": "a b"}), timeout=30)
        assert job["state"] == "COMPLETED" and job["submittedBy"] == "ci"
    assert tokens["local-workers"] not in up.log()


def test_up_without_tokens_gives_its_workers_none_from_its_environment(tmp_path, start_up, monkeypatch):
    # Given a shell that holds a token for some other coordinator, and up without --auth-file
    monkeypatch.setenv("JOBMESH_TOKEN", "a-token-for-another-coordinator")
    up = start_up("--workers=2")
    # Then its workers present no token to a coordinator that takes none, and register
    with CoordinatorClient(*up.client_addr) as client:
        wait_until(lambda: len(client.workers()) == 2, timeout=20, message="up's two workers registered")
        assert client.wait(client.submit("WORD_COUNT", {"text": "a b"}), timeout=30)["state"] == "COMPLETED"


def test_up_makes_a_token_for_its_workers_when_given_none(tmp_path, start_up):
    # Given an auth file with no worker token at all
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("ci", "client")
    before = open(tokens.path).read()
    up = start_up("--auth-file=%s" % tokens.path, "--workers=1")
    # Then up's own worker registers and runs jobs, and the user's file is unchanged
    with CoordinatorClient(*up.client_addr, token=tokens["ci"]) as client:
        wait_until(lambda: len(client.workers()) == 1, timeout=20, message="up's worker registered")
        assert client.wait(client.submit("SHA256", {"text": "x"}), timeout=30)["state"] == "COMPLETED"
        # a token added to the user's file works after SIGHUP to up, and up's workers stay
        tokens.new("late", "reader")
        up.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded auth file" in up.log() and "tokens=3" in up.log(), timeout=20,
                   message="the coordinator re-read the copy")
        with CoordinatorClient(*up.client_addr, token=tokens["late"]) as late:
            assert [w["workerId"] for w in late.workers()] == ["local-1"]
    assert open(tokens.path).read() != before and "up-workers" not in open(tokens.path).read()


@pytest.mark.parametrize("token,says", [("wrong", "is not in"), ("client", "has role client")])
def test_up_refuses_a_given_token_that_is_not_a_worker_token_of_the_file(tmp_path, token, says):
    tokens = Tokens(tmp_path / "auth.toml")
    tokens.new("client", "client")
    (tmp_path / "t").write_text(tokens.by_name.get(token, token))
    out = run_cli("up", "--auth-file=%s" % tokens.path, "--worker-port=0", "--client-port=0",
                  "--db=%s" % (tmp_path / "up.db"), "--token-file=%s" % (tmp_path / "t"))
    assert out.returncode == 2 and says in out.stderr and "jobmesh token new" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
