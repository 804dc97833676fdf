"""Seeing inside from the client side: events, retry, purge, top, the waiting words, and the
time zones in ``list`` — the client library, the commands' output and exit codes against a
scripted coordinator, and the pure renderers."""

from __future__ import annotations

import io
import json
import time

import pytest

from jobmesh.cli import parse
from jobmesh.client import render, top
from jobmesh.client.commands import Console, parse_duration_millis, run_client_command
from jobmesh.errors import ConfigError, RequestFailed, SubmitRejected
from jobmesh.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
from tests.support.scripted_server import ScriptedServer

NOW = 1_700_000_000_000
SNAP = {"jobId": "j-1", "taskType": "SHA256", "state": "QUEUED", "attempts": 0, "maxAttempts": 3,
        "workerId": None, "result": None, "error": None, "createdAtMillis": NOW, "updatedAtMillis": NOW,
        "priority": "NORMAL", "runAtMillis": None, "waitingReason": None, "retryAtMillis": None, "retryOf": None}
EVENTS = [
    {"atMillis": NOW, "event": "SUBMITTED"},
    {"atMillis": NOW + 5, "event": "ASSIGNED", "attempt": 1, "attemptId": "j-1.1", "workerId": "w-1"},
    {"atMillis": NOW + 1204, "event": "ATTEMPT_FAILED", "attempt": 1, "attemptId": "j-1.1",
     "detail": "attempt 1 failed on purpose"},
    {"atMillis": NOW + 1204, "event": "RETRY_WAIT", "attempt": 1, "retryAtMillis": NOW + 2204},
    {"atMillis": NOW + 2210, "event": "QUEUED"},
    {"atMillis": NOW + 2211, "event": "ASSIGNED", "attempt": 2, "attemptId": "j-1.2", "workerId": "w-2"},
    {"atMillis": NOW + 2300, "event": "COMPLETED", "attempt": 2, "attemptId": "j-1.2"},
]


def worker(worker_id, types, capacity, active):
    return {"workerId": worker_id, "taskTypes": types, "capacity": capacity, "activeJobs": active,
            "lastHeartbeatMillis": NOW}


# ---- the client library ---------------------------------------------------------------------


def test_client_events_retry_purge_send_their_requests(serve):
    server, client = serve({"type": "JOB_EVENTS", "jobId": "j-1", "events": EVENTS},
                           {"type": "JOB_SUBMITTED", "jobId": "j-2"},
                           {"type": "JOBS_PURGED", "purged": 7, "more": True},
                           {"type": "JOBS_PURGED", "purged": 0, "more": False})
    assert client.events("j-1") == EVENTS
    assert client.retry("j-1") == "j-2"
    assert client.purge(60_000, limit=7) == (7, True)
    assert client.purge(0) == (0, False)
    assert server.requests == [
        {"type": "GET_JOB_EVENTS", "jobId": "j-1"},
        {"type": "RETRY_JOB", "jobId": "j-1"},
        {"type": "PURGE_JOBS", "olderThanMillis": 60_000, "limit": 7, "dryRun": False},
        {"type": "PURGE_JOBS", "olderThanMillis": 0, "limit": None, "dryRun": False},
    ]


def test_client_events_of_an_unknown_job_and_retry_at_the_limit(serve):
    _server, client = serve({"type": "ERROR", "message": "unknown job j-x"},
                            {"type": "SUBMIT_REJECTED", "reason": "at capacity", "activeCount": 5, "limit": 5})
    with pytest.raises(RequestFailed, match="unknown job j-x"):
        client.events("j-x")
    with pytest.raises(SubmitRejected):
        client.retry("j-1")


@pytest.mark.parametrize("older_than,limit", [(-1, None), (0, 0), (5, -3)])
def test_client_purge_refuses_negative_values_before_sending(serve, older_than, limit):
    server, client = serve({"type": "JOBS_PURGED", "purged": 0, "more": False})
    with pytest.raises(ValueError):
        client.purge(older_than, limit)
    assert server.requests == []


# ---- --older-than durations -----------------------------------------------------------------


@pytest.mark.parametrize("text,millis", [
    ("90s", 90_000), ("15m", 900_000), ("12h", 43_200_000), ("7d", 604_800_000), ("5000", 5000),
    ("0", 0), ("250ms", 250), ("1.5h", 5_400_000), (" 7D ", 604_800_000),
])
def test_durations(text, millis):
    assert parse_duration_millis(text) == millis


@pytest.mark.parametrize("text", ["", "-5", "7 days", "d", "1.5", "12x", "1h30m", "abc", "+3s"])
def test_bad_durations_are_usage_errors(text):
    with pytest.raises(ConfigError, match="--older-than must be"):
        parse_duration_millis(text)


# ---- events ---------------------------------------------------------------------------------


def test_event_table_times_attempts_workers_and_details():
    out = render.event_table(EVENTS)
    header, *rows = out.splitlines()
    assert header.split() == ["AT", "TIME", "EVENT", "ATTEMPT", "WORKER", "DETAIL"]
    assert [r.split()[0] for r in rows] == ["+0.000s", "+0.005s", "+1.204s", "+1.204s", "+2.210s", "+2.211s",
                                            "+2.300s"]
    zone = time.strftime("%Z", time.localtime(NOW / 1000))
    stamp = render.timestamp(NOW, zone=True, fraction=True)
    assert stamp.endswith(".000 " + zone) and rows[0].split(None, 1)[1].startswith(stamp)
    by_event = {}
    for row in rows:
        cells = row.split(zone, 1)[1].split()  # after the wall-clock time
        by_event.setdefault(cells[0], []).append(cells)
    assert by_event["SUBMITTED"] == [["SUBMITTED", "-", "-", "-"]]
    # the worker of an attempt is filled in from its ASSIGNED event
    assert by_event["ATTEMPT_FAILED"][0][:3] == ["ATTEMPT_FAILED", "1", "w-1"]
    assert " ".join(by_event["ATTEMPT_FAILED"][0][3:]) == "attempt 1 failed on purpose"
    assert by_event["COMPLETED"][0][:3] == ["COMPLETED", "2", "w-2"]
    assert by_event["RETRY_WAIT"][0][:3] == ["RETRY_WAIT", "1", "w-1"]  # by attempt number alone
    retry_row = next(r for r in rows if "RETRY_WAIT" in r)
    assert retry_row.endswith("(+2.204s)")
    assert "retry at " + render.timestamp(NOW + 2204, zone=True, fraction=True) in retry_row


def test_event_table_empty():
    assert render.event_table([]) == "no events"


def test_events_command_text_and_json(jm):
    reply = {"type": "JOB_EVENTS", "jobId": "j-1", "events": EVENTS}
    code, out, err, server = jm([reply], "events", "j-1")
    assert (code, err) == (EXIT_OK, "")
    assert out == render.event_table(EVENTS) + "\n"
    assert server.requests == [{"type": "GET_JOB_EVENTS", "jobId": "j-1"}]
    code, out, _err, _server = jm([reply], "events", "j-1", "--json")
    assert code == EXIT_OK and out.count("\n") == 1 and json.loads(out) == EVENTS


def test_events_of_an_unknown_job_exits_1_with_the_reason(jm):
    code, out, err, _server = jm([{"type": "ERROR", "message": "unknown job j-x"}], "events", "j-x")
    assert (code, out) == (EXIT_FAILED, "")
    assert err == "jobmesh events: the coordinator refused: unknown job j-x\n"


# ---- retry and purge ------------------------------------------------------------------------


def test_retry_text_and_json(jm):
    code, out, err, server = jm([{"type": "JOB_SUBMITTED", "jobId": "j-2"}], "retry", "j-1")
    assert (code, out, err) == (EXIT_OK, "submitted job j-2 (retry of j-1)\n", "")
    assert server.requests == [{"type": "RETRY_JOB", "jobId": "j-1"}]
    code, out, _err, _server = jm([{"type": "JOB_SUBMITTED", "jobId": "j-2"}], "retry", "j-1", "--json")
    assert code == EXIT_OK and json.loads(out) == {"jobId": "j-2", "retryOf": "j-1"}


@pytest.mark.parametrize("reply,says", [
    ({"type": "ERROR", "message": "job j-1 is RUNNING, not finished"}, "refused: job j-1 is RUNNING"),
    ({"type": "SUBMIT_REJECTED", "reason": "at capacity", "activeCount": 5, "limit": 5}, "overloaded"),
])
def test_retry_refused_exits_1(jm, reply, says):
    code, out, err, _server = jm([reply], "retry", "j-1")
    assert (code, out) == (EXIT_FAILED, "")
    assert err.startswith("jobmesh retry: ") and says in err and err.count("\n") == 1


def test_purge_asks_until_no_more_and_prints_the_total(jm):
    replies = [{"type": "JOBS_PURGED", "purged": 10_000, "more": True},
               {"type": "JOBS_PURGED", "purged": 10_000, "more": True},
               {"type": "JOBS_PURGED", "purged": 42, "more": False}]
    code, out, err, server = jm(replies, "purge", "--older-than=7d")
    assert (code, out, err) == (EXIT_OK, "purged 20042 finished jobs last updated more than 7d ago\n", "")
    assert [r["olderThanMillis"] for r in server.requests] == [604_800_000] * 3
    assert all(r["type"] == "PURGE_JOBS" for r in server.requests)


def test_purge_json(jm):
    code, out, _err, _server = jm([{"type": "JOBS_PURGED", "purged": 1, "more": False}],
                                  "purge", "--older-than=90000", "--json")
    assert code == EXIT_OK and json.loads(out) == {"purged": 1, "olderThanMillis": 90_000}


def test_purge_stops_if_the_coordinator_says_more_but_purged_nothing(jm):
    code, _out, _err, server = jm([{"type": "JOBS_PURGED", "purged": 0, "more": True},
                                   {"type": "JOBS_PURGED", "purged": 0, "more": False}], "purge", "--older-than=1s")
    assert code == EXIT_OK and len(server.requests) == 1


def test_purge_with_a_bad_duration_never_connects():
    server = ScriptedServer([{"type": "JOBS_PURGED", "purged": 0, "more": False}])
    try:
        _cmd, args = parse(["purge", "--older-than=soon", "--coordinator=127.0.0.1:%d" % server.port])
        with pytest.raises(ConfigError):
            run_client_command("purge", args, Console(io.StringIO(), io.StringIO()))
        assert server.connections == 0
    finally:
        server.close()


def test_purge_bad_duration_exits_2_from_main(capsys):
    from jobmesh.cli import main

    assert main(["purge", "--older-than=7 weeks", "--coordinator=127.0.0.1:1"]) == 2
    assert "--older-than must be" in capsys.readouterr().err


# ---- the waiting words ----------------------------------------------------------------------


@pytest.mark.parametrize("over,workers,words", [
    ({"waitingReason": "NO_WORKER"}, None, "no worker is connected"),
    ({"waitingReason": "NO_WORKER_FOR_TYPE", "taskType": "GREET"}, None, "no connected worker runs GREET"),
    ({"waitingReason": "BEHIND_OTHER_JOBS"}, None, "behind other queued jobs"),
    ({"waitingReason": "LOCK_WAIT"}, None, "waiting for a lock another job of that lock holds (Periodic ACQUIRE)"),
    ({"waitingReason": "WORKERS_BUSY"},
     [worker("a", ["SHA256", "SLEEP"], 4, 4), worker("b", ["SHA256"], 4, 4), worker("c", ["SHA256"], 4, 4),
      worker("d", ["GREET"], 8, 0)],
     "all 3 workers that run SHA256 are busy (12/12 slots)"),
    ({"waitingReason": "WORKERS_BUSY"}, [worker("a", ["SHA256"], 2, 2)],
     "the one worker that runs SHA256 is busy (2/2 slots)"),
    ({"waitingReason": "WORKERS_BUSY"}, None, "every worker that runs SHA256 is busy"),
    # a Periodic worker of a func named like the JSON task type does not count, and vice versa
    ({"waitingReason": "WORKERS_BUSY"}, [worker("a", ["SHA256"], 2, 2), dict(worker("p", ["SHA256"], 9, 9),
                                                                            protocol="periodic")],
     "the one worker that runs SHA256 is busy (2/2 slots)"),
    ({"waitingReason": "WORKERS_BUSY", "protocol": "periodic"},
     [worker("a", ["SHA256"], 2, 2), dict(worker("p", ["SHA256"], 9, 9), protocol="periodic")],
     "the one worker that runs SHA256 is busy (9/9 slots)"),
    ({"waitingReason": "SOMETHING_NEW"}, None, "SOMETHING_NEW"),
])
def test_waiting_words(over, workers, words):
    assert render.waiting(dict(SNAP, **over), NOW, workers) == words


def test_waiting_words_with_times():
    scheduled = dict(SNAP, state="SCHEDULED", waitingReason="SCHEDULED", runAtMillis=NOW + 240_000)
    assert render.waiting(scheduled, NOW) == "scheduled: runs in 4m (%s)" % render.timestamp(NOW + 240_000, zone=True)
    backoff = dict(SNAP, state="RETRY_WAIT", waitingReason="RETRY_BACKOFF", retryAtMillis=NOW + 2000)
    assert render.waiting(backoff, NOW) == "retry backoff: next attempt in 2s (%s)" % render.timestamp(
        NOW + 2000, zone=True)


def test_status_of_a_job_behind_busy_workers_counts_them(jm):
    busy = dict(SNAP, waitingReason="WORKERS_BUSY")
    workers = [worker("a", ["SHA256"], 4, 4), worker("b", ["SHA256"], 8, 8), worker("c", ["SLEEP"], 4, 0)]
    code, out, err, server = jm([{"type": "JOB_STATUS", "job": busy}, {"type": "WORKER_LIST", "workers": workers}],
                                "status", "j-1")
    assert (code, err) == (EXIT_OK, "")
    assert [r["type"] for r in server.requests] == ["GET_JOB_STATUS", "LIST_WORKERS"]
    lines = out.splitlines()
    assert lines[2:4] == ["state     QUEUED", "waiting   all 2 workers that run SHA256 are busy (12/12 slots)"]


@pytest.mark.parametrize("reason,words", [("NO_WORKER", "no worker is connected"),
                                          ("BEHIND_OTHER_JOBS", "behind other queued jobs")])
def test_status_says_why_without_asking_for_workers(jm, reason, words):
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": dict(SNAP, waitingReason=reason)}], "status", "j-1")
    assert code == EXIT_OK and "waiting   %s\n" % words in out
    assert len(server.requests) == 1


def test_status_of_a_retry_in_backoff_shows_retry_of_and_retry_at(jm):
    retry_at = int(time.time() * 1000) + 60_000
    job = dict(SNAP, state="RETRY_WAIT", attempts=1, waitingReason="RETRY_BACKOFF", retryAtMillis=retry_at,
               retryOf="j-0")
    code, out, _err, _server = jm([{"type": "JOB_STATUS", "job": job},
                                   {"type": "JOB_EVENTS", "jobId": "j-1", "events": EVENTS[:4]}], "status", "j-1")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[:2] == ["job       j-1", "retry of  j-0"]
    assert "worker    w-1 (attempt 1)" in lines
    assert "waiting   retry backoff: next attempt in " in out
    assert lines[-1].startswith("retry at  in ") and lines[-1].endswith("(%s)" % render.timestamp(retry_at, zone=True))


def test_status_of_a_finished_job_names_the_worker_of_its_last_attempt(jm):
    # Given a snapshot without a worker (it names one only while RUNNING) and the timeline
    job = dict(SNAP, state="COMPLETED", attempts=2, workerId=None)
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": job},
                                  {"type": "JOB_EVENTS", "jobId": "j-1", "events": EVENTS}], "status", "j-1")
    assert code == EXIT_OK
    assert "worker    w-2 (attempt 2)" in out.splitlines()
    assert server.requests[1] == {"type": "GET_JOB_EVENTS", "jobId": "j-1"}
    # and a job that never ran asks for no timeline
    queued = dict(SNAP, state="QUEUED", attempts=0, workerId=None)
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": queued}], "status", "j-1")
    assert code == EXIT_OK and "worker    -" in out.splitlines() and len(server.requests) == 1


def test_status_json_is_the_snapshot_alone(jm):
    busy = dict(SNAP, waitingReason="WORKERS_BUSY", retryOf="j-0")
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": busy}, {"type": "WORKER_LIST", "workers": []}],
                                 "status", "j-1", "--json")
    assert code == EXIT_OK and json.loads(out) == busy
    assert len(server.requests) == 1


def test_running_and_finished_jobs_have_no_waiting_line():
    for state in ("RUNNING", "COMPLETED"):
        assert "waiting" not in render.job_detail(dict(SNAP, state=state), NOW)


# ---- list shows the time zone ---------------------------------------------------------------


def test_list_updated_column_has_the_zone_and_json_is_unchanged(jm):
    page = {"type": "JOB_LIST", "jobs": [SNAP], "nextCursor": None}
    code, out, _err, _server = jm([page], "list")
    header, row = out.splitlines()
    assert code == EXIT_OK and header.split()[-1] == "UPDATED"
    assert row.endswith(render.timestamp(NOW, zone=True) + " (%s)" % render.age(NOW, int(time.time() * 1000)))
    assert row.split(None, 6)[6].split()[2] == time.strftime("%Z", time.localtime(NOW / 1000))
    code, out, _err, _server = jm([page], "list", "--json")
    assert json.loads(out) == [SNAP]


# ---- top ------------------------------------------------------------------------------------


def page(jobs, more=False):
    return {"type": "JOB_LIST", "jobs": jobs, "nextCursor": "next" if more else None}


def sample_replies(jobs, submitted, finished, queued, workers):
    """The five replies of one refresh: STATS, QUEUED and RETRY_WAIT pages, workers, schedules."""
    stats = {"type": "STATS", "atMillis": NOW, "jobs": jobs, "submitted": submitted,
             "finished": {"COMPLETED": finished, "FAILED": 0, "CANCELLED": 0}}
    return [stats, page(queued), page([]), {"type": "WORKER_LIST", "workers": workers},
            {"type": "SCHEDULE_LIST", "schedules": []}]


def test_top_two_refreshes(jm):
    waiting = dict(SNAP, jobId="q-1", waitingReason="WORKERS_BUSY", updatedAtMillis=NOW - 5000)
    workers = [worker("w-1", ["SHA256"], 1, 1)]
    jobs = {"QUEUED": 1, "SCHEDULED": 0, "RUNNING": 1, "RETRY_WAIT": 0}
    first = sample_replies(jobs, 10, 8, [waiting], workers)
    second = sample_replies(jobs, 10_000, 9_998, [waiting], workers)
    code, out, err, server = jm(first + second, "top", "--iterations=2", "--interval-millis=1")
    assert (code, err) == (EXIT_OK, "")
    assert top.CLEAR not in out  # into a pipe: plain frames, one after the other
    frames = out.split("jobmesh top ")
    assert frames[0] == "" and len(frames) == 3
    assert [(r["type"], r.get("state")) for r in server.requests[:4]] == [
        ("GET_STATS", None), ("LIST_JOBS", "QUEUED"), ("LIST_JOBS", "RETRY_WAIT"), ("LIST_WORKERS", None)]
    for text in frames[1:]:
        assert "jobs      queued 1  scheduled 0  running 1  retry_wait 0  waiting 0  (active 2)" in text
        assert "workers   1 live, 1/1 slots busy" in text
        assert "q-1" in text and "the one worker that runs SHA256 is busy (1/1 slots)" in text
    assert "rates     submitted -  finished -" in frames[1]
    # 9,990 submitted and finished in the (short) time between the two samples
    rates_line = [line for line in frames[2].splitlines() if line.startswith("rates")][0]
    submitted, finished = [float(word[:-2]) for word in rates_line.split()[2::2]]
    assert submitted == finished > 0


def test_top_rates_after_a_coordinator_restart_are_unknown():
    before = top.Sample(1.0, NOW, {"QUEUED": 5}, submitted=100, finished=90, waiting=[])
    after = top.Sample(2.0, NOW, {"QUEUED": 0}, submitted=3, finished=1, waiting=[])
    assert top.rates(before, after) == (render.MISSING, render.MISSING)
    later = top.Sample(3.0, NOW, {"QUEUED": 0}, submitted=13, finished=6, waiting=[])
    assert top.rates(after, later) == ("10.0/s", "5.0/s")


def test_top_unreachable_exits_3():
    _cmd, args = parse(["top", "--iterations=1", "--coordinator=127.0.0.1:1"])
    err = io.StringIO()
    assert run_client_command("top", args, Console(io.StringIO(), err)) == EXIT_UNREACHABLE
    assert err.getvalue().startswith("jobmesh top: coordinator unreachable: ")


def test_top_ctrl_c_exits_0():
    class Interrupting:
        host, port = "127.0.0.1", 1

        def stats(self, *args, **kwargs):
            raise KeyboardInterrupt

    out = io.StringIO()
    assert top.run(Interrupting(), Console(out, io.StringIO()), 1000, 0) == EXIT_OK


def test_rates_from_two_samples():
    before = top.Sample(10.0, NOW, {"QUEUED": 5, "RUNNING": 2}, submitted=40, finished=33, waiting=[])
    after = top.Sample(12.0, NOW + 2000, {"QUEUED": 3, "RUNNING": 2}, submitted=42, finished=37, waiting=[])
    assert top.rates(None, after) == ("-", "-")
    assert top.rates(before, after) == ("1.0/s", "2.0/s")  # 2 new, 4 finished in 2 s
