"""Recurring schedules against real coordinators: the CLI's subcommands and exit codes, the
library's ``client.schedules``, and firing exactly once per fire time while the
coordinator is killed (SIGKILL) around fire times under load."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pytest

from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import ClientError, RequestFailed
from tests.support.faulty_store import ENTRY, FAULT_FILE_ENV
from tests.pg_support import on_both_stores
from tests.support.cli import run_cli
from tests.support.peers import Client
from tests.support.processes import CoordinatorProc, child_env
from tests.support.waiting import wait_until


USER_TASKS = Path(__file__).resolve().parent.parent / "user_tasks_module.py"


def jm(coord, *args, **kwargs):
    return run_cli(*args, coordinator=coord.client_target, **kwargs)


def one_json(result):
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1, result.stdout
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One coordinator with its metrics port, for the tests that need nothing of their own
    (each uses its own schedule names)."""
    proc = CoordinatorProc(tmp_path_factory.mktemp("schedules"), metrics_port=0)
    proc.start()
    yield proc
    proc.cleanup()


def schedule_names(coord) -> list[str]:
    return [s["name"] for s in one_json(jm(coord, "schedule", "list", "--json"))]


def test_from_preview_to_a_nightly_schedule_with_the_cli(shared_on_store):
    coordinator = shared_on_store  # the schedules of other tests are there too: lists are compared with before
    before = schedule_names(coordinator)
    # preview: the next fire times of an expression, in its zone, before saving anything
    r = jm(coordinator, "schedule", "preview", "--cron=30 2 * * *", "--tz=Europe/Paris",
           "--from=2026-10-24T12:00:00Z", "--count=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("2026-10-25 02:30:00 CEST")
    assert r.stdout.splitlines()[1].startswith("2026-10-26 02:30:00 CET")
    times = one_json(jm(coordinator, "schedule", "preview", "--every-millis=1000", "--from=2026-01-01T00:00:00Z",
                        "--count=3", "--json"))
    assert times == [1767225601000, 1767225602000, 1767225603000]

    # add, list, show
    r = jm(coordinator, "schedule", "add", "nightly", "--cron=0 3 * * *", "--tz=Europe/Paris", "sleep",
           '{"durationMillis": 1}')
    assert r.returncode == 0 and "schedule nightly saved; next fire" in r.stdout, r.stderr
    listed = [s for s in one_json(jm(coordinator, "schedule", "list", "--json")) if s["name"] not in before]
    assert [s["name"] for s in listed] == ["nightly"]
    assert listed[0]["cron"] == "0 3 * * *" and listed[0]["timezone"] == "Europe/Paris"
    assert listed[0]["taskType"] == "SLEEP" and listed[0]["nextFireMillis"] is not None
    r = jm(coordinator, "schedule", "list")
    assert r.returncode == 0 and "nightly" in r.stdout and "NEXT FIRE" in r.stdout
    shown = one_json(jm(coordinator, "schedule", "show", "nightly", "--json"))
    assert len(shown["nextFireTimes"]) == 5 and shown["nextFireTimes"][0] == shown["nextFireMillis"]
    r = jm(coordinator, "schedule", "show", "nightly")
    assert r.returncode == 0 and "next fire times:" in r.stdout and r.stdout.count("03:00:00 CE") == 5

    # trigger: a job now, which names its schedule
    job_id = one_json(jm(coordinator, "schedule", "trigger", "nightly", "--json"))["jobId"]
    job = one_json(jm(coordinator, "status", job_id, "--json"))
    assert job["scheduleName"] == "nightly" and isinstance(job["scheduledFor"], int)
    r = jm(coordinator, "status", job_id)
    assert "schedule  nightly, fire time" in r.stdout
    shown = one_json(jm(coordinator, "schedule", "show", "nightly", "--json"))
    assert shown["recentJobs"][-1]["jobId"] == job_id and shown["lastJobId"] == job_id

    # pause, resume, rm
    assert one_json(jm(coordinator, "schedule", "pause", "nightly", "--json"))["paused"] is True
    r = jm(coordinator, "schedule", "resume", "nightly")
    assert r.returncode == 0 and "resumed" in r.stdout
    assert one_json(jm(coordinator, "schedule", "rm", "nightly", "--json"))["name"] == "nightly"
    assert schedule_names(coordinator) == before
    assert one_json(jm(coordinator, "status", job_id, "--json"))["jobId"] == job_id  # its jobs stay


def test_schedule_errors_are_one_line_with_the_contracts_exit_codes(shared_on_store):
    coordinator = shared_on_store
    before = schedule_names(coordinator)
    cases = [
        (("schedule", "add", "x", "--cron=61 * * * *", "SLEEP"), 1, "bad cron"),
        (("schedule", "add", "x", "--cron=@daily", "--tz=Mars/Olympus", "SLEEP"), 1, "unknown time zone"),
        (("schedule", "add", "x", "--every-millis=5000", "NO_SUCH_TYPE"), 1, "unknown task type"),
        (("schedule", "show", "nope"), 1, "unknown schedule 'nope'"),
        (("schedule", "trigger", "nope"), 1, "unknown schedule 'nope'"),
        (("schedule", "add", "x", "SLEEP"), 2, "Usage"),
        (("schedule", "add", "x", "--every-millis=5000", "SLEEP", "--missed=sometimes"), 2, "--missed must be"),
        (("schedule", "add", "x", "--every-millis=10", "SLEEP"), 2, "--every-millis must be >= 1000"),
        (("schedule", "preview", "--cron=@daily", "--count=0"), 2, "--count must be >= 1"),
        (("schedule", "preview", "--cron=@daily", "--from=yesterday"), 2, "--from must be"),
    ]
    for argv, code, words in cases:
        r = jm(coordinator, *argv)
        assert r.returncode == code, (argv, r.returncode, r.stderr)
        assert words in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    assert schedule_names(coordinator) == before


@on_both_stores
def test_the_library_puts_lists_triggers_and_previews(shared_on_store):
    with CoordinatorClient(shared_on_store.client_target) as client:
        before = [s["name"] for s in client.schedules.list()]
        made = client.schedules.put("health", "SLEEP", {"durationMillis": 1}, every=30, jitter=2, missed="skip")
        assert made["everyMillis"] == 30_000 and made["jitterMillis"] == 2000 and made["missed"] == "skip"
        assert [s["name"] for s in client.schedules.list() if s["name"] not in before] == ["health"]
        job_id = client.schedules.trigger("health")
        assert client.status(job_id)["scheduleName"] == "health"
        times = client.schedules.preview(cron="30 2 * * *", timezone="Europe/Paris",
                                         start=datetime(2026, 10, 24, 12, tzinfo=timezone.utc), count=2)
        assert [t.isoformat() for t in times] == ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]
        assert client.schedules.pause("health")["nextFireMillis"] is None
        assert client.schedules.delete("health")["name"] == "health"
        try:
            client.schedules.get("health")
        except RequestFailed as exc:
            assert "unknown schedule" in exc.message
        else:
            raise AssertionError("a deleted schedule was found")


def test_no_fire_time_makes_two_jobs_across_kill_9_under_load(tmp_path):
    # Given schedules firing every second that make a job for every fire time (missed=all,
    # overlap=allow), and a client submitting jobs all along
    coord = CoordinatorProc(tmp_path, name="crash").start()
    names = ["s%d" % i for i in range(4)]
    with CoordinatorClient(coord.client_target) as client:
        for name in names:
            client.schedules.put(name, "SLEEP", {"durationMillis": 1}, every=1, missed="all", overlap="allow")
    stop = threading.Event()
    target = {"addr": coord.client_target}

    def load():
        while not stop.is_set():
            try:
                with CoordinatorClient(target["addr"], timeout=2, connect_timeout=1) as c:
                    while not stop.is_set():
                        c.submit("SLEEP", {"durationMillis": 1})
            except ClientError:
                time.sleep(0.05)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    rng = random.Random(7)
    try:
        # When the coordinator is killed (SIGKILL) a few times, at varying offsets around fire
        # times, and restarted on the same database
        for _cycle in range(4):
            time.sleep(1.0 + rng.random() * 1.5)
            coord.kill()
            coord.start()
            target["addr"] = coord.client_target
        time.sleep(1.5)
    finally:
        stop.set()
        loader.join(10)
    # Then every fire time of every schedule has at most one job, on the fire-time grid
    with CoordinatorClient(coord.client_target) as client:
        for name in names:  # no fire between the counts read below and the jobs listed after them
            client.schedules.pause(name)
        schedules = {s["name"]: s for s in client.schedules.list()}
        fired = [j for j in client.iter_jobs(page_size=1000) if j.get("scheduleName") is not None]
    counts = Counter((j["scheduleName"], j["scheduledFor"]) for j in fired)
    assert counts and max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]
    for (name, fire), _n in counts.items():
        created = schedules[name]["createdAtMillis"]
        assert (fire - created) % 1000 == 0 and fire > created
    for name in names:  # jobs made = fires counted (the count commits with the jobs)
        assert schedules[name]["firedCount"] == sum(1 for (n, _f) in counts if n == name)
    coord.cleanup()


@on_both_stores
def test_a_schedule_fires_on_a_live_coordinator_and_its_job_runs(live):
    with CoordinatorClient(live.client_target) as client:
        client.schedules.put("tick", "SLEEP", {"durationMillis": 1}, every=1)
        job = wait_until(lambda: next((j for j in client.iter_jobs() if j.get("scheduleName") == "tick"), None),
                         timeout=20, message="a fired job")
        done = client.wait(job["jobId"], timeout=20)
        assert done["state"] == "COMPLETED" and done["scheduledFor"] % 1000 == client.schedules.get(
            "tick")["createdAtMillis"] % 1000


NIGHTLY = """
[nightly-report]
cron = "0 3 * * *"
timezone = "Europe/Paris"
task_type = "SLEEP"
payload = { durationMillis = 1 }

[health-check]
every_millis = 30000
taskType = "SLEEP"
payload = { durationMillis = 2 }
"""


@on_both_stores
def test_the_schedules_file_is_applied_at_start_and_on_sighup(coordinator_factory, tmp_path):
    # Given a coordinator started with a schedules file, and a schedule made through the API
    path = tmp_path / "schedules.toml"
    path.write_text(NIGHTLY)
    coord = coordinator_factory(schedules=str(path))
    with CoordinatorClient(coord.client_target) as client:
        listed = {s["name"]: s for s in client.schedules.list()}
        assert set(listed) == {"nightly-report", "health-check"}
        assert listed["nightly-report"]["timezone"] == "Europe/Paris" and listed["health-check"]["origin"] == "file"
        client.schedules.put("by-hand", "SLEEP", {"durationMillis": 1}, every=60)
        client.schedules.pause("nightly-report")
        # When the file changes (one schedule dropped, one changed) and SIGHUP arrives
        path.write_text(NIGHTLY.split("[health-check]")[0].replace('"0 3 * * *"', '"15 4 * * *"'))
        coord.proc.send_signal(signal.SIGHUP)
        # Then the file's schedules follow it, and the API's are left alone
        wait_until(lambda: {s["name"] for s in client.schedules.list()} == {"nightly-report", "by-hand"},
                   timeout=20, message="the file applied")
        nightly = client.schedules.get("nightly-report")
        assert nightly["cron"] == "15 4 * * *"
        # and the one paused over the wire stays paused
        assert nightly["paused"] is True and nightly["nextFireMillis"] is None
        # A file with an error is logged and changes nothing
        path.write_text('[broken]\ncron = "99 * * * *"\ntask_type = "SLEEP"\npayload = { durationMillis = 1 }\n')
        coord.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "schedules file not applied" in coord.stderr(), timeout=20, message="the error logged")
        assert {s["name"] for s in client.schedules.list()} == {"nightly-report", "by-hand"}
        path.write_text("not = [toml")
        coord.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: coord.stderr().count("schedules file not applied") == 2, timeout=20,
                   message="the TOML error logged")
        assert coord.proc.poll() is None


def test_a_bad_schedules_file_at_start_is_a_one_line_error_and_exit_2(tmp_path):
    path = tmp_path / "schedules.toml"
    for text, words in (("[x]\nevery_millis = 5000\ntask_type = 'SLEEP'\ncolour = 'red'\n", "unknown key 'colour'"),
                        ("[x]\ncron = '0 3 * *'\ntask_type = 'SLEEP'\n", "five fields"),
                        ("[x\n", "not valid TOML")):
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "jobmesh", "coordinator", "--worker-port=0", "--client-port=0",
                               "--db=%s" % (tmp_path / "db"), "--schedules=%s" % path],
                              capture_output=True, text=True, timeout=60, env=child_env())
        assert proc.returncode == 2, (proc.returncode, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len([line for line in lines if "ERROR" in line]) == 1 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "listening" not in proc.stdout


def test_the_dashboard_metrics_and_top_show_schedules(coordinator_factory):
    coord = coordinator_factory(metrics_port=0)
    with CoordinatorClient(coord.client_target) as client:
        client.schedules.put("tick", "SLEEP", {"durationMillis": 1}, every=1, overlap="allow")
        client.schedules.put("nightly", "SLEEP", {"durationMillis": 1}, cron="0 3 * * *", timezone="Europe/Paris")
        wait_until(lambda: client.schedules.get("tick")["firedCount"] >= 1, timeout=20, message="a fire")
    # The dashboard's JSON lists every schedule with its next fire, last job and counts.
    with urllib.request.urlopen(coord.metrics_url + "/api/schedules", timeout=10) as response:
        listed = {s["name"]: s for s in json.loads(response.read())["schedules"]}
    assert set(listed) == {"nightly", "tick"}
    assert listed["tick"]["lastJobId"] and listed["tick"]["lastJobState"] in ("QUEUED", "COMPLETED", "RUNNING")
    assert listed["nightly"]["nextFireMillis"] is not None and listed["nightly"]["firedCount"] == 0
    with urllib.request.urlopen(coord.metrics_url + "/", timeout=10) as response:
        page = response.read().decode()
    assert 'id="schedules"' in page and "#/schedule/" in page  # the list, and a job's link to its schedule
    # The metrics count fires per schedule.
    with urllib.request.urlopen(coord.metrics_url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    fires = [line for line in metrics.splitlines() if line.startswith('jobmesh_schedule_fires_total{schedule="tick"}')]
    assert fires and float(fires[0].split()[-1]) >= 1
    assert "# TYPE jobmesh_schedule_missed_total counter" in metrics
    # top shows the next fires.
    r = jm(coord, "top", "--iterations=1")
    assert r.returncode == 0, r.stderr
    assert "next schedule fires" in r.stdout and "nightly" in r.stdout and "tick" in r.stdout


def test_up_applies_the_schedules_file_and_passes_sighup_on(start_up, tmp_path, monkeypatch):
    # Given jobmesh up on a fresh database with a schedules file firing every second a task
    # type of its --tasks module, which nothing knows until up's own workers declare it
    shutil.copy(USER_TASKS, tmp_path / "jm_user_tasks.py")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    path = tmp_path / "schedules.toml"
    path.write_text('[tick]\nevery_millis = 1000\ntask_type = "GREET"\npayload = { name = "Ada" }\n')
    up = start_up("--workers=1", "--tasks=jm_user_tasks", "--schedules=%s" % path)
    with CoordinatorClient("%s:%d" % up.client_addr) as client:
        # Then its worker runs the fired jobs
        job = wait_until(lambda: next((j for j in client.iter_jobs() if j.get("scheduleName") == "tick"), None),
                         timeout=20, message="a fired job")
        done = client.wait(job["jobId"], timeout=20)
        assert done["state"] == "COMPLETED" and done["result"] == {"greeting": "hello Ada"}
        # And a SIGHUP to up reaches its coordinator, which reads the file again
        path.write_text('[tock]\ncron = "@daily"\ntask_type = "SLEEP"\npayload = { durationMillis = 1 }\n')
        up.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [s["name"] for s in client.schedules.list()] == ["tock"], timeout=20,
                   message="the file applied on SIGHUP")
    assert up.proc.poll() is None


def test_fires_during_a_storage_fault_are_made_once_when_storage_works_again(coordinator_factory, tmp_path,
                                                                              monkeypatch):
    # Given a schedule firing every second, and a database that stops taking writes
    fault = tmp_path / "storage-fault"
    fault.write_text("")
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    monkeypatch.setattr(CoordinatorProc, "ENTRY", (ENTRY,))  # tests/support/faulty_coordinator.py, which reads it
    coord = coordinator_factory()
    with CoordinatorClient(coord.client_target) as client:
        client.schedules.put("tick", "SLEEP", {"durationMillis": 1}, every=1, overlap="allow", missed="all")
        wait_until(lambda: client.schedules.get("tick")["firedCount"] >= 1, timeout=20, message="a first fire")
        fault.write_text("readonly")
        # While it lasts, fires are not committed (their batches fail and memory is reloaded)
        wait_until(lambda: "storage unavailable" in coord.stderr(), timeout=20, message="the outage")
        time.sleep(2.5)
        fault.write_text("")
        wait_until(lambda: "storage works again" in coord.stderr(), timeout=30, message="the end of the outage")
        # Then the fire times of the outage are made (missed=all), each once
        wait_until(lambda: client.schedules.get("tick")["firedCount"] >= 5, timeout=20, message="the catch-up")
        schedule = client.schedules.get("tick")
        fired = [j for j in client.iter_jobs() if j.get("scheduleName") == "tick"]
    times = [j["scheduledFor"] for j in fired]
    assert len(times) == len(set(times)), sorted(times)
    assert schedule["missedCount"] == 0
    assert sorted(times) == [schedule["createdAtMillis"] + k * 1000 for k in range(1, len(times) + 1)]


YEAR_9999 = 253_370_764_800_000  # 9999-01-01T00:00:00Z
SLEEP_1 = {"taskType": "SLEEP", "payload": {"durationMillis": 1}}


def test_a_fire_time_past_the_year_9999_is_an_error_and_far_fire_times_are_shown(shared):
    raw = Client(shared.client_addr)
    try:
        # A schedule whose next fire would be after the year 9999 is an ERROR, and the
        # connection goes on; so is a submit whose run-at time would be.
        for every in (2 ** 62, 2 ** 64):
            reply = raw.request({"type": "SCHEDULE_PUT", "schedule": dict(SLEEP_1, name="huge", everyMillis=every)})
            assert reply["type"] == "ERROR" and "after the year 9999" in reply["message"], reply
        for when in ({"runAtMillis": 2 ** 63}, {"delayMillis": 2 ** 63}):
            reply = raw.submit("SLEEP", {"durationMillis": 1}, **when)
            assert reply["type"] == "ERROR" and "year 10000" in reply["message"], reply
        # A valid schedule whose first fire is in the year 9999 and whose later ones are not
        every = YEAR_9999 + 180 * 86_400_000 - int(time.time() * 1000)
        reply = raw.request({"type": "SCHEDULE_PUT", "schedule": dict(SLEEP_1, name="far", everyMillis=every)})
        assert reply["type"] == "SCHEDULE" and reply["schedule"]["nextFireMillis"] > YEAR_9999, reply
    finally:
        raw.conn.close()
    # The CLI shows it without failing: show, list and preview, as text and as JSON
    r = jm(shared, "schedule", "show", "far")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "9999-" in r.stdout and "after 9999-12-31" in r.stdout, r.stdout
    assert len(one_json(jm(shared, "schedule", "show", "far", "--json"))["nextFireTimes"]) == 5
    r = jm(shared, "schedule", "list")
    assert r.returncode == 0 and "9999-" in r.stdout, r.stderr
    # (the last hours of 9999 there: its local dates end before UTC's)
    r = jm(shared, "schedule", "preview", "--cron=@hourly", "--tz=Pacific/Kiritimati", "--from=9999-12-31T05:00:00Z")
    assert r.returncode == 0 and r.stdout.count("9999-12-31") == 4, (r.stdout, r.stderr)
    # And so does the dashboard's schedules API, and its page
    with urllib.request.urlopen(shared.metrics_url + "/api/schedules", timeout=10) as response:
        listed = {s["name"]: s for s in json.loads(response.read())["schedules"]}
    assert listed["far"]["nextFireMillis"] > YEAR_9999 and "huge" not in listed
    with urllib.request.urlopen(shared.metrics_url + "/", timeout=10) as response:
        assert response.status == 200


def test_every_schedule_reply_on_the_wire_has_the_same_fields(shared):
    raw = Client(shared.client_addr)
    try:
        name = "shape"
        shapes = {"put": raw.request({"type": "SCHEDULE_PUT", "schedule": dict(SLEEP_1, name=name, everyMillis=60_000)})}
        raw.request({"type": "SCHEDULE_TRIGGER", "name": name})
        for kind in ("SCHEDULE_GET", "SCHEDULE_PAUSE", "SCHEDULE_RESUME", "SCHEDULE_DELETE"):
            shapes[kind] = raw.request({"type": kind, "name": name})
        assert all(reply["type"] == "SCHEDULE" for reply in shapes.values()), shapes
        keys = set(shapes["SCHEDULE_GET"]["schedule"])
        assert {"recentJobs", "lastJobState"} <= keys
        assert {kind: set(reply["schedule"]) for kind, reply in shapes.items()} == {kind: keys for kind in shapes}
        raw.request({"type": "SCHEDULE_PUT", "schedule": dict(SLEEP_1, name=name, everyMillis=60_000)})
        listed = raw.request({"type": "SCHEDULE_LIST"})["schedules"]
        assert set(next(s for s in listed if s["name"] == name)) == keys
        raw.request({"type": "SCHEDULE_DELETE", "name": name})
    finally:
        raw.conn.close()
