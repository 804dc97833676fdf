"""Limits from the command line and the blocking library, against one shared coordinator:
limit set/show/list/rm, pause/resume, submit with a concurrency and a unique key, a
duplicate, the waiting reason of each limit in words, and bad input as one line with the
contract's exit codes (README.md, "Limits").

Each test uses task types of its own (declared by a scripted worker of its own), so the
tests share the coordinator without seeing each other's limits or jobs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.client.api import submit_request
from jobmesh.errors import RequestFailed
from jobmesh.protocol import messages as m
from tests.support.waiting import wait_until
from tests.integration.test_schedules import jm, one_json

LIMIT_FIELDS = {"taskType", "maxRunning", "maxRunningPerKey", "ratePerSecond", "burst", "ratePerKeyPerSecond",
                "paused", "running", "queued"}


@pytest.fixture
def coord(module_coordinator):
    return module_coordinator


def held(client, job_id: str, reason: str) -> None:
    """Return once the job is QUEUED with ``reason``."""
    wait_until(lambda: client.status(job_id).get("waitingReason") == reason,
               message="job %s held with %s" % (job_id, reason))


def test_limit_set_show_list_rm_with_running_and_queued_counts(coord, peers):
    worker = peers.worker(coord, "w-export", capacity=4, task_types=["EXPORT_A"])
    # Given a limit of at most 1 running EXPORT_A, set from the command line
    out = jm(coord, "limit", "set", "EXPORT_A", "--max-running=1", "--max-running-per-key=1", "--rate=10",
             "--burst=20", "--rate-per-key=0.5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "limits of EXPORT_A set"
    assert ("limits    at most 1 running; at most 1 running per key; 10 starts a second (burst 20); "
            "0.5 starts a second per key") in out.stdout
    # When two jobs are submitted, one runs and one waits
    with CoordinatorClient(*coord.client_addr) as client:
        first = client.submit("EXPORT_A", {}, concurrency_key="a")
        second = client.submit("EXPORT_A", {}, concurrency_key="b")
        worker.await_assign()
        held(client, second, "CONCURRENCY_LIMIT")
    # Then show and list say so, in text and in JSON
    shown = one_json(jm(coord, "limit", "show", "EXPORT_A", "--json"))
    assert set(shown) == LIMIT_FIELDS
    assert (shown["maxRunning"], shown["maxRunningPerKey"], shown["ratePerSecond"], shown["burst"],
            shown["ratePerKeyPerSecond"], shown["paused"], shown["running"], shown["queued"]) == (
        1, 1, 10, 20, 0.5, False, 1, 1)
    text = jm(coord, "limit", "show", "EXPORT_A").stdout
    assert "state     active\n" in text and "jobs      1 running, 1 queued\n" in text
    listed = one_json(jm(coord, "limit", "list", "--json"))
    assert [lim for lim in listed if lim["taskType"] == "EXPORT_A"] == [shown]
    table = jm(coord, "limit", "list").stdout.splitlines()
    assert table[0].split()[:2] == ["TYPE", "STATE"]
    (row,) = [line for line in table if line.startswith("EXPORT_A ")]
    assert row.split() == ["EXPORT_A", "active", "1", "1", "10", "20", "0.5", "1", "1"]
    # rm removes the limit and the held job runs
    out = jm(coord, "limit", "rm", "EXPORT_A")
    assert out.returncode == 0 and "limits of EXPORT_A removed" in out.stdout, out.stderr
    worker.await_assign()
    with CoordinatorClient(*coord.client_addr) as client:
        assert client.limits.get("EXPORT_A")["maxRunning"] is None
        assert {client.status(j)["state"] for j in (first, second)} == {"RUNNING"}
    assert not [lim for lim in one_json(jm(coord, "limit", "list", "--json")) if lim["taskType"] == "EXPORT_A"]


def test_pause_and_resume_and_the_waiting_words(coord, peers):
    worker = peers.worker(coord, "w-mailer", capacity=2, task_types=["MAILER_P"])
    out = jm(coord, "pause", "MAILER_P")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MAILER_P paused: no new job of it starts")
    assert "state     PAUSED" in out.stdout
    # A submit is accepted and waits; status says why in words
    job_id = one_json(jm(coord, "submit", "MAILER_P", "{}", "--json"))["jobId"]
    with CoordinatorClient(*coord.client_addr) as client:
        held(client, job_id, "TYPE_PAUSED")
    status = jm(coord, "status", job_id)
    assert "waiting   MAILER_P is paused (jobmesh resume MAILER_P starts its jobs again)\n" in status.stdout
    (row,) = [line for line in jm(coord, "limit", "list").stdout.splitlines() if line.startswith("MAILER_P ")]
    assert row.split()[1] == "PAUSED"
    assert one_json(jm(coord, "resume", "MAILER_P", "--json"))["paused"] is False
    assert worker.await_assign()["jobId"] == job_id


def test_status_says_in_words_what_each_limit_waits_on(coord, peers):
    peers.worker(coord, "w-words", capacity=8, task_types=["EXPORT_W", "EXPORT_K", "PARTNER_R"])
    with CoordinatorClient(*coord.client_addr) as client:
        client.limits.put("EXPORT_W", max_running=1)
        client.limits.put("EXPORT_K", max_running_per_key=1)
        client.limits.put("PARTNER_R", rate_per_second=0.001)
        client.submit("EXPORT_W", {})
        over = client.submit("EXPORT_W", {})
        client.submit("EXPORT_K", {}, concurrency_key="acme")
        same_key = client.submit("EXPORT_K", {}, concurrency_key="acme")
        client.submit("PARTNER_R", {})
        rated = client.submit("PARTNER_R", {})
        for job_id, reason in ((over, "CONCURRENCY_LIMIT"), (same_key, "KEY_CONCURRENCY_LIMIT"),
                               (rated, "RATE_LIMIT")):
            held(client, job_id, reason)
    assert "waiting   1 of 1 EXPORT_W jobs are running\n" in jm(coord, "status", over).stdout
    text = jm(coord, "status", same_key).stdout
    assert "waiting   1 of 1 EXPORT_K jobs for key acme are running\n" in text
    assert "keys      concurrency acme\n" in text
    assert "waiting   rate limit: 0.001 starts a second\n" in jm(coord, "status", rated).stdout
    snapshot = one_json(jm(coord, "status", same_key, "--json"))
    assert (snapshot["waitingReason"], snapshot["concurrencyKey"], snapshot["uniqueKey"]) == (
        "KEY_CONCURRENCY_LIMIT", "acme", None)


def test_a_unique_key_makes_one_job_while_it_is_active(coord, peers):
    worker = peers.worker(coord, "w-report", capacity=1, task_types=["REPORT_U"])
    first = jm(coord, "submit", "REPORT_U", '{"day": 5}', "--unique-key=report:5", "--concurrency-key=acme")
    assert first.returncode == 0, first.stderr
    job_id = first.stdout.split()[-1]
    again = jm(coord, "submit", "REPORT_U", '{"day": 5}', "--unique-key=report:5")
    assert again.returncode == 0, again.stderr
    assert again.stdout == "job %s is already active with unique key report:5; no new job\n" % job_id
    assert one_json(jm(coord, "submit", "REPORT_U", "{}", "--unique-key=report:5", "--json")) == {
        "jobId": job_id, "duplicate": True}
    snapshot = one_json(jm(coord, "status", job_id, "--json"))
    assert (snapshot["uniqueKey"], snapshot["concurrencyKey"]) == ("report:5", "acme")
    assert "keys      concurrency acme, unique report:5\n" in jm(coord, "status", job_id).stdout
    # Once the job has ended, the key is free again
    worker.complete(worker.await_assign(), {})
    with CoordinatorClient(*coord.client_addr) as client:
        client.wait(job_id, timeout=10)
        reply = client.send_submit(submit_request("REPORT_U", {}, unique_key="report:5"))
        assert not reply.duplicate and reply.job_id != job_id
        assert client.submit("REPORT_U", {}, unique_key="report:5") == reply.job_id


@pytest.mark.parametrize("args,message", [
    (["limit", "set", "EXPORT_E", "--max-running=-1"], "--max-running must be >= 0, got -1"),
    (["limit", "set", "EXPORT_E", "--max-running-per-key=two"], "--max-running-per-key must be an integer"),
    (["limit", "set", "EXPORT_E", "--rate=0"], "--rate must be a number of starts a second above 0"),
    (["limit", "set", "EXPORT_E", "--rate-per-key=fast"], "--rate-per-key must be a number of starts a second"),
    (["limit", "set", "EXPORT_E", "--burst=5"], "--burst is the bucket of --rate: give --rate too"),
    (["limit", "set", "EXPORT_E", "--rate=2", "--burst=0"], "--burst must be >= 1, got 0"),
    (["limit", "set", "EXPORT_E"], "give at least one of --max-running=..."),
    (["submit", "SLEEP", "--unique-key="], "--unique-key must be 1-256 characters"),
    (["submit", "SLEEP", "--concurrency-key=" + "k" * 257], "--concurrency-key must be 1-256 characters"),
    (["limit", "show"], "jobmesh limit: missing, unknown or misplaced arguments"),
    (["pause"], "jobmesh pause: missing, unknown or misplaced arguments"),
])
def test_bad_input_is_one_line_and_exit_2(coord, args, message):
    out = jm(coord, *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_what_the_coordinator_refuses_is_one_line_and_exit_1(coord):
    out = jm(coord, "limit", "set", "NO_SUCH_TYPE_X", "--max-running=1")
    assert out.returncode == 1 and out.stderr.startswith("jobmesh limit: the coordinator refused: "), out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    out = jm(coord, "pause", "NO_SUCH_TYPE_X")
    assert out.returncode == 1 and out.stderr.startswith("jobmesh pause: the coordinator refused: "), out.stderr
    # a count past what a limit holds is refused in words that say which counts it takes
    out = jm(coord, "limit", "set", "SLEEP", "--max-running-per-key=99999999999")
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "maxRunningPerKey must be an integer from 0 to 2147483647 or null, got 99999999999" in out.stderr


def test_the_library_puts_gets_lists_pauses_and_deletes(coord, peers):
    peers.worker(coord, "w-lib", capacity=1, task_types=["LIB_T"])
    with CoordinatorClient(*coord.client_addr) as client:
        limit = client.limits.put("LIB_T", max_running=3, rate_per_second=2.5)
        assert set(limit) == LIMIT_FIELDS
        assert (limit["maxRunning"], limit["ratePerSecond"], limit["burst"], limit["paused"]) == (3, 2.5, 3, False)
        assert client.limits.pause("LIB_T")["paused"] is True
        # put keeps the pause unless told
        assert client.limits.put("LIB_T", max_running=4)["paused"] is True
        assert client.limits.put("LIB_T", max_running=4, paused=False)["paused"] is False
        assert client.limits.resume("LIB_T")["paused"] is False
        assert client.limits.get("LIB_T")["maxRunning"] == 4
        assert [lim["maxRunning"] for lim in client.limits.list() if lim["taskType"] == "LIB_T"] == [4]
        assert client.limits.delete("LIB_T")["maxRunning"] == 4
        assert client.limits.get("LIB_T")["maxRunning"] is None
        with pytest.raises(RequestFailed):
            client.limits.put("LIB_T", max_running=-1)
        with pytest.raises(TypeError, match="maxRunning must be an int"):
            client.limits.put("LIB_T", max_running="3")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ratePerSecond must be a number"):
            client.limits.put("LIB_T", rate_per_second=True)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="finite"):
            client.limits.put("LIB_T", rate_per_second=float("inf"))
        assert client.limits.get("LIB_T")["maxRunning"] is None  # nothing was changed
        # a limit object as read (with its running and queued counts) may be put back changed
        read = client.limits.put("LIB_T", max_running=2, max_running_per_key=1)
        back = client.request(m.LimitPut(dict(read, maxRunning=5)), m.Limit).limit
        assert (back["maxRunning"], back["maxRunningPerKey"], back["running"], back["queued"]) == (5, 1, 0, 0)
        assert client.limits.delete("LIB_T")["maxRunning"] == 5



def test_the_readme_examples_are_one_command_each_and_do_what_they_say(coord, peers):
    # Given the five commands of the README's "Limits" section, and a worker of their types
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Limits"):readme.index("## Periodic clients")]
    commands = [shlex.split(line.strip()) for line in section.splitlines() if line.startswith("    jobmesh ")]
    assert [c[:3] for c in commands] == [["jobmesh", "limit", "set"], ["jobmesh", "limit", "set"],
                                         ["jobmesh", "limit", "set"], ["jobmesh", "pause", "MAILER"],
                                         ["jobmesh", "submit", "REPORT"]]
    worker = peers.worker(coord, "w-readme", capacity=1, task_types=["EXPORT", "PARTNER_API", "MAILER", "REPORT"])
    with CoordinatorClient(*coord.client_addr) as client:
        # When each runs, then it does what the README says
        effects = [("EXPORT", "maxRunning", 5), ("EXPORT", "maxRunningPerKey", 2),
                   ("PARTNER_API", "ratePerSecond", 10), ("MAILER", "paused", True)]
        for argv, (task_type, field, value) in zip(commands, effects):
            out = jm(coord, *argv[1:])
            assert out.returncode == 0, out.stderr
            assert client.limits.get(task_type)[field] == value
        first = jm(coord, *commands[4][1:])
        assert first.returncode == 0, first.stderr
        job_id = first.stdout.split()[-1]
        worker.await_assign()
        again = jm(coord, *commands[4][1:])
        assert again.stdout.startswith("job %s is already active with unique key report:2026-12-05" % job_id)
        for task_type in ("EXPORT", "PARTNER_API", "MAILER"):
            client.limits.delete(task_type)
