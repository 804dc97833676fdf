"""The metrics port without sockets: the collector's output and the WSGI app against a fake core;
the metrics registry (a misspelled counter or metric fails) and the one list of states.

The fake mailbox answers each posted request at once (as the core would after its commit),
so ``HttpPort.ask`` finds its ``AsyncResult`` already set and never waits on the hub.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobmesh.client import top
from jobmesh.coordinator.core import figures as f
from jobmesh.coordinator.core.figures import METRICS, Counters, Figures, Kind, Metric, RuntimeFigures
from jobmesh.coordinator.ports.http import HttpPort, JobmeshCollector, LocalConn, decode_reply
from jobmesh.coordinator.shell.housekeeping import COMMIT_SECONDS_BUCKETS, SIZE_BUCKETS, Histogram
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import encode_frame
from jobmesh.protocol.jobs import TERMINAL, JobState

CONTRACT_SAMPLES = {
    "jobmesh_jobs", "jobmesh_jobs_submitted_total", "jobmesh_jobs_finished_total", "jobmesh_submits_rejected_total",
    "jobmesh_retries_total", "jobmesh_deadline_expiries_total", "jobmesh_workers_lost_total",
    "jobmesh_stale_results_total", "jobmesh_workers", "jobmesh_connections", "jobmesh_commit_seconds_bucket",
    "jobmesh_commit_seconds_sum", "jobmesh_commit_seconds_count",
}


def core_metrics(submitted=20, **overrides):
    figures = dict(
        jobs={("QUEUED", "SLEEP", "HIGH", "json"): 2, ("QUEUED", "SLEEP", "LOW", "json"): 1,
              ("RUNNING", "SHA256", "NORMAL", "json"): 4, ("RETRY_WAIT", "FAIL", "NORMAL", "json"): 0},
        counters=Counters(submitted=submitted, rejected=3, retries=5, deadline_expiries=1, workers_lost=2,
                          stale_results=7),
        finished={"COMPLETED": 10, "FAILED": 2, "CANCELLED": 1}, workers=2, capacity=8, busy_slots=4,
        periodic_workers=3, waits=6,
    )
    figures.update(overrides)
    return Figures(**figures)


class FakeCore:
    def __init__(self):
        self.figures = core_metrics()

    def metrics(self):
        return self.figures


class FakeMailbox:
    """Answers each request at once with ``answer(msg)``, as the core would after committing."""

    def __init__(self, answer):
        self.answer = answer
        self.posted = []

    def __len__(self):
        return 0

    def put(self, event):
        self.posted.append(event.msg)
        event.conn.reply(encode_frame(self.answer(event.msg).to_wire()), 1)


class FakeSource:
    def __init__(self, answer=None):
        self.core = FakeCore()
        self.ready = True
        self.mailbox = FakeMailbox(answer or (lambda msg: m.Error("unexpected %s" % msg.TYPE)))
        self.commit_seconds = Histogram(COMMIT_SECONDS_BUCKETS)
        self.commit_rows = Histogram(SIZE_BUCKETS)
        self.batch_events = Histogram(SIZE_BUCKETS)

    def figures(self):
        return RuntimeFigures(inbox_depth=9, max_active_jobs=100, connections={"worker": 2, "client": 3},
                              commit_seconds=self.commit_seconds, commit_rows=self.commit_rows,
                              batch_events=self.batch_events, storage_available=1)


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def call(port, path, method="GET"):
    """Run the WSGI app; returns (status, headers dict, body bytes)."""
    seen = {}

    def start_response(status, headers):
        seen["status"], seen["headers"] = status, dict(headers)

    path, _, query = path.partition("?")
    body = b"".join(port.app({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}, start_response))
    return seen["status"], seen["headers"], body


@pytest.fixture
def source():
    return FakeSource()


@pytest.fixture
def port(source):
    return HttpPort(source, "127.0.0.1", 0)


# ---- the collector --------------------------------------------------------------------------


def test_every_contract_metric_is_exposed(port):
    status, headers, body = call(port, "/metrics")
    assert status == "200 OK"
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    names = {name for name, _labels in samples(body.decode())}
    assert CONTRACT_SAMPLES <= names
    kinds = {name: f.type for name, f in families(body.decode()).items()}
    assert kinds["jobmesh_jobs"] == "gauge"
    assert kinds["jobmesh_jobs_submitted"] == "counter"
    assert kinds["jobmesh_jobs_finished"] == "counter"
    assert kinds["jobmesh_workers"] == "gauge"
    assert kinds["jobmesh_connections"] == "gauge"
    assert kinds["jobmesh_commit_seconds"] == "histogram"


def test_jobs_by_state_sums_types_and_priorities_and_shows_every_non_terminal_state(port):
    s = samples(call(port, "/metrics")[2].decode())
    assert s[("jobmesh_jobs", (("state", "QUEUED"),))] == 3
    assert s[("jobmesh_jobs", (("state", "RUNNING"),))] == 4
    assert s[("jobmesh_jobs", (("state", "SCHEDULED"),))] == 0
    assert s[("jobmesh_jobs", (("state", "RETRY_WAIT"),))] == 0
    assert s[("jobmesh_jobs_by_type", (("protocol", "json"), ("state", "QUEUED"), ("task_type", "SLEEP")))] == 3
    assert s[("jobmesh_jobs_by_type", (("protocol", "json"), ("state", "RUNNING"), ("task_type", "SHA256")))] == 4
    # a series whose count fell to zero is not exposed per type
    assert ("jobmesh_jobs_by_type", (("protocol", "json"), ("state", "RETRY_WAIT"), ("task_type", "FAIL"))) not in s
    assert s[("jobmesh_queue_depth", (("priority", "HIGH"),))] == 2
    assert s[("jobmesh_queue_depth", (("priority", "NORMAL"),))] == 0


def test_a_periodic_func_and_a_task_type_of_one_name_are_told_apart_by_protocol(source, port):
    source.core.figures = core_metrics(jobs={("QUEUED", "resize", "NORMAL", "json"): 2,
                                             ("QUEUED", "resize", "NORMAL", "periodic"): 5})
    s = samples(call(port, "/metrics")[2].decode())
    assert s[("jobmesh_jobs", (("state", "QUEUED"),))] == 7
    assert s[("jobmesh_jobs_by_type", (("protocol", "json"), ("state", "QUEUED"), ("task_type", "resize")))] == 2
    assert s[("jobmesh_jobs_by_type", (("protocol", "periodic"), ("state", "QUEUED"), ("task_type", "resize")))] == 5


def test_counters_and_gauges_carry_the_cores_figures(port):
    s = samples(call(port, "/metrics")[2].decode())
    assert s[("jobmesh_jobs_submitted_total", ())] == 20
    assert s[("jobmesh_jobs_finished_total", (("state", "COMPLETED"),))] == 10
    assert s[("jobmesh_jobs_finished_total", (("state", "FAILED"),))] == 2
    assert s[("jobmesh_jobs_finished_total", (("state", "CANCELLED"),))] == 1
    assert s[("jobmesh_submits_rejected_total", ())] == 3
    assert s[("jobmesh_retries_total", ())] == 5
    assert s[("jobmesh_deadline_expiries_total", ())] == 1
    assert s[("jobmesh_workers_lost_total", ())] == 2
    assert s[("jobmesh_stale_results_total", ())] == 7
    assert s[("jobmesh_workers", ())] == 2
    assert s[("jobmesh_worker_slots", ())] == 8
    assert s[("jobmesh_worker_slots_busy", ())] == 4
    assert s[("jobmesh_periodic_workers", ())] == 3
    assert s[("jobmesh_waits", ())] == 6
    assert s[("jobmesh_core_inbox_depth", ())] == 9
    assert s[("jobmesh_active_jobs_limit", ())] == 100
    assert s[("jobmesh_connections", (("port", "worker"),))] == 2
    assert s[("jobmesh_connections", (("port", "client"),))] == 3
    assert s[("jobmesh_connections", (("port", "metrics"),))] == 0


def test_histograms_are_cumulative_with_sum_and_count(source, port):
    for value in (0.0004, 0.001, 0.003, 0.003, 7.0):
        source.commit_seconds.observe(value)
    s = samples(call(port, "/metrics")[2].decode())
    bucket = lambda le: s[("jobmesh_commit_seconds_bucket", (("le", le),))]  # noqa: E731
    assert bucket("0.0005") == 1
    assert bucket("0.001") == 2  # a value equal to a bound falls in that bucket (le)
    assert bucket("0.0025") == 2
    assert bucket("0.005") == 4
    assert bucket("2.5") == 4
    assert bucket("+Inf") == 5
    assert s[("jobmesh_commit_seconds_count", ())] == 5
    assert s[("jobmesh_commit_seconds_sum", ())] == pytest.approx(7.0074)
    assert ("jobmesh_commit_batch_rows_bucket", (("le", "1.0"),)) in s
    assert ("jobmesh_core_batch_events_count", ()) in s
    assert ("jobmesh_event_loop_lag_seconds_count", ()) in s


def test_a_collect_reads_figures_once_and_visits_no_job():
    calls = []

    def read():
        calls.append(1)
        return core_metrics(), FakeSource().figures()

    names = [f.name for f in JobmeshCollector(read).collect()]
    assert len(calls) == 1
    assert len(names) == len(set(names))


def test_runtime_histogram_puts_each_value_in_one_bucket():
    h = Histogram((1, 10))
    for v in (0, 1, 2, 10, 11, 1000):
        h.observe(v)
    assert h.counts == [2, 2, 2]
    assert h.sum == 1024


# ---- health --------------------------------------------------------------------------------


def test_healthz_and_readyz(source, port):
    assert call(port, "/healthz")[0] == "200 OK"
    assert call(port, "/readyz")[0] == "200 OK"
    source.ready = False  # stopping
    assert call(port, "/healthz")[0] == "200 OK"
    status, _headers, body = call(port, "/readyz")
    assert status.startswith("503")
    assert b"not ready" in body


def test_the_dashboard_is_served_with_a_strict_policy(port):
    status, headers, body = call(port, "/")
    assert status == "200 OK"
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b"<title>jobmesh</title>" in body and b"/api/summary" in body


def test_unknown_paths_and_methods(port):
    assert call(port, "/nope")[0] == "404 Not Found"
    status, headers, _ = call(port, "/metrics", method="POST")
    assert status == "405 Method Not Allowed" and headers["Allow"] == "GET, HEAD"


# ---- JSON endpoints ----------------------------------------------------------------------------


def job(job_id, state="QUEUED", **extra):
    return dict({"jobId": job_id, "taskType": "SLEEP", "state": state, "attempts": 0, "maxAttempts": 3,
                 "workerId": None, "result": None, "error": None, "createdAtMillis": 1, "updatedAtMillis": 2,
                 "priority": "NORMAL", "runAtMillis": None, "retryAtMillis": None, "retryOf": None,
                 "waitingReason": "NO_WORKER"}, **extra)


def answers(msg):
    if isinstance(msg, m.ListJobs):
        return m.JobList([job("j2"), job("j1")], "17")
    if isinstance(msg, m.GetJobStatus):
        return m.JobStatus(job(msg.job_id)) if msg.job_id == "j1" else m.Error("unknown job %s" % msg.job_id)
    if isinstance(msg, m.GetJobPayload):
        return m.JobPayload("j1", {"text": "x"}) if msg.job_id == "j1" else m.Error("unknown job %s" % msg.job_id)
    if isinstance(msg, m.GetJobEvents):
        if msg.job_id != "j1":
            return m.Error("unknown job %s" % msg.job_id)
        return m.JobEvents("j1", [{"atMillis": 1, "event": "SUBMITTED"}])
    if isinstance(msg, m.ListWorkers):
        return m.WorkerList([{"workerId": "w-1", "capacity": 2, "activeJobs": 1, "lastHeartbeatMillis": 5,
                              "taskTypes": ["SLEEP"]}])
    return m.Error("unexpected")


@pytest.fixture
def api():
    source = FakeSource(answers)
    return source, HttpPort(source, "127.0.0.1", 0)


def get_json(port, path):
    status, headers, body = call(port, path)
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    return status, json.loads(body)


def test_jobs_page_passes_filters_to_the_core(api):
    source, port = api
    status, body = get_json(port, "/api/jobs?state=queued&type=SLEEP&cursor=99&limit=10")
    assert status == "200 OK"
    assert [j["jobId"] for j in body["jobs"]] == ["j2", "j1"]
    assert body["nextCursor"] == "17"
    assert isinstance(body["nowMillis"], int)
    assert source.mailbox.posted == [m.ListJobs(limit=10, state="QUEUED", cursor="99", task_type="SLEEP")]


def test_jobs_page_defaults_and_bad_limit(api):
    source, port = api
    assert get_json(port, "/api/jobs?state=&type=")[0] == "200 OK"
    assert source.mailbox.posted[-1] == m.ListJobs(limit=50)
    status, body = get_json(port, "/api/jobs?limit=lots")
    assert status == "400 Bad Request" and "limit" in body["error"]


def test_one_job_and_its_events(api):
    _source, port = api
    status, body = get_json(port, "/api/jobs/j1")
    assert status == "200 OK" and body["job"]["jobId"] == "j1" and body["job"]["waitingReason"] == "NO_WORKER"
    assert body["payload"] == {"text": "x"}
    status, body = get_json(port, "/api/jobs/j1/events")
    assert status == "200 OK" and body["events"] == [{"atMillis": 1, "event": "SUBMITTED"}]
    assert get_json(port, "/api/jobs/zz")[0] == "404 Not Found"
    assert get_json(port, "/api/jobs/zz/events")[0] == "404 Not Found"


def test_workers(api):
    _source, port = api
    status, body = get_json(port, "/api/workers")
    assert status == "200 OK" and body["workers"][0]["workerId"] == "w-1"


def test_reads_of_jobs_are_refused_while_not_ready(api):
    source, port = api
    source.ready = False
    status, body = get_json(port, "/api/jobs")
    assert status.startswith("503")
    assert source.mailbox.posted == []


def test_core_errors_map_to_statuses():
    source = FakeSource(lambda msg: m.Error("internal coordinator error; see the coordinator log"))
    assert get_json(HttpPort(source, "127.0.0.1", 0), "/api/jobs")[0] == "500 Internal Server Error"
    source = FakeSource(lambda msg: m.Error("coordinator is shutting down"))
    assert get_json(HttpPort(source, "127.0.0.1", 0), "/api/workers")[0].startswith("503")


def test_summary_and_series(source, port):
    status, body = get_json(port, "/api/summary")
    assert status == "200 OK"
    assert body["jobs"] == {"QUEUED": 3, "SCHEDULED": 0, "RUNNING": 4, "RETRY_WAIT": 0, "WAITING": 0}
    assert body["finished"] == {"COMPLETED": 10, "FAILED": 2, "CANCELLED": 1}
    assert body["byType"] == [{"state": "QUEUED", "taskType": "SLEEP", "protocol": "json", "count": 3},
                              {"state": "RUNNING", "taskType": "SHA256", "protocol": "json", "count": 4}]
    assert body["connections"] == {"worker": 2, "client": 3, "metrics": 0, "periodic": 0}
    assert (body["workers"], body["capacity"], body["busySlots"], body["inboxDepth"]) == (2, 8, 4, 9)
    # Two samples a second apart: rates are the counters' differences per second.
    port._sample(0.0)
    source.core.figures = core_metrics(submitted=26, finished={"COMPLETED": 13, "FAILED": 3, "CANCELLED": 1})
    port._sample(1.0)
    first, second = port.samples[0], port.samples[1]
    port.samples[1] = (first[0] + 2000,) + second[1:]  # pretend two seconds passed
    _status, series = get_json(port, "/api/series")
    assert series["submittedPerSec"] == [3.0]
    assert series["finishedPerSec"] == [2.0]
    assert series["failedPerSec"] == [0.5]
    assert series["queued"] == [3] and series["running"] == [4]
    assert len(series["t"]) == 1


def test_local_conn_hands_the_reply_bytes_over():
    conn = LocalConn()
    conn.reply(encode_frame(m.JobSubmitted("j").to_wire()), 1, close=False)
    assert decode_reply(conn.answer.get(block=False)) == {"type": "JOB_SUBMITTED", "jobId": "j"}


# ---- the registry, and the list of states ------------------------------------------------


STATES = [s.value for s in JobState]


def test_a_misspelled_counter_raises_instead_of_counting_elsewhere():
    counters = Counters()
    counters.retries += 1
    with pytest.raises(AttributeError):
        counters.retires += 1  # type: ignore[attr-defined]
    assert dataclasses.astuple(counters) == (0, 0, 1, 0, 0, 0, 0, 0, 0)


def test_counters_add_up_field_by_field():
    total = Counters(submitted=2, purged=1)
    total.add(Counters(submitted=3, workers_lost=4))
    assert total == Counters(submitted=5, workers_lost=4, purged=1)


@pytest.mark.parametrize("path, runtime", [
    ("counters.submited", False),  # a counter that does not exist
    ("submitted", False),  # a counter read as if it were a figure of its own
    ("jobs_by_stat", False),
    ("workers.count", False),  # through a plain number
    ("inbox_depth", False),  # a runtime figure read from the core's
    ("inbox_dept", True),
    ("connections_by_prot", True),
])
def test_a_metric_with_a_misspelled_figure_is_refused_when_declared(path, runtime):
    with pytest.raises(ValueError, match="metric path"):
        Metric("jobmesh_x", "x", Kind.GAUGE, path, runtime=runtime)


def test_get_stats_cannot_take_a_runtime_figure():
    with pytest.raises(ValueError, match="GET_STATS"):
        Metric("jobmesh_x", "x", Kind.GAUGE, "inbox_depth", runtime=True, stats="waits")


def test_names_summary_keys_and_stats_fields_are_each_used_once():
    for attribute in ("name", "summary", "stats"):
        values = [getattr(metric, attribute) for metric in METRICS if getattr(metric, attribute) is not None]
        assert len(values) == len(set(values)), attribute


def test_every_counter_is_exported_by_exactly_one_metric():
    read = [metric.path for metric in METRICS if metric.path.startswith("counters.")]
    assert sorted(read) == sorted("counters." + field.name for field in dataclasses.fields(Counters))
    for metric in METRICS:
        assert (metric.kind is Kind.COUNTER) == metric.name.endswith("_total"), metric.name


def test_every_metric_reads_a_value_of_its_kind_and_labels():
    source = FakeSource()
    core, runtime = source.core.metrics(), source.figures()
    for metric in METRICS:
        value = metric.value(core, runtime)
        if metric.kind is Kind.HISTOGRAM:
            assert len(value.counts) == len(value.bounds) + 1, metric.name
        elif not metric.labels:
            assert isinstance(value, int), metric.name
        else:
            # Every label value is listed, zeros too; schedule names are listed once they counted,
            # held jobs while a limit holds some.
            assert isinstance(value, dict) and (value or metric.labels in (("schedule",), ("taskType", "reason"))), \
                metric.name
            for key, n in value.items():
                labels = key if isinstance(key, tuple) else (key,)
                assert len(labels) == len(metric.labels) and isinstance(n, int), metric.name


def test_get_stats_is_built_from_the_registry_with_the_wire_names_unchanged():
    fields = {field.name for field in dataclasses.fields(m.Stats)} - {"at_millis"}
    assert {name for name, _metric in f.STATS_FIELDS} == fields
    stats = f.stats_message(core_metrics(), 123)
    # docs/PROTOCOL.md: STATS {atMillis, jobs, submitted, finished, rejected, retries, workers, periodicWorkers,
    # capacity, busySlots, waits}
    assert list(stats.to_wire()) == ["type", "atMillis", "jobs", "submitted", "finished", "rejected", "retries",
                                     "workers", "periodicWorkers", "capacity", "busySlots", "waits"]
    assert (stats.at_millis, stats.submitted, stats.rejected, stats.retries, stats.workers, stats.periodic_workers,
            stats.capacity, stats.busy_slots, stats.waits) == (123, 20, 3, 5, 2, 3, 8, 4, 6)
    assert stats.jobs == {"QUEUED": 3, "SCHEDULED": 0, "RUNNING": 4, "RETRY_WAIT": 0, "WAITING": 0}


def test_an_unknown_state_in_the_figures_is_an_error_not_a_silent_zero():
    figures = core_metrics(jobs={("QUEUD", "SLEEP", "NORMAL", "json"): 1})
    with pytest.raises(KeyError):
        figures.jobs_by_state
    with pytest.raises(KeyError):
        core_metrics(finished={"COMPLETED": 1}).finished_by_state


def test_every_state_is_in_the_metrics_the_dashboards_data_get_stats_and_top():
    source = FakeSource()
    port = HttpPort(source, "127.0.0.1", 0)
    # /metrics: a series of every state
    text = call(port, "/metrics")[2].decode()
    labelled = {(s.name, s.labels.get("state")) for family in text_string_to_metric_families(text)
                for s in family.samples}
    for state in JobState:
        assert ("jobmesh_jobs_finished_total" if state in TERMINAL else "jobmesh_jobs", state.value) in labelled
    # the dashboard's data: the list of states the page builds its cards and filter from, and a count of each
    summary = port.summary()
    assert summary["states"]["active"] + summary["states"]["terminal"] == STATES
    assert list(summary["jobs"]) + list(summary["finished"]) == STATES
    # GET_STATS, and top drawing what it answers
    stats = f.stats_message(source.core.metrics(), 1_700_000_000_000)
    assert list(stats.jobs) + list(stats.finished) == STATES

    class Client:
        host, port = "127.0.0.1", 1

        def stats(self):
            return stats

        def list_jobs(self, limit, state):
            return [], None

        def workers(self):
            return []

        def request(self, msg, expect, idempotent=False):
            assert isinstance(msg, m.ScheduleList)
            return m.ScheduleList()

    out = io.StringIO()

    from jobmesh.client.commands import Console

    assert top.run(Client(), Console(out, io.StringIO()), 1, 1) == 0
    for state in JobState:
        count = stats.finished[state.value] if state in TERMINAL else stats.jobs[state.value]
        assert " %s %d" % (state.value.lower(), count) in out.getvalue()


def test_the_dashboard_takes_its_states_from_the_summary():
    page = call(HttpPort(FakeSource(), "127.0.0.1", 0), "/")[2].decode()
    assert "s.states.active" in page and "s.states.terminal" in page
    for state in STATES:
        assert "<option>%s</option>" % state not in page


# ---- the flag -----------------------------------------------------------------------------------


def test_metrics_port_is_off_unless_given_and_up_passes_it_on():
    from jobmesh.cli import parse
    from jobmesh.config import coordinator_config
    from jobmesh.up import coordinator_argv

    assert coordinator_config(parse(["coordinator"])[1]).metrics_port is None
    cfg = coordinator_config(parse(["coordinator", "--metrics-port=0"])[1])
    assert cfg.metrics_port == 0
    assert "--metrics-port=0" in coordinator_argv(cfg)
    assert not any(a.startswith("--metrics-port") for a in coordinator_argv(coordinator_config(parse(["up"])[1])))
    assert coordinator_config(parse(["up", "--metrics-port=9100"])[1]).metrics_port == 9100


def test_a_bad_metrics_port_is_a_config_error():
    from jobmesh.cli import parse
    from jobmesh.config import coordinator_config
    from jobmesh.errors import ConfigError

    for bad in ("x", "-1", "65536"):
        with pytest.raises(ConfigError, match="--metrics-port"):
            coordinator_config(parse(["coordinator", "--metrics-port=%s" % bad])[1])
