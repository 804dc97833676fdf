"""Human and --json output of the client commands: pure functions of wire dicts and a clock."""

from __future__ import annotations

import json

import pytest

from jobmesh.client import render
from jobmesh.client.commands import parse_payload
from jobmesh.errors import ConfigError

NOW = 1_700_000_000_000


def job(**over):
    base = {"jobId": "j-1", "taskType": "SLEEP", "state": "COMPLETED", "attempts": 1, "maxAttempts": 3,
            "workerId": None, "result": {"sleptMillis": 5}, "error": None,
            "createdAtMillis": NOW - 65_000, "updatedAtMillis": NOW - 3_000, "priority": "NORMAL"}
    base.update(over)
    return base


@pytest.mark.parametrize("delta_ms,text", [
    (0, "just now"), (999, "just now"), (-5000, "just now"), (1000, "1s ago"), (59_999, "59s ago"),
    (60_000, "1m ago"), (3_599_000, "59m ago"), (3_600_000, "1h ago"), (86_400_000 * 2 + 5, "2d ago"),
])
def test_age(delta_ms, text):
    assert render.age(NOW - delta_ms, NOW) == text


def test_age_of_missing_time():
    assert render.age(None, NOW) == "-"


def test_table_aligns_columns_and_shows_missing_as_dash():
    out = render.table(("A", "LONGER", "C"), [("xxxx", None, "z"), ("y", "1", "")])
    lines = out.splitlines()
    assert lines == ["A     LONGER  C", "xxxx  -       z", "y     1"]


def test_job_detail_lists_every_field():
    out = render.job_detail(job(state="FAILED", error="attempt 1 failed", result=None), NOW)
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["job"] == "j-1"
    assert fields["type"] == "SLEEP"
    assert fields["state"] == "FAILED"
    assert fields["priority"] == "NORMAL"
    assert fields["attempts"] == "1 of 3"
    assert fields["worker"] == "-"
    assert fields["result"] == "-"
    assert fields["error"] == "attempt 1 failed"
    assert fields["created"].startswith("1m ago (")
    assert fields["updated"].startswith("3s ago (")


def test_job_detail_shows_result_as_compact_json():
    out = render.job_detail(job(workerId="w-7", state="RUNNING"), NOW)
    assert 'result    {"sleptMillis": 5}' in out
    assert "worker    w-7" in out


def test_job_table():
    out = render.job_table([job(), job(jobId="j-2222", taskType="PRIME_COUNT", state="RUNNING",
                                       workerId="w-1", attempts=2)], NOW)
    header, first, second = out.splitlines()
    assert header.split() == ["JOB", "TYPE", "STATE", "PRIORITY", "ATTEMPTS", "WORKER", "UPDATED"]
    updated = "%s (3s ago)" % render.timestamp(job()["updatedAtMillis"], zone=True)
    assert first.split(None, 6) == ["j-1", "SLEEP", "COMPLETED", "NORMAL", "1/3", "-", updated]
    assert second.split(None, 6) == ["j-2222", "PRIME_COUNT", "RUNNING", "NORMAL", "2/3", "w-1", updated]
    # aligned: every row's STATE column starts at the same offset
    col = header.index("STATE")
    assert first[col:].startswith("COMPLETED") and second[col:].startswith("RUNNING")


def test_empty_tables():
    assert render.job_table([], NOW) == "no jobs"
    assert render.worker_table([], NOW) == "no live workers"


def test_worker_table_shows_each_workers_task_types():
    out = render.worker_table([
        {"workerId": "w-1", "capacity": 4, "activeJobs": 2, "lastHeartbeatMillis": NOW - 1500,
         "taskTypes": ["SLEEP", "WORD_COUNT", "SHA256", "PRIME_COUNT", "FAIL", "GREET"]},
        {"workerId": "w-22", "capacity": 1, "activeJobs": 0, "lastHeartbeatMillis": NOW,
         "taskTypes": ["resize.image"]},
    ], NOW)
    header, first, second = out.splitlines()
    assert header.split() == ["WORKER", "CAPACITY", "ACTIVE", "LAST", "HEARTBEAT", "TYPES"]
    assert first.split() == ["w-1", "4", "2", "1s", "ago", "SLEEP,WORD_COUNT,SHA256,PRIME_COUNT,FAIL,GREET"]
    assert second.split() == ["w-22", "1", "0", "just", "now", "resize.image"]
    col = header.index("TYPES")
    assert first[col:].startswith("SLEEP,") and second[col:] == "resize.image"


def test_worker_table_without_task_types_from_an_older_coordinator():
    out = render.worker_table([{"workerId": "w-1", "capacity": 4, "activeJobs": 2,
                                "lastHeartbeatMillis": NOW - 1500}], NOW)
    header, row = out.splitlines()
    assert header.split() == ["WORKER", "CAPACITY", "ACTIVE", "LAST", "HEARTBEAT", "TYPES"]
    assert row.split() == ["w-1", "4", "2", "1s", "ago", "-"]


@pytest.mark.parametrize("delta_ms,text", [
    (5 * 60_000, "in 5m"), (42_000, "in 42s"), (1000, "in 1s"), (3 * 3_600_000, "in 3h"),
    (2 * 86_400_000 + 7, "in 2d"), (999, "in 1s"), (1, "in 1s"), (0, "just now"), (-90_000, "1m ago"),
    (5 * 60_000 - 30, "in 5m"), (2000 - 30, "in 2s"), (60_000 - 30, "in 1m"), (3_600_000 - 30, "in 1h"),
])
def test_relative_reads_future_times_as_in(delta_ms, text):
    assert render.relative(NOW + delta_ms, NOW) == text


def test_job_detail_shows_when_a_scheduled_job_runs():
    run_at = NOW + 5 * 60_000
    out = render.job_detail(job(state="SCHEDULED", attempts=0, result=None, runAtMillis=run_at), NOW)
    lines = out.splitlines()
    fields = dict(line.split(None, 1) for line in lines[:-1])
    assert fields["state"] == "SCHEDULED"
    assert fields["attempts"] == "0 of 3"
    assert lines[-1] == "runs at   in 5m (%s)" % render.timestamp(run_at, zone=True)
    assert render.timestamp(run_at, zone=True).startswith(render.timestamp(run_at) + " ")
    # the existing lines are all still there, in their places
    assert [line.split()[0] for line in lines] == ["job", "type", "state", "priority", "attempts", "worker",
                                                   "result", "error", "created", "updated", "runs"]


def test_job_detail_of_a_job_that_was_due_says_when():
    out = render.job_detail(job(runAtMillis=NOW - 120_000), NOW)
    assert out.splitlines()[-1].startswith("runs at   2m ago (")


@pytest.mark.parametrize("run_at", ["absent", None])
def test_job_detail_without_a_run_at_is_unchanged(run_at):
    snap = job() if run_at == "absent" else job(runAtMillis=None)
    out = render.job_detail(snap, NOW)
    assert len(out.splitlines()) == 10
    assert "runs at" not in out


def test_json_is_one_document_with_wire_names():
    doc = render.to_json(job(result={"sha256": "ab"}, taskType="SHA256"))
    assert "\n" not in doc
    assert json.loads(doc) == job(result={"sha256": "ab"}, taskType="SHA256")


def test_cancel_messages():
    assert render.cancelled(True, job(state="CANCELLED")) == "cancelled job j-1"
    assert render.cancelled(False, job()) == "job j-1 already COMPLETED; nothing to cancel"


class FakeStdin:
    def __init__(self, text):
        self.text = text

    def read(self):
        return self.text


def test_payload_defaults_to_empty_object():
    assert parse_payload(None) == {}


def test_payload_from_argument_and_stdin():
    assert parse_payload('{"limit": 10}') == {"limit": 10}
    assert parse_payload("-", FakeStdin('{"text": "from stdin"}\n')) == {"text": "from stdin"}


@pytest.mark.parametrize("text", ["{bad", "", "[1, 2]", "42", '"text"', "null"])
def test_payload_must_be_a_json_object(text):
    with pytest.raises(ConfigError) as info:
        parse_payload(text)
    assert "PAYLOAD_JSON" in str(info.value)


def test_worker_table_marks_periodic_workers():
    out = render.worker_table([
        {"workerId": "periodic-3", "capacity": 2, "activeJobs": 1, "lastHeartbeatMillis": NOW,
         "taskTypes": ["resize"], "protocol": "periodic"},
    ], NOW)
    assert out.splitlines()[1].split() == ["periodic-3", "2", "1", "just", "now", "resize", "(periodic)"]


HOSTILE = "resize\x1b]0;owned\x07\x1b[2J\x9b31m"  # a title change, a screen clear, a C1 CSI


def test_control_characters_from_the_wire_never_reach_the_terminal():
    import io

    from jobmesh.client.commands import Console

    job = {"jobId": "j1", "taskType": HOSTILE, "state": "FAILED", "attempts": 1, "maxAttempts": 1,
           "error": "boom " + HOSTILE, "protocol": "periodic", "name": HOSTILE}
    out, err = io.StringIO(), io.StringIO()
    console = Console(out, err)
    console.out(render.job_detail(job, 0))
    console.out(render.job_table([job], 0))
    console.error("status", "unknown job " + HOSTILE)
    console.screen("\x1b[H\x1b[2J", "top " + HOSTILE)  # our own codes pass, the value's do not
    text = out.getvalue() + err.getvalue()
    assert "\x1b" not in text.replace("\x1b[H\x1b[2J", "", 1) and "\x07" not in text and "\x9b" not in text
    assert "resize\\x1b]0;owned\\x07\\x1b[2J\\x9b31m" in out.getvalue()
    assert render.printable("two\nlines\tand a tab") == "two\nlines\tand a tab"


def test_top_draws_in_place_on_a_terminal_but_writes_plain_lines_into_a_pipe():
    import io

    from jobmesh.client.commands import Console

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    piped, terminal = io.StringIO(), Terminal()
    Console(piped, io.StringIO()).screen("\x1b[H\x1b[2J", "frame")
    Console(terminal, io.StringIO()).screen("\x1b[H\x1b[2J", "frame")
    assert piped.getvalue() == "frame\n" and terminal.getvalue() == "\x1b[H\x1b[2Jframe\n"


def test_job_detail_names_the_submitting_token_when_there_is_one():
    job = {"jobId": "j-1", "taskType": "SLEEP", "state": "COMPLETED", "attempts": 1, "maxAttempts": 3,
           "createdAtMillis": 1_700_000_000_000, "updatedAtMillis": 1_700_000_000_000}
    assert "submitter" not in render.job_detail(job, 1_700_000_000_000)
    assert "\nsubmitter ci\n" in render.job_detail(dict(job, submittedBy="ci"), 1_700_000_000_000)


def test_times_past_the_year_9999_are_shown_as_epoch_millis_not_an_error():
    from jobmesh.client import render

    last = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
    for far in (last + 1, 2 ** 62):
        for text in (render.zoned(far, "Europe/Paris"), render.timestamp(far, zone=True), render.when(far, 0)):
            assert "after 9999-12-31: %d ms since 1970" % far in text
    # A zone whose date would pass 9999 shows the time in UTC.
    assert render.zoned(last - 3_600_000, "Pacific/Kiritimati") == "9999-12-31 22:59:59 UTC"
    assert render.zoned(last - 3_600_000, "America/New_York") == "9999-12-31 17:59:59 EST"
    detail = render.schedule_detail({"name": "far", "everyMillis": 2 ** 40, "timezone": "UTC",
                                     "recentJobs": [{"jobId": "j", "scheduledFor": last + 5, "state": None}]},
                                    [last - 5, last + 2 ** 40], 0)
    assert "9999-12-31 23:59:59 UTC" in detail and "after 9999-12-31" in detail


# ---- limits -------------------------------------------------------------------------------

LIMIT = {"taskType": "EXPORT", "maxRunning": 5, "maxRunningPerKey": 3, "ratePerSecond": 10.0, "burst": 10,
         "ratePerKeyPerSecond": None, "paused": False, "running": 5, "queued": 12}


def held_job(reason, **over):
    return job(taskType="EXPORT", state="QUEUED", waitingReason=reason, concurrencyKey="acme", **over)


@pytest.mark.parametrize("reason,held,words", [
    ("TYPE_PAUSED", None, "EXPORT is paused (jobmesh resume EXPORT starts its jobs again)"),
    ("CONCURRENCY_LIMIT", render.Held(LIMIT), "5 of 5 EXPORT jobs are running"),
    ("KEY_CONCURRENCY_LIMIT", render.Held(LIMIT, 3), "3 of 3 EXPORT jobs for key acme are running"),
    ("RATE_LIMIT", render.Held(LIMIT), "rate limit: 10 starts a second"),
    ("RATE_LIMIT", render.Held(dict(LIMIT, ratePerSecond=None, ratePerKeyPerSecond=1)),
     "rate limit: 1 start a second for key acme"),
    ("RATE_LIMIT", render.Held(dict(LIMIT, ratePerSecond=0.5, ratePerKeyPerSecond=0.25)),
     "rate limit: 0.5 starts a second, 0.25 starts a second for key acme"),
])
def test_a_job_held_by_a_limit_says_why_with_the_figures(reason, held, words):
    assert render.waiting(held_job(reason), NOW, held=held) == words
    detail = render.job_detail(held_job(reason), NOW, held=held)
    assert "waiting   %s\n" % words in detail


@pytest.mark.parametrize("reason,words", [
    ("CONCURRENCY_LIMIT", "as many EXPORT jobs are running as its limit allows"),
    ("KEY_CONCURRENCY_LIMIT", "as many EXPORT jobs for key acme are running as its limit allows"),
    ("RATE_LIMIT", "rate limit: EXPORT starts as fast as its limit allows"),
])
def test_a_held_job_without_its_limit_at_hand_still_reads_as_words(reason, words):
    assert render.waiting(held_job(reason), NOW) == words


def test_job_detail_shows_the_keys_only_when_set():
    detail = render.job_detail(job(concurrencyKey="acme", uniqueKey="report-7"), NOW)
    assert "keys      concurrency acme, unique report-7\n" in detail
    assert "keys" not in render.job_detail(job(concurrencyKey=None, uniqueKey=None), NOW)
    assert "keys      unique r\n" in render.job_detail(job(uniqueKey="r"), NOW)


def test_limit_table_shows_limits_counts_and_paused_state():
    paused = dict(LIMIT, taskType="MAILER", maxRunning=None, maxRunningPerKey=None, ratePerSecond=None, burst=None,
                  paused=True, running=1, queued=40)
    header, first, second = render.limit_table([LIMIT, paused]).splitlines()
    assert header.split() == ["TYPE", "STATE", "MAX", "RUNNING", "PER", "KEY", "RATE/S", "BURST", "RATE/S", "PER",
                              "KEY", "RUNNING", "QUEUED"]
    assert first.split() == ["EXPORT", "active", "5", "3", "10", "10", "-", "5", "12"]
    assert second.split() == ["MAILER", "PAUSED", "-", "-", "-", "-", "-", "1", "40"]
    assert render.limit_table([]).startswith("no limits")


def test_limit_detail():
    lines = render.limit_detail(LIMIT).splitlines()
    assert lines == ["type      EXPORT", "state     active",
                     "limits    at most 5 running; at most 3 running per key; 10 starts a second (burst 10)",
                     "jobs      5 running, 12 queued"]
    none = render.limit_detail({"taskType": "X", "paused": True, "running": 0, "queued": 2})
    assert "state     PAUSED: no new job starts; running jobs go on" in none and "limits    no limit" in none


def test_duplicate_submit_names_the_live_job_and_key():
    assert render.duplicate("j-9", "report:7") == "job j-9 is already active with unique key report:7; no new job"


def test_job_detail_shows_a_running_jobs_progress_as_a_percentage_and_its_message():
    report = {"fraction": 0.42, "message": "compressing\nchunk 7", "atMillis": NOW}
    out = render.job_detail(job(state="RUNNING", workerId="w-1", result=None, progress=report), NOW)
    assert "\nstate     RUNNING\nprogress  42% compressing chunk 7\n" in out
    # Rounded down, so only a finished report reads 100%; a report without a message is the percentage
    assert render.progress(job(state="RUNNING", progress=dict(report, fraction=0.29, message=None))) == "29%"
    assert render.progress(job(state="RUNNING", progress=dict(report, fraction=0.999))).startswith("99% ")
    assert render.progress(job(state="RUNNING", progress=dict(report, fraction=1))).startswith("100% ")
    # Nothing for a job without a report, one that is not running, or a report that is not one
    for other in (job(state="RUNNING", progress=None), job(state="COMPLETED", progress=report), job(state="RUNNING"),
                  job(state="RUNNING", progress=dict(report, fraction=float("nan")))):
        assert render.progress(other) is None and "progress" not in render.job_detail(other, NOW)
