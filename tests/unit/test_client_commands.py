"""The client commands in-process: docopt argv -> requests on the wire -> text on a Console.

A ``ScriptedServer`` (tests/support/scripted_server.py) plays the coordinator and records every request;
output goes to StringIO streams, so nothing here touches the test process's own streams.
"""

from __future__ import annotations

import calendar
import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from jobmesh.cli import parse
from jobmesh.client.commands import Console, parse_run_at, run_client_command, task_type_name
from jobmesh.errors import ConfigError
from jobmesh.exitcodes import EXIT_OK
from tests.support.scripted_server import ScriptedServer

NOW_ISH = 1_700_000_000_000
SNAP = {"jobId": "j-1", "taskType": "SLEEP", "state": "QUEUED", "attempts": 0, "maxAttempts": 3,
        "workerId": None, "result": None, "error": None, "createdAtMillis": NOW_ISH,
        "updatedAtMillis": NOW_ISH, "priority": "NORMAL", "runAtMillis": None}
SUBMITTED = {"type": "JOB_SUBMITTED", "jobId": "j-1"}


def utc_millis(*fields: int) -> int:
    return calendar.timegm(datetime(*fields).timetuple()) * 1000


# ---- --run-at -----------------------------------------------------------------------------


def test_run_at_epoch_millis():
    assert parse_run_at("1796055997317") == datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(
        milliseconds=1796055997317)
    assert parse_run_at("946684800000") == datetime(2000, 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize("text,hint", [("1796281550", True), ("0", False), ("946684799999", False)])
def test_run_at_numbers_before_2000_are_refused_with_a_hint_about_seconds(text, hint):
    with pytest.raises(ConfigError) as caught:
        parse_run_at(text)
    message = str(caught.value)
    assert "after 2000-01-01" in message and ("%s000" % text in message) == hint


def test_run_at_iso_with_z_and_with_offset():
    assert parse_run_at("2026-12-24T18:00:00Z") == datetime(2026, 12, 24, 18, tzinfo=timezone.utc)
    assert parse_run_at("2026-12-24T18:00:00+02:00") == datetime(2026, 12, 24, 16, tzinfo=timezone.utc)
    assert parse_run_at("2026-12-24T18:00:00.250-05:30") == datetime(
        2026, 12, 24, 23, 30, 0, 250_000, tzinfo=timezone.utc)


def test_run_at_without_a_zone_is_local_time():
    parsed = parse_run_at("2026-12-24T18:00:00")
    assert parsed.tzinfo is not None
    assert parsed == datetime(2026, 12, 24, 18).astimezone()


@pytest.mark.parametrize("tz,utc_hour_minute", [("UTC0", (18, 0)), ("IST-5:30", (12, 30)), ("EST5", (23, 0))])
def test_run_at_without_a_zone_follows_the_process_time_zone(tz, utc_hour_minute):
    # A child process with its own TZ (POSIX rules, no tz database needed): the test process's zone is untouched.
    code = ("from jobmesh.client.commands import parse_run_at; "
            "print(parse_run_at('2026-12-24T18:00:00').astimezone(__import__('datetime').timezone.utc).isoformat())")
    env = dict(os.environ, TZ=tz)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    hour, minute = utc_hour_minute
    assert proc.stdout.strip() == "2026-12-24T%02d:%02d:00+00:00" % (hour, minute)


@pytest.mark.parametrize("text", ["garbage", "", "tomorrow", "2026-13-01T00:00:00Z", "12:00", "--5", "1.5e12",
                                  "-1", "-1796055997317", "1969-12-31T23:59:59Z", "99999999999999999999999"])


def test_run_at_that_does_not_parse_or_is_negative(text):
    with pytest.raises(ConfigError) as info:
        parse_run_at(text)
    assert "--run-at" in str(info.value)
    assert "\n" not in str(info.value)


# ---- flag validation: usage errors before anything is sent ----------------------------------


@pytest.mark.parametrize("flags,message", [
    (["--delay-millis=5", "--run-at=2026-12-24T18:00:00Z"], "not both"),
    (["--delay-millis=-1"], "--delay-millis must be >= 0"),
    (["--delay-millis=soon"], "--delay-millis must be an integer"),
    (["--run-at=garbage"], "--run-at must be epoch milliseconds or an ISO 8601 time"),
    (["--run-at=-5"], "--run-at must not be negative"),
])
def test_schedule_flag_errors_send_nothing(jm, flags, message):
    with pytest.raises(ConfigError) as info:
        jm([SUBMITTED], "submit", "SLEEP", '{"durationMillis": 1}', *flags)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_schedule_flag_errors_never_connect():
    server = ScriptedServer([SUBMITTED])
    try:
        _cmd, args = parse(["submit", "SLEEP", "--run-at=garbage", "--coordinator=127.0.0.1:%d" % server.port])
        with pytest.raises(ConfigError):
            run_client_command("submit", args, Console(io.StringIO(), io.StringIO()))
        assert server.connections == 0 and server.requests == []
    finally:
        server.close()


# ---- submit -----------------------------------------------------------------------------


def test_submit_with_delay_millis_sends_delay_millis(jm):
    code, out, err, server = jm([SUBMITTED], "submit", "SLEEP", '{"durationMillis": 1}', "--delay-millis=60000")
    assert (code, out, err) == (EXIT_OK, "submitted job j-1\n", "")
    (request,) = server.requests
    assert (request["delayMillis"], request["runAtMillis"]) == (60000, None)


@pytest.mark.parametrize("flag,millis", [
    ("--run-at=2026-12-24T18:00:00Z", utc_millis(2026, 12, 24, 18)),
    ("--run-at=2026-12-24T18:00:00+01:00", utc_millis(2026, 12, 24, 17)),
    ("--run-at=1796055997317", 1796055997317),
    ("--run-at=1970-01-01T00:00:00Z", 0),  # a time in the past runs at once
])
def test_submit_with_run_at_sends_run_at_millis(jm, flag, millis):
    code, out, _err, server = jm([SUBMITTED], "submit", "SLEEP", '{"durationMillis": 1}', flag, "--json")
    assert code == EXIT_OK and json.loads(out) == {"jobId": "j-1"}
    (request,) = server.requests
    assert (request["runAtMillis"], request["delayMillis"]) == (millis, None)


def test_submit_without_a_schedule_sends_neither(jm):
    _code, _out, _err, server = jm([SUBMITTED], "submit", "SLEEP")
    assert (server.requests[0]["runAtMillis"], server.requests[0]["delayMillis"]) == (None, None)


@pytest.mark.parametrize("given,sent", [
    ("SLEEP", "SLEEP"), ("sleep", "SLEEP"), ("Word_Count", "WORD_COUNT"), ("sha256", "SHA256"),
    ("prime_count", "PRIME_COUNT"), ("fail", "FAIL"),
    ("GREET", "GREET"), ("greet", "greet"), ("Greet", "Greet"), ("resize.image", "resize.image"),
    ("sleepy", "sleepy"),
])
def test_submit_upper_cases_only_the_built_ins(jm, given, sent):
    assert task_type_name(given) == sent
    _code, _out, _err, server = jm([SUBMITTED], "submit", given, '{"name": "Ada"}')
    assert server.requests[0]["taskType"] == sent


def test_submit_reads_the_payload_from_the_consoles_stdin(jm):
    _code, _out, _err, server = jm([SUBMITTED], "submit", "GREET", "-", stdin=io.StringIO('{"name": "Ada"}'))
    assert server.requests[0]["payload"] == {"name": "Ada"}


def test_submit_of_stdin_payload_without_a_stdin_is_a_usage_error(jm):
    with pytest.raises(ConfigError):
        jm([SUBMITTED], "submit", "GREET", "-")


# ---- list, workers, status --------------------------------------------------------------


@pytest.mark.parametrize("flag,sent", [("--type=SLEEP", "SLEEP"), ("--type=sleep", "SLEEP"),
                                       ("--type=GREET", "GREET"), ("--type=greet", "greet")])


def test_list_type_sends_task_type(jm, flag, sent):
    code, out, _err, server = jm([{"type": "JOB_LIST", "jobs": [], "nextCursor": None}], "list", flag, "--json")
    assert code == EXIT_OK and out == "[]\n"
    (request,) = server.requests
    assert request["taskType"] == sent and request["state"] is None


def test_list_type_follows_cursors_with_the_same_filter(jm):
    greet = dict(SNAP, taskType="GREET")
    pages = [{"type": "JOB_LIST", "jobs": [dict(greet, jobId="a")], "nextCursor": "c1"},
             {"type": "JOB_LIST", "jobs": [dict(greet, jobId="b")], "nextCursor": None}]
    code, out, _err, server = jm(pages, "list", "--type=GREET", "--state=scheduled", "--json")
    assert code == EXIT_OK and [j["jobId"] for j in json.loads(out)] == ["a", "b"]
    assert [(r["taskType"], r["state"], r["cursor"]) for r in server.requests] == [
        ("GREET", "SCHEDULED", None), ("GREET", "SCHEDULED", "c1")]


def test_list_state_scheduled(jm):
    scheduled = dict(SNAP, state="SCHEDULED", runAtMillis=NOW_ISH + 60_000)
    code, out, _err, server = jm([{"type": "JOB_LIST", "jobs": [scheduled], "nextCursor": None}],
                                 "list", "--state=SCHEDULED")
    assert code == EXIT_OK and server.requests[0]["state"] == "SCHEDULED"
    header, row = out.splitlines()
    assert row.split()[:3] == ["j-1", "SLEEP", "SCHEDULED"]


def test_workers_table_with_types_and_json_as_received(jm):
    items = [{"workerId": "w-1", "capacity": 4, "activeJobs": 1, "lastHeartbeatMillis": NOW_ISH,
              "taskTypes": ["SLEEP", "WORD_COUNT", "SHA256", "PRIME_COUNT", "FAIL", "GREET"], "extra": {"x": 1}},
             {"workerId": "w-old", "capacity": 2, "activeJobs": 0, "lastHeartbeatMillis": NOW_ISH}]
    reply = {"type": "WORKER_LIST", "workers": items}
    code, out, _err, _server = jm([reply], "workers")
    assert code == EXIT_OK
    header, first, second = out.splitlines()
    assert header.split()[-1] == "TYPES"
    assert first.split()[-1] == "SLEEP,WORD_COUNT,SHA256,PRIME_COUNT,FAIL,GREET"
    assert second.split()[0] == "w-old" and second.split()[-1] == "-"
    code, out, _err, _server = jm([reply], "workers", "--json")
    assert code == EXIT_OK and json.loads(out) == items


def test_status_of_a_scheduled_job_shows_when_it_runs(jm):
    run_at = utc_millis(2026, 12, 24, 18)
    scheduled = dict(SNAP, state="SCHEDULED", runAtMillis=run_at)
    code, out, _err, _server = jm([{"type": "JOB_STATUS", "job": scheduled}], "status", "j-1")
    assert code == EXIT_OK
    assert "state     SCHEDULED\n" in out
    last = out.splitlines()[-1]
    assert last.startswith("runs at   ")
    stamp = datetime.fromtimestamp(run_at / 1000).strftime("%Y-%m-%d %H:%M:%S")
    assert "(%s " % stamp in last
    code, out, _err, _server = jm([{"type": "JOB_STATUS", "job": scheduled}], "status", "j-1", "--json")
    assert json.loads(out) == scheduled


def test_errors_go_to_the_consoles_stderr_one_line(jm):
    code, out, err, _server = jm([{"type": "ERROR", "message": "unknown task type 'greet'"}], "submit", "greet")
    assert (code, out) == (1, "")
    assert err == "jobmesh submit: the coordinator refused: unknown task type 'greet'\n"


# ---- limits -----------------------------------------------------------------------------

LIMIT = {"taskType": "EXPORT", "maxRunning": None, "maxRunningPerKey": 2, "ratePerSecond": None, "burst": None,
         "ratePerKeyPerSecond": None, "paused": False, "running": 2, "queued": 7}


def test_limit_set_sends_every_limit_and_no_pause(jm):
    code, out, err, server = jm([{"type": "LIMIT", "limit": LIMIT}], "limit", "set", "EXPORT",
                                "--max-running-per-key=2", "--rate=0.5", "--burst=3")
    assert (code, err) == (EXIT_OK, "")
    (request,) = server.requests
    assert request == {"type": "LIMIT_PUT", "limit": {"taskType": "EXPORT", "maxRunning": None, "maxRunningPerKey": 2,
                                                      "ratePerSecond": 0.5, "burst": 3, "ratePerKeyPerSecond": None}}
    assert out.startswith("limits of EXPORT set\ntype      EXPORT\n")


def test_limit_subcommands_and_pause_send_their_requests(jm):
    reply = {"type": "LIMIT", "limit": LIMIT}
    for argv, sent in ((("limit", "show", "sleep"), {"type": "LIMIT_GET", "taskType": "SLEEP"}),
                       (("limit", "rm", "EXPORT"), {"type": "LIMIT_DELETE", "taskType": "EXPORT"}),
                       (("pause", "EXPORT"), {"type": "TYPE_PAUSE", "taskType": "EXPORT"}),
                       (("resume", "EXPORT"), {"type": "TYPE_RESUME", "taskType": "EXPORT"})):
        code, out, _err, server = jm([reply], *argv, "--json")
        assert code == EXIT_OK and json.loads(out) == LIMIT
        assert server.requests == [sent]
    code, out, _err, server = jm([{"type": "LIMIT_LIST", "limits": [LIMIT]}], "limit", "list")
    assert [r["type"] for r in server.requests] == ["LIMIT_LIST"]
    assert out.splitlines()[1].split() == ["EXPORT", "active", "-", "2", "-", "-", "-", "2", "7"]


def test_submit_with_keys_and_a_duplicate(jm):
    duplicate = {"type": "JOB_SUBMITTED", "jobId": "j-7", "duplicate": True}
    code, out, err, server = jm([duplicate], "submit", "EXPORT", "--concurrency-key=acme", "--unique-key=r:1")
    assert (code, out, err) == (EXIT_OK, "job j-7 is already active with unique key r:1; no new job\n", "")
    (request,) = server.requests
    assert (request["concurrencyKey"], request["uniqueKey"]) == ("acme", "r:1")
    code, out, _err, _server = jm([duplicate], "submit", "EXPORT", "--unique-key=r:1", "--json")
    assert json.loads(out) == {"jobId": "j-7", "duplicate": True}
    code, out, _err, server = jm([SUBMITTED], "submit", "EXPORT", "--json")
    assert json.loads(out) == {"jobId": "j-1"}
    assert "concurrencyKey" not in server.requests[0] or server.requests[0]["concurrencyKey"] is None


def test_status_of_a_job_held_by_a_key_limit_counts_the_keys_running_jobs(jm):
    held = dict(SNAP, taskType="EXPORT", waitingReason="KEY_CONCURRENCY_LIMIT", concurrencyKey="acme")
    running = [dict(SNAP, jobId="j-%d" % i, taskType="EXPORT", state="RUNNING", concurrencyKey=key)
               for i, key in enumerate(("acme", "other", "acme"))]
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": held}, {"type": "LIMIT", "limit": LIMIT},
                                  {"type": "JOB_LIST", "jobs": running, "nextCursor": None}], "status", "j-1")
    assert code == EXIT_OK
    assert "waiting   2 of 2 EXPORT jobs for key acme are running\n" in out
    assert [r["type"] for r in server.requests] == ["GET_JOB_STATUS", "LIMIT_GET", "LIST_JOBS"]
    assert (server.requests[2]["state"], server.requests[2]["taskType"]) == ("RUNNING", "EXPORT")


def test_status_of_a_held_job_whose_limit_cannot_be_read_still_says_why(jm):
    held = dict(SNAP, taskType="EXPORT", waitingReason="CONCURRENCY_LIMIT")
    code, out, _err, _server = jm([{"type": "JOB_STATUS", "job": held}, {"type": "ERROR", "message": "no"}],
                                  "status", "j-1")
    assert code == EXIT_OK
    assert "waiting   as many EXPORT jobs are running as its limit allows\n" in out


# ---- wait: a live line on a terminal only -----------------------------------------------


EVENTS = {"type": "JOB_EVENTS", "jobId": "j-1", "events": []}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_wait_on_a_terminal_shows_the_jobs_progress_in_place_then_erases_it():
    running = dict(SNAP, state="RUNNING", workerId="w-1",
                   progress={"fraction": 0.42, "message": "compressing chunk 7", "atMillis": NOW_ISH})
    later = dict(running, progress=dict(running["progress"], fraction=0.9, message="chunk 9"))
    done = dict(SNAP, state="COMPLETED", attempts=1, result={"ok": True})
    server = ScriptedServer([{"type": "JOB_STATUS", "job": job} for job in (running, later, done)] + [EVENTS])
    try:
        _cmd, args = parse(["wait", "j-1", "--coordinator=127.0.0.1:%d" % server.port])
        out = Terminal()
        assert run_client_command("wait", args, Console(out, io.StringIO())) == EXIT_OK
    finally:
        server.close()
    # The job at once, then a WAIT_JOB of a second at a time while it runs
    assert [r.get("timeoutMillis") for r in server.requests] == [0, 1000, 1000, None]
    text = out.getvalue()
    first, second = "\r\x1b[Kjob j-1 RUNNING 42% compressing chunk 7", "\r\x1b[Kjob j-1 RUNNING 90% chunk 9"
    assert text.startswith(first + second + "\r\x1b[Kjob       j-1\n"), text
    assert "state     COMPLETED\n" in text


@pytest.mark.parametrize("flags", [(), ("--json",)])
def test_wait_into_a_pipe_or_with_json_writes_no_live_line(jm, flags):
    done = dict(SNAP, state="COMPLETED", attempts=1, result={"ok": True})
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": done}, EVENTS], "wait", "j-1", *flags)
    assert code == EXIT_OK and "\r" not in out and "\x1b" not in out
    assert server.requests[0]["timeoutMillis"] == 60_000
