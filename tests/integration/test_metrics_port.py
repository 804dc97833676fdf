"""The metrics port of a real coordinator process (--metrics-port=0): /metrics, health, JSON.

The checks that count nothing share one coordinator (``shared_coord``); those that read
counts, or stop the coordinator, start their own.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import wait_until

CONTRACT_NAMES = (
    "jobmesh_jobs", "jobmesh_jobs_submitted_total", "jobmesh_jobs_finished_total", "jobmesh_submits_rejected_total",
    "jobmesh_retries_total", "jobmesh_deadline_expiries_total", "jobmesh_workers_lost_total",
    "jobmesh_stale_results_total", "jobmesh_workers", "jobmesh_connections", "jobmesh_commit_seconds_bucket",
    "jobmesh_commit_seconds_count", "jobmesh_commit_seconds_sum",
)


def get(url: str, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET; HTTP error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get_json(url: str) -> tuple[int, dict]:
    status, headers, body = get(url)
    assert headers["Content-Type"].startswith("application/json"), headers
    return status, json.loads(body)


def scrape(coord) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    status, _headers, body = get(coord.metrics_url + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def coord(coordinator_factory):
    return coordinator_factory(metrics_port=0)


@pytest.fixture(scope="module")
def shared_coord(module_coordinators):
    return module_coordinators(metrics_port=0)


def test_the_listening_line_ends_with_the_metrics_port(shared_coord):
    coord = shared_coord
    line = coord.stdout().strip().splitlines()[0]
    assert line.startswith("jobmesh coordinator listening worker=")
    assert line.endswith(" metrics=127.0.0.1:%d" % coord.metrics_addr[1])
    assert coord.metrics_addr[1] not in (0, coord.worker_addr[1], coord.client_addr[1])


def test_no_metrics_port_unless_asked(coordinator):
    assert "metrics=" not in coordinator.stdout()


def test_every_contract_metric_is_present_on_a_fresh_coordinator(coord):
    samples = scrape(coord)
    names = {name for name, _labels in samples}
    missing = [name for name in CONTRACT_NAMES if name not in names]
    assert missing == []
    for state in ("QUEUED", "SCHEDULED", "RUNNING", "RETRY_WAIT"):
        assert value(samples, "jobmesh_jobs", state=state) == 0
    for state in ("COMPLETED", "FAILED", "CANCELLED"):
        assert value(samples, "jobmesh_jobs_finished_total", state=state) == 0
    for port in ("worker", "client", "metrics"):
        assert ("jobmesh_connections", (("port", port),)) in samples
    assert value(samples, "jobmesh_connections", port="metrics") >= 1  # this scrape's own connection
    assert value(samples, "jobmesh_workers") == 0


def test_counters_move_with_submits_completions_failures_cancels_and_rejections(coordinator_factory, peers):
    coord = coordinator_factory(metrics_port=0, max_active_jobs=3)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-1", capacity=1)
    # Given one job that completes, one that fails twice (one retry), one cancelled while running
    done = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.complete(worker.await_assign())
    client.wait_state(done, "COMPLETED")
    failing = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=2)
    worker.fail(worker.await_assign())
    worker.fail(worker.await_assign())
    client.wait_state(failing, "FAILED")
    cancelled = client.submit_ok("SLEEP", {"durationMillis": 1})
    assign = worker.await_assign()
    assert client.cancel(cancelled)["cancelled"] is True
    worker.await_cancel()
    # and a stale result for the cancelled lease, then three active jobs and one rejected submit
    worker.complete(assign)
    for _ in range(3):
        client.submit_ok("SLEEP", {"durationMillis": 1})
    assert client.submit("SLEEP", {"durationMillis": 1})["type"] == "SUBMIT_REJECTED"
    worker.await_assign()

    def settled():
        s = scrape(coord)
        return s if value(s, "jobmesh_jobs", state="RUNNING") == 1 and value(s, "jobmesh_stale_results_total") else None

    s = wait_until(settled, message="one running job and the stale result counted")
    assert value(s, "jobmesh_jobs_submitted_total") == 6
    assert value(s, "jobmesh_jobs_finished_total", state="COMPLETED") == 1
    assert value(s, "jobmesh_jobs_finished_total", state="FAILED") == 1
    assert value(s, "jobmesh_jobs_finished_total", state="CANCELLED") == 1
    assert value(s, "jobmesh_retries_total") == 1
    assert value(s, "jobmesh_submits_rejected_total") == 1
    assert value(s, "jobmesh_stale_results_total") == 1
    assert value(s, "jobmesh_jobs", state="QUEUED") == 2
    assert value(s, "jobmesh_jobs_by_type", state="QUEUED", task_type="SLEEP", protocol="json") == 2
    assert value(s, "jobmesh_queue_depth", priority="NORMAL") == 2
    assert value(s, "jobmesh_workers") == 1
    assert value(s, "jobmesh_worker_slots") == 1
    assert value(s, "jobmesh_worker_slots_busy") == 1
    assert value(s, "jobmesh_connections", port="worker") == 1
    assert value(s, "jobmesh_connections", port="client") == 1
    assert value(s, "jobmesh_commit_seconds_count") >= 6
    assert value(s, "jobmesh_commit_seconds_bucket", le="+Inf") == value(s, "jobmesh_commit_seconds_count")
    assert value(s, "jobmesh_workers_lost_total") == 0
    # When the worker goes away
    worker.close()
    s = wait_until(lambda: (lambda s: s if value(s, "jobmesh_workers") == 0 else None)(scrape(coord)),
                   message="the worker gone from the gauge")
    assert value(s, "jobmesh_workers_lost_total") == 1
    assert value(s, "jobmesh_connections", port="worker") == 0


def test_deadline_expiries_are_counted(coordinator_factory, peers):
    coord = coordinator_factory(metrics_port=0, task_timeout_millis=150)
    client = peers.client(coord)
    worker = peers.worker(coord, "w-1", capacity=1)
    client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    worker.await_assign()
    worker.await_cancel()  # the deadline passed: the lease is revoked
    s = wait_until(lambda: (lambda s: s if value(s, "jobmesh_deadline_expiries_total") else None)(scrape(coord)),
                   message="the expiry counted")
    assert value(s, "jobmesh_deadline_expiries_total") == 1
    assert value(s, "jobmesh_jobs_finished_total", state="FAILED") == 1


def test_healthz_and_readyz_then_the_port_closes_on_sigterm(coord):
    assert get(coord.metrics_url + "/healthz")[0] == 200
    status, _headers, body = get(coord.metrics_url + "/readyz")
    assert (status, body) == (200, b"ready\n")
    coord.proc.send_signal(15)
    # While it stops /readyz says 503 (if it is quick enough to be seen); it never says ready again.
    deadline = time.monotonic() + 10
    seen = []
    while time.monotonic() < deadline:
        try:
            seen.append(get(coord.metrics_url + "/readyz", timeout=1)[0])
        except (urllib.error.URLError, ConnectionError, OSError):
            break
        if seen[-1] == 503:
            assert 200 not in seen[seen.index(503):]
    assert coord.proc.wait(10) == 0


def test_json_endpoints_read_through_the_core(coord, peers):
    client = peers.client(coord)
    worker = peers.worker(coord, "w-1", capacity=1, task_types=["SLEEP", "GREET"])
    first = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.complete(worker.await_assign(), {"sleptMillis": 1})
    client.wait_state(first, "COMPLETED")
    running = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.await_assign()
    waiting = client.submit_ok("SLEEP", {"durationMillis": 1})
    greeting = client.submit_ok("GREET", {"name": "x"})
    client.wait_state(running, "RUNNING")
    base = coord.metrics_url

    status, summary = get_json(base + "/api/summary")
    assert status == 200 and summary["ready"] is True
    assert summary["jobs"] == {"QUEUED": 2, "SCHEDULED": 0, "RUNNING": 1, "RETRY_WAIT": 0, "WAITING": 0}
    assert summary["finished"]["COMPLETED"] == 1 and summary["submitted"] == 4
    assert (summary["workers"], summary["capacity"], summary["busySlots"]) == (1, 1, 1)
    assert {"state": "QUEUED", "taskType": "GREET", "protocol": "json", "count": 1} in summary["byType"]

    status, workers = get_json(base + "/api/workers")
    assert status == 200
    assert [(w["workerId"], w["capacity"], w["activeJobs"], sorted(w["taskTypes"])) for w in workers["workers"]] == [
        ("w-1", 1, 1, ["GREET", "SLEEP"])]
    assert isinstance(workers["workers"][0]["lastHeartbeatMillis"], int)

    status, page = get_json(base + "/api/jobs?limit=2")
    assert status == 200
    assert [j["jobId"] for j in page["jobs"]] == [greeting, waiting]
    assert page["nextCursor"]
    _status, older = get_json(base + "/api/jobs?limit=2&cursor=" + page["nextCursor"])
    assert [j["jobId"] for j in older["jobs"]] == [running, first]
    _status, queued = get_json(base + "/api/jobs?state=QUEUED&type=SLEEP")
    assert [j["jobId"] for j in queued["jobs"]] == [waiting]
    assert get_json(base + "/api/jobs?state=NOPE")[0] == 400

    status, one = get_json(base + "/api/jobs/" + waiting)
    assert status == 200 and one["job"]["state"] == "QUEUED"
    assert one["job"]["waitingReason"] == "WORKERS_BUSY"
    # the payload beside the snapshot (which has none: its fields are the protocol's)
    assert one["payload"] == {"durationMillis": 1} and "payload" not in one["job"]
    status, greet = get_json(base + "/api/jobs/" + greeting)
    assert status == 200 and greet["payload"] == {"name": "x"}
    status, timeline = get_json(base + "/api/jobs/" + first + "/events")
    assert status == 200
    assert [e["event"] for e in timeline["events"]] == ["SUBMITTED", "ASSIGNED", "COMPLETED"]
    assert timeline["events"][1]["workerId"] == "w-1" and timeline["events"][1]["attempt"] == 1
    assert get_json(base + "/api/jobs/no-such-job")[0] == 404
    assert get_json(base + "/api/jobs/no-such-job/events")[0] == 404

    def sampled():
        series = get_json(base + "/api/series")[1]
        return series if len(series["t"]) >= 1 else None

    series = wait_until(sampled, timeout=5, message="a chart sample")
    assert series["running"][-1] == 1 and series["queued"][-1] == 2


def test_jobs_held_by_a_limit_are_in_the_gauge_and_the_limits_endpoint(shared_coord, peers):
    # Given a type of this test's own, paused with a limit of one running per key
    client = peers.client(shared_coord)
    worker = peers.worker(shared_coord, "w-held", capacity=3, task_types=["HELD_G"])
    put = client.request({"type": "LIMIT_PUT", "limit": {"taskType": "HELD_G", "maxRunningPerKey": 1, "paused": True}})
    assert put["type"] == "LIMIT", put

    def held() -> dict[str, float]:
        return {labels[0][1]: n for (name, labels), n in scrape(shared_coord).items()
                if name == "jobmesh_jobs_held" and ("taskType", "HELD_G") in labels and n}

    # When three jobs are submitted, two of them with the same concurrency key
    for key in ("k", "k", "other"):
        client.submit_ok("HELD_G", {}, concurrencyKey=key)
    # Then the gauge counts the three as held by the pause, and /api/limits shows the pause
    assert held() == {"TYPE_PAUSED": 3}
    [row] = [lim for lim in get_json(shared_coord.metrics_url + "/api/limits")[1]["limits"]
             if lim["taskType"] == "HELD_G"]
    assert (row["paused"], row["maxRunningPerKey"], row["queued"]) == (True, 1, 3)
    # And once resumed, two start and the second job of key k is held by the limit per key
    assert client.request({"type": "TYPE_RESUME", "taskType": "HELD_G"})["limit"]["paused"] is False
    worker.await_assign()
    worker.await_assign()
    wait_until(lambda: held() == {"KEY_CONCURRENCY_LIMIT": 1}, message="one HELD_G job held by its key's limit")
    assert client.request({"type": "LIMIT_DELETE", "taskType": "HELD_G"})["type"] == "LIMIT"


def test_the_dashboard_page_is_served(shared_coord):
    status, headers, body = get(shared_coord.metrics_url + "/")
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert b"<title>jobmesh</title>" in body


def test_every_state_is_in_the_metrics_the_summary_get_stats_and_top(coord):
    # Given a fresh coordinator: no job in any state
    from jobmesh.client import top
    from jobmesh.client.api import CoordinatorClient
    from jobmesh.protocol.jobs import TERMINAL, JobState

    states = [s.value for s in JobState]
    # Then /metrics has a series for every state (a gauge of the active ones, a counter of the ended ones)
    samples = scrape(coord)
    for state in JobState:
        name = "jobmesh_jobs_finished_total" if state in TERMINAL else "jobmesh_jobs"
        assert value(samples, name, state=state.value) == 0
    # and the dashboard's summary lists them all, which is where the page takes them from
    _status, summary = get_json(coord.metrics_url + "/api/summary")
    assert summary["states"]["active"] + summary["states"]["terminal"] == states
    assert list(summary["jobs"]) + list(summary["finished"]) == states
    # and GET_STATS counts every one of them, and top shows every one
    client = CoordinatorClient(*coord.client_addr)
    try:
        stats = client.stats()
        assert list(stats.jobs) + list(stats.finished) == states
        text = top.frame(top.take_sample(client), None, "here", 1000)
    finally:
        client.close()
    for state in states:
        assert " %s 0" % state.lower() in text, text


def test_half_sent_requests_cost_no_scrape_and_no_health_check(shared_coord):
    import socket

    from jobmesh.coordinator.ports.http import MAX_CONNECTIONS

    coord = shared_coord
    host, port = coord.metrics_addr
    base = "http://%s:%d" % (host, port)
    fds = coord.open_fds()
    stalled = []
    for _ in range(MAX_CONNECTIONS + 40):  # more than the port keeps open, each stuck in its headers
        s = socket.create_connection((host, port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        stalled.append(s)
    # A scrape is answered (Prometheus does not lose its samples while requests stall)
    assert get(base + "/metrics", timeout=30)[0] == 200
    # and so are the health checks (a load balancer must not restart a healthy coordinator)
    assert get(base + "/healthz", timeout=30)[0] == 200
    assert get(base + "/readyz", timeout=30)[0] == 200
    # and the stalled connections are closed by the coordinator, not kept forever: answered
    # 400/408 (the request never came), or closed unanswered to make room for newer ones
    statuses = set()
    for s in stalled:
        s.settimeout(30)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        statuses.add(data.split(b" ", 2)[1] if data else b"closed")
        s.close()
    assert statuses <= {b"400", b"408", b"closed"} and b"closed" in statuses
    wait_until(lambda: coord.open_fds() <= fds, timeout=30, message="the stalled connections' descriptors closed")
    assert get(base + "/metrics")[0] == 200  # and the port serves as before


def test_a_workflow_and_its_jobs_counts_and_gauge_through_the_api(shared_coord, peers):
    # Given a diamond of a type of this test's own: a, then b and c, then d after both
    client = peers.client(shared_coord)
    base = shared_coord.metrics_url
    worker = peers.worker(shared_coord, "w-flow", capacity=2, task_types=["FLOW_API"])
    jobs = [{"ref": "a", "taskType": "FLOW_API", "payload": {}, "maxAttempts": 1},
            {"ref": "b", "taskType": "FLOW_API", "payload": {}, "dependsOn": ["a"]},
            {"ref": "c", "taskType": "FLOW_API", "payload": {}, "dependsOn": ["a"], "maxAttempts": 1},
            {"ref": "d", "taskType": "FLOW_API", "payload": {}, "dependsOn": ["b", "c"]}]
    submitted = client.request({"type": "SUBMIT_WORKFLOW", "name": "diamond", "jobs": jobs})
    workflow_id, ids = submitted["workflowId"], submitted["jobIds"]
    first = worker.await_assign()
    assert first["jobId"] == ids["a"]
    # Then the API has it, its jobs' states with their dependencies, three of them WAITING
    status, wf = get_json(base + "/api/workflows/" + workflow_id)
    assert status == 200
    assert (wf["workflowId"], wf["name"], wf["state"], wf["jobCount"]) == (workflow_id, "diamond", "RUNNING", 4)
    assert [(j["ref"], j["jobId"], j["state"], j["dependsOn"]) for j in wf["jobs"]] == [
        ("a", ids["a"], "RUNNING", []), ("b", ids["b"], "WAITING", ["a"]), ("c", ids["c"], "WAITING", ["a"]),
        ("d", ids["d"], "WAITING", ["b", "c"])]
    assert {s: n for s, n in wf["counts"].items() if n} == {"RUNNING": 1, "WAITING": 3}
    assert list(wf["counts"]) == get_json(base + "/api/summary")[1]["states"]["active"] + ["COMPLETED", "FAILED",
                                                                                          "CANCELLED"]
    assert value(scrape(shared_coord), "jobmesh_workflows", state="RUNNING") == 1
    # When a completes, c fails and b completes: d is cancelled and the workflow FAILED
    worker.complete(first)
    assigned = {a["jobId"]: a for a in (worker.await_assign(), worker.await_assign())}
    worker.fail(assigned[ids["c"]])
    worker.complete(assigned[ids["b"]])
    client.wait_state(ids["d"], "CANCELLED")

    def ended():
        s = scrape(shared_coord)
        return s if value(s, "jobmesh_workflows", state="FAILED") == 1 else None

    samples = wait_until(ended, message="the workflow counted as FAILED")
    assert value(samples, "jobmesh_workflows", state="RUNNING") == 0
    assert value(samples, "jobmesh_workflows", state="COMPLETED") == 0
    status, wf = get_json(base + "/api/workflows/" + workflow_id)
    assert wf["state"] == "FAILED"
    assert [j["state"] for j in wf["jobs"]] == ["COMPLETED", "COMPLETED", "FAILED", "CANCELLED"]
    assert {s: n for s, n in wf["counts"].items() if n} == {"COMPLETED": 2, "FAILED": 1, "CANCELLED": 1}
    # and an unknown workflow is a 404 that names it
    status, missing = get_json(base + "/api/workflows/no-such-flow")
    assert status == 404 and "no-such-flow" in missing["error"]


def test_a_big_workflow_is_read_page_by_page_and_its_first_jobs_given(shared_coord, peers):
    from jobmesh.coordinator.ports.http import WORKFLOW_JOBS_SHOWN

    # Given 10,000 jobs whose WORKFLOW reply passes the frame limit (so it comes in pages),
    # of a paused type of this test's own
    client = peers.client(shared_coord)
    peers.worker(shared_coord, "w-big", task_types=["FBIG"])
    assert client.request({"type": "TYPE_PAUSE", "taskType": "FBIG"})["type"] == "LIMIT"
    pad = "p" * 40
    jobs = [{"ref": "%s%05d" % (pad, n), "taskType": "FBIG", "payload": {}} for n in range(10_000)]
    submitted = client.request({"type": "SUBMIT_WORKFLOW", "jobs": jobs})
    assert submitted["type"] == "WORKFLOW_SUBMITTED", submitted
    workflow_id = submitted["workflowId"]
    first_page = client.request({"type": "WORKFLOW_STATUS", "workflowId": workflow_id})
    assert first_page.get("nextCursor"), "the workflow fits one page: the test does not page"
    try:
        # Then the API counts all of them, and gives the first ones in submission order
        status, wf = get_json(shared_coord.metrics_url + "/api/workflows/" + workflow_id)
        assert status == 200 and wf["jobCount"] == 10_000
        assert {s: n for s, n in wf["counts"].items() if n} == {"QUEUED": 10_000}
        assert [j["ref"] for j in wf["jobs"]] == ["%s%05d" % (pad, n) for n in range(WORKFLOW_JOBS_SHOWN)]
    finally:
        assert client.request({"type": "WORKFLOW_CANCEL", "workflowId": workflow_id})["type"] == "WORKFLOW"
        assert client.request({"type": "LIMIT_DELETE", "taskType": "FBIG"})["type"] == "LIMIT"
