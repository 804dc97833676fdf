"""Recurring schedules in the core (coordinator/schedules.py), driven by CoreDriver with
plain numbers for time: the policies across a restart, a failed commit at a fire, pause,
overlap, trigger, jitter, admission, wall-clock steps, DST through SCHEDULE_PREVIEW, and
the schedules file. The driver checks after every batch that the store holds exactly the
schedules (and jobs) memory holds."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.protocol import messages as m
from jobmesh.store.base import StorageFault
from jobmesh.store.sqlite import SQLiteStore
from tests.support.faulty_store import FaultySQLiteStore
from tests.unit.core_driver import CoreDriver

T0 = 1_800_000_000_000  # the wall clock at core time 0
MINUTE = 60_000


def at(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp() * 1000)


def driver(store: SQLiteStore | None = None, prefix: str = "a", **cfg: Any) -> CoreDriver:
    d = CoreDriver(store, prefix, **cfg)
    d.core.table.drift = T0
    return d


def put(d: CoreDriver, now: int, **fields: Any) -> dict:
    schedule = {"name": "s", "everyMillis": MINUTE, "taskType": "SLEEP", "payload": {"durationMillis": 1}}
    schedule.update(fields)
    reply = d.request(now, m.SchedulePut(schedule))
    d.end_batch(now)
    assert isinstance(reply, m.Schedule), reply
    return reply.schedule


def sweep(d: CoreDriver, now: int) -> None:
    d.apply(now, ev.SWEEP)
    d.end_batch(now)


def show(d: CoreDriver, name: str = "s", now: int = 0) -> dict:
    reply = d.request(now, m.ScheduleGet(name))
    assert isinstance(reply, m.Schedule), reply
    return reply.schedule


def fired_jobs(d: CoreDriver) -> list[dict]:
    """Every job made by a schedule, oldest first."""
    jobs = d.request(0, m.ListJobs(limit=1000)).jobs
    return [j for j in reversed(jobs) if "scheduleName" in j]


def restart(path: str, now: int, **cfg: Any) -> tuple[CoreDriver, dict]:
    """A new core on the same database, recovered at core time ``now`` (its rows committed)."""
    d = driver(SQLiteStore(path), prefix="b", **cfg)
    stats = d.core.recover(now)
    d.end_batch(now)
    return d, stats


# ---- fire times and the jobs they make ----------------------------------------------------


def test_an_interval_schedule_fires_once_per_fire_time_with_its_name_key_and_detail():
    # Given a schedule every minute, created at T0
    d = driver()
    created = put(d, 0)
    assert created["createdAtMillis"] == T0 and created["nextFireMillis"] == T0 + MINUTE
    # When sweeps run before, at and after its first two fire times
    for now in (30_000, MINUTE, MINUTE + 500, 2 * MINUTE + 10):
        sweep(d, now)
        d.request(now, m.CancelJob(show(d)["lastJobId"] or "none"))  # the last job ends: no overlap
        d.end_batch(now)
    # Then each fire time made exactly one job, keyed and labelled by the schedule
    jobs = fired_jobs(d)
    assert [j["scheduledFor"] for j in jobs] == [T0 + MINUTE, T0 + 2 * MINUTE]
    assert all(j["scheduleName"] == "s" for j in jobs)
    state = show(d)
    assert state["firedCount"] == 2 and state["lastFireMillis"] == T0 + 2 * MINUTE
    assert state["lastJobId"] == jobs[-1]["jobId"] and state["nextFireMillis"] == T0 + 3 * MINUTE
    stored = d.store.get(jobs[0]["jobId"])
    assert stored is not None and stored.idempotency_key == "schedule:s:%d" % (T0 + MINUTE)
    events = d.request(0, m.GetJobEvents(jobs[0]["jobId"])).events
    assert events[0]["event"] == "SUBMITTED" and "schedule s" in events[0]["detail"]


def test_a_job_not_made_by_a_schedule_keeps_its_exact_snapshot_fields():
    d = driver()
    reply = d.request(0, m.SubmitJob("SLEEP", {"durationMillis": 1}))
    d.end_batch(0)
    job = d.request(0, m.GetJobStatus(reply.job_id)).job
    assert "scheduleName" not in job and "scheduledFor" not in job


def test_a_submit_may_not_take_a_schedules_idempotency_key():
    d = driver()
    reply = d.request(0, m.SubmitJob("SLEEP", {"durationMillis": 1}, idempotency_key="schedule:s:1"))
    assert isinstance(reply, m.Error) and "recurring schedules" in reply.message
    assert d.core.active_count == 0


@pytest.mark.parametrize("policy, made, missed", [("latest", [3], 2), ("all", [1, 2, 3], 0), ("skip", [], 3)])
def test_fire_times_passed_while_down_follow_the_missed_policy(tmp_path, policy, made, missed):
    # Given a schedule every minute, and a coordinator that stops before its first fire
    path = str(tmp_path / "db")
    d = driver(SQLiteStore(path))
    put(d, 0, missed=policy)
    # When it starts again after three fire times passed
    d2, _ = restart(path, 3 * MINUTE + 30_000)
    # Then the policy decides which of them made jobs, in order, and counts the rest
    assert list(d2.core.schedules.by_name) == ["s"]
    assert [j["scheduledFor"] for j in fired_jobs(d2)] == [T0 + k * MINUTE for k in made]
    state = show(d2)
    assert state["missedCount"] == missed and state["firedCount"] == len(made)
    assert state["nextFireMillis"] == T0 + 4 * MINUTE
    assert d2.core.metrics().schedule_misses.get("s", 0) == missed


def test_only_fire_times_inside_the_catch_up_window_count(tmp_path):
    path = str(tmp_path / "db")
    put(driver(SQLiteStore(path)), 0, missed="all", catchupWindowMillis=2 * MINUTE - 1)
    d2, _ = restart(path, 5 * MINUTE)
    assert [j["scheduledFor"] for j in fired_jobs(d2)] == [T0 + 4 * MINUTE, T0 + 5 * MINUTE]
    assert show(d2)["missedCount"] == 3


def test_a_commit_that_fails_at_the_fire_instant_makes_no_job_and_recovery_makes_exactly_one(tmp_path):
    # Given a schedule, committed
    path, fault = str(tmp_path / "db"), tmp_path / "fault"
    d = driver(FaultySQLiteStore(path, "FULL", str(fault)))
    put(d, 0)
    # When the batch holding its first fire cannot be committed
    fault.write_text("readonly")
    d.apply(MINUTE, ev.SWEEP)
    d.core.end_batch(MINUTE)
    with pytest.raises(StorageFault):
        d.store.write(d.core.take_dirty())
    # Then the database holds no job and the schedule has not advanced
    fault.write_text("")
    reader = SQLiteStore(path)
    assert list(reader.load_active()) == []
    assert '"cursorMillis":%d' % T0 in dict(reader.load_schedules())["s"]
    # And the reload (a recovery, as the runtime does after a failed commit) makes exactly one
    d2, _ = restart(path, MINUTE + 200)
    assert [j["scheduledFor"] for j in fired_jobs(d2)] == [T0 + MINUTE]
    assert show(d2)["missedCount"] == 0
    sweep(d2, MINUTE + 400)
    assert len(fired_jobs(d2)) == 1


def test_pause_stops_fires_and_resume_fires_nothing_for_the_times_that_passed():
    d = driver()
    put(d, 0, overlap="allow")
    paused = d.request(1000, m.SchedulePause("s")).schedule
    d.end_batch(1000)
    assert paused["paused"] is True and paused["nextFireMillis"] is None
    for now in (MINUTE, 2 * MINUTE, 3 * MINUTE):
        sweep(d, now)
    assert fired_jobs(d) == []
    resumed = d.request(3 * MINUTE + 5000, m.ScheduleResume("s")).schedule
    d.end_batch(3 * MINUTE + 5000)
    assert resumed["paused"] is False and resumed["nextFireMillis"] == T0 + 4 * MINUTE
    sweep(d, 3 * MINUTE + 6000)
    assert fired_jobs(d) == []
    sweep(d, 4 * MINUTE)
    assert [j["scheduledFor"] for j in fired_jobs(d)] == [T0 + 4 * MINUTE]
    assert show(d)["missedCount"] == 0


def test_overlap_skip_counts_a_fire_whose_last_job_has_not_ended_and_allow_makes_it():
    d = driver()
    put(d, 0)
    put(d, 0, name="t", overlap="allow")
    for now in (MINUTE, 2 * MINUTE, 3 * MINUTE):
        sweep(d, now)
    by_schedule: dict[str, list[int]] = {}
    for job in fired_jobs(d):
        by_schedule.setdefault(job["scheduleName"], []).append(job["scheduledFor"])
    assert by_schedule == {"s": [T0 + MINUTE], "t": [T0 + k * MINUTE for k in (1, 2, 3)]}
    assert show(d, "s")["skippedCount"] == 2 and show(d, "t")["skippedCount"] == 0
    assert d.core.metrics().schedule_skips == {"s": 2}


def test_trigger_makes_a_job_now_outside_the_overlap_rule():
    d = driver()
    put(d, 0)
    sweep(d, MINUTE)
    reply = d.request(MINUTE + 1234, m.ScheduleTrigger("s"))
    d.end_batch(MINUTE + 1234)
    assert isinstance(reply, m.JobSubmitted)
    job = d.request(0, m.GetJobStatus(reply.job_id)).job
    assert job["scheduleName"] == "s" and job["scheduledFor"] == T0 + MINUTE + 1234
    assert len(fired_jobs(d)) == 2
    again = d.request(MINUTE + 1234, m.ScheduleTrigger("s"))  # the same millisecond: the same job
    assert again == reply
    assert isinstance(d.request(0, m.ScheduleTrigger("nope")), m.Error)


def test_jitter_delays_the_job_by_a_hash_of_name_and_fire_time(tmp_path):
    path = str(tmp_path / "db")
    d = driver(SQLiteStore(path))
    put(d, 0, jitterMillis=30_000)
    sweep(d, MINUTE)
    job = fired_jobs(d)[0]
    delay = job["runAtMillis"] - job["scheduledFor"]
    assert 0 <= delay < 30_000
    if delay:
        assert job["state"] == "SCHEDULED"
    # The same fire after a failed commit or a restart gets the same run-at time.
    d2 = driver(SQLiteStore(path), prefix="b")
    d2.core.table.drift = T0
    d2.core.recover(MINUTE)
    d2.end_batch(MINUTE)
    assert fired_jobs(d2)[0]["runAtMillis"] == job["scheduledFor"] + delay


def test_a_full_admission_holds_fires_back_and_then_the_missed_policy_applies():
    d = driver(max_active_jobs=1)
    put(d, 0, overlap="allow")
    blocker = d.request(0, m.SubmitJob("SLEEP", {"durationMillis": 1}))
    d.end_batch(0)
    for now in (MINUTE, 2 * MINUTE):
        sweep(d, now)
    assert fired_jobs(d) == [] and show(d)["nextFireMillis"] == T0 + MINUTE
    d.request(2 * MINUTE + 1, m.CancelJob(blocker.job_id))
    d.end_batch(2 * MINUTE + 1)
    sweep(d, 2 * MINUTE + 2)
    assert [j["scheduledFor"] for j in fired_jobs(d)] == [T0 + 2 * MINUTE]
    assert show(d)["missedCount"] == 1


def test_a_wall_clock_step_back_never_fires_a_time_twice():
    d = driver()
    put(d, 0, overlap="allow")
    sweep(d, MINUTE)
    # The wall clock steps back an hour; the core keeps running through the next hour.
    hour = 60 * MINUTE
    now = MINUTE
    while now < hour + 3 * MINUTE:
        now += 10_000
        d.core.observe_wall(now, now + T0 - hour)
        sweep(d, now)
    fires = [j["scheduledFor"] for j in fired_jobs(d)]
    assert len(fires) == len(set(fires)) and fires[0] == T0 + MINUTE
    assert fires[1:] == [T0 + k * MINUTE for k in range(2, len(fires) + 1)]
    assert max(fires) <= now + T0 - hour


def test_a_wall_clock_step_forward_follows_the_missed_policy():
    d = driver()
    put(d, 0)
    d.core.observe_wall(1000, 1000 + T0 + 10 * MINUTE + 30_000)  # ten fire times jumped over
    sweep(d, 1000)
    assert [j["scheduledFor"] for j in fired_jobs(d)] == [T0 + 10 * MINUTE]
    assert show(d)["missedCount"] == 9


# ---- requests -----------------------------------------------------------------------------


@pytest.mark.parametrize("fields, words", [
    ({"cron": "* * *", "everyMillis": None}, "five fields"),
    ({"cron": "61 * * * *", "everyMillis": None}, "bad cron"),
    ({"cron": "@daily", "everyMillis": None, "timezone": "Mars/Olympus"}, "unknown time zone"),
    ({"cron": "@daily"}, "exactly one"),
    ({"everyMillis": None}, "exactly one"),
    ({"everyMillis": 999}, "at least 1000"),
    ({"taskType": "NO_SUCH_TYPE"}, "unknown task type"),
    ({"name": "bad name"}, "name must be"),
    ({"missed": "sometimes"}, "missed must be"),
    ({"overlap": "queue"}, "overlap must be"),
])
def test_bad_input_is_an_error_and_changes_nothing(fields, words):
    d = driver()
    put(d, 0, payload={"durationMillis": 2})
    schedule = {"name": "s", "everyMillis": MINUTE, "taskType": "SLEEP", "payload": {"durationMillis": 1}}
    schedule.update(fields)
    reply = d.request(5, m.SchedulePut(schedule))
    d.end_batch(5)
    assert isinstance(reply, m.Error) and words in reply.message, reply
    assert show(d)["payload"] == {"durationMillis": 2}
    for msg in (m.ScheduleGet("x"), m.SchedulePause("x"), m.ScheduleResume("x"), m.ScheduleDelete("x")):
        reply = d.request(5, msg)
        assert isinstance(reply, m.Error) and "unknown schedule 'x'" in reply.message


def test_replacing_a_schedule_keeps_what_was_fired_and_delete_keeps_its_jobs():
    d = driver()
    put(d, 0, overlap="allow")
    sweep(d, MINUTE)
    replaced = put(d, MINUTE + 10, overlap="allow", payload={"durationMillis": 7})
    assert replaced["firedCount"] == 1 and replaced["createdAtMillis"] == T0
    sweep(d, MINUTE + 20)
    sweep(d, 2 * MINUTE)
    assert [j["scheduledFor"] for j in fired_jobs(d)] == [T0 + MINUTE, T0 + 2 * MINUTE]
    last = d.request(2 * MINUTE, m.ScheduleDelete("s"))
    d.end_batch(2 * MINUTE)
    assert isinstance(last, m.Schedule) and last.schedule["firedCount"] == 2
    sweep(d, 3 * MINUTE)
    assert len(fired_jobs(d)) == 2
    assert d.request(0, m.ScheduleList()).schedules == []


def test_list_pages_by_name_and_shows_the_last_jobs_state():
    d = driver()
    for name in ("c", "a", "b"):
        put(d, 0, name=name)
    sweep(d, MINUTE)
    first = d.request(0, m.ScheduleList(limit=2))
    assert [s["name"] for s in first.schedules] == ["a", "b"] and first.next_after == "b"
    assert first.schedules[0]["lastJobState"] == "QUEUED"
    rest = d.request(0, m.ScheduleList(limit=2, after="b"))
    assert [s["name"] for s in rest.schedules] == ["c"] and rest.next_after is None
    assert show(d, "a")["recentJobs"][0]["state"] == "QUEUED"


# ---- DST, through SCHEDULE_PREVIEW ------------------------------------------------------------


def preview(d: CoreDriver, cron: str, tz: str, start: str, count: int) -> list[str]:
    reply = d.request(0, m.SchedulePreview(cron=cron, timezone=tz, from_millis=at(start), count=count))
    assert isinstance(reply, m.SchedulePreview), reply
    return [datetime.utcfromtimestamp(t / 1000).strftime("%m-%d %H:%M") for t in reply.fire_times]


# Paris: 02:00 -> 03:00 on 29 March, 03:00 -> 02:00 on 25 October 2026 (02:30 repeats);
# New York: 02:00 -> 03:00 on 8 March, 02:00 -> 01:00 on 1 November 2026 (01:30 repeats).
@pytest.mark.parametrize("tz, spring, fall", [
    ("Europe/Paris", ("30 2 * * *", "2026-03-28T12:00:00+00:00", ["03-29 01:00", "03-30 00:30"]),
     ("30 2 * * *", "2026-10-24T12:00:00+00:00", ["10-25 00:30", "10-26 01:30"])),
    ("America/New_York", ("30 2 * * *", "2026-03-07T12:00:00+00:00", ["03-08 07:00", "03-09 06:30"]),
     ("30 1 * * *", "2026-10-31T12:00:00+00:00", ["11-01 05:30", "11-02 06:30"])),
])
def test_a_fixed_time_skipped_by_spring_forward_fires_after_the_gap_and_a_repeated_one_fires_once(tz, spring, fall):
    d = driver()
    assert preview(d, spring[0], tz, spring[1], 2) == spring[2]
    assert preview(d, fall[0], tz, fall[1], 2) == fall[2]


def test_an_hourly_expression_fires_in_both_repeated_hours():
    d = driver()
    times = preview(d, "30 * * * *", "Europe/Paris", "2026-10-24T23:00:00+00:00", 4)
    assert times == ["10-24 23:30", "10-25 00:30", "10-25 01:30", "10-25 02:30"]
    times = preview(d, "30 * * * *", "America/New_York", "2026-11-01T04:00:00+00:00", 4)
    assert times == ["11-01 04:30", "11-01 05:30", "11-01 06:30", "11-01 07:30"]


def test_preview_of_an_interval_and_its_bounds():
    d = driver()
    reply = d.request(0, m.SchedulePreview(every_millis=1000, from_millis=5000, count=3))
    assert reply.fire_times == [6000, 7000, 8000]
    assert isinstance(d.request(0, m.SchedulePreview(every_millis=1000, count=1001)), m.Error)
    assert isinstance(d.request(0, m.SchedulePreview(cron="@daily", timezone="Nowhere/Else")), m.Error)
    daily = d.request(0, m.SchedulePreview(cron="@daily", from_millis=0, count=2))
    assert daily.fire_times == [86_400_000, 2 * 86_400_000]


# ---- the schedules file ---------------------------------------------------------------------


def test_the_file_replaces_and_deletes_its_own_schedules_and_leaves_api_ones_alone():
    d = driver()
    put(d, 0, name="api-made")
    base = {"everyMillis": MINUTE, "taskType": "SLEEP", "payload": {"durationMillis": 1}}
    assert d.core.apply_schedules_file(0, [dict(base, name="f1"), dict(base, name="f2")]) is None
    d.end_batch(0)
    assert d.core.apply_schedules_file(5, [dict(base, name="f1", payload={"durationMillis": 3})]) is None
    d.end_batch(5)
    names = {s["name"]: s for s in d.request(0, m.ScheduleList()).schedules}
    assert set(names) == {"api-made", "f1"} and names["f1"]["payload"] == {"durationMillis": 3}
    assert names["f1"]["origin"] == "file" and names["api-made"]["origin"] == "api"
    # A bad file changes nothing.
    problem = d.core.apply_schedules_file(9, [dict(base, name="f3"), dict(base, name="f4", cron="bad")])
    d.end_batch(9)
    assert problem is not None and "f4" in problem
    assert {s["name"] for s in d.request(0, m.ScheduleList()).schedules} == {"api-made", "f1"}
    problem = d.core.apply_schedules_file(9, [dict(base, name="api-made")])
    assert problem is not None and "through the API" in problem


def test_next_due_is_the_earliest_fire_time_of_an_active_schedule():
    d = driver()
    assert d.core.schedules.next_due() is None  # no schedule: nothing to arm
    put(d, 0, name="a", everyMillis=2 * MINUTE)
    put(d, 0, name="b")
    assert d.core.schedules.next_due() == T0 + MINUTE
    d.request(0, m.SchedulePause("b"))
    d.end_batch(0)
    assert d.core.schedules.next_due() == T0 + 2 * MINUTE
    d.request(0, m.ScheduleDelete("a"))
    d.end_batch(0)
    assert d.core.schedules.next_due() is None


def test_the_schedules_file_reads_snake_case_and_wire_keys_and_names_its_errors(tmp_path):
    from jobmesh.coordinator.shell import schedule_file
    from jobmesh.errors import ConfigError

    path = tmp_path / "s.toml"
    path.write_text('[a]\ncron = "0 3 * * *"\ntask_type = "SLEEP"\npayload = { durationMillis = 1 }\n'
                    '[b]\neveryMillis = 5000\ntaskType = "SLEEP"\ncatchup_window_millis = 10\n')
    assert schedule_file.read(str(path)) == [
        {"name": "a", "cron": "0 3 * * *", "taskType": "SLEEP", "payload": {"durationMillis": 1}},
        {"name": "b", "everyMillis": 5000, "taskType": "SLEEP", "catchupWindowMillis": 10}]
    for text, words in (("[a]\ncolour = 1\n", "unknown key 'colour'"), ("a = 1\n", "must be a table"),
                        ("[a\n", "not valid TOML")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=words) as raised:
            schedule_file.read(str(path))
        assert str(path) in str(raised.value)
    with pytest.raises(ConfigError, match="cannot read"):
        schedule_file.read(str(tmp_path / "missing.toml"))


def fires_through(start: str, hours: int, **schedules: str) -> dict[str, list[str]]:
    """Run the core's sweep every 5 minutes for ``hours`` from ``start`` with these cron
    schedules (Europe/Paris, overlap=allow); the fire times each made, in UTC."""
    d = driver()
    d.core.table.drift = at(start)
    for name, cron in schedules.items():
        put(d, 0, name=name, cron=cron, everyMillis=None, timezone="Europe/Paris", overlap="allow")
    for now in range(0, hours * 3_600_000 + 1, 5 * MINUTE):
        sweep(d, now)
    out: dict[str, list[str]] = {name: [] for name in schedules}
    for job in fired_jobs(d):
        out[job["scheduleName"]].append(datetime.utcfromtimestamp(job["scheduledFor"] / 1000).strftime("%H:%M"))
    return out


def test_the_core_fires_once_in_a_fall_back_night_and_after_the_gap_of_a_spring_forward_one():
    # 25 October 2026, Paris: 03:00 CEST becomes 02:00 CET at 01:00 UTC.
    fall = fires_through("2026-10-24T22:00:00+00:00", 6, fixed="30 2 * * *", hourly="30 * * * *")
    assert fall == {"fixed": ["00:30"], "hourly": ["22:30", "23:30", "00:30", "01:30", "02:30", "03:30"]}
    # 29 March 2026, Paris: 02:00 CET becomes 03:00 CEST at 01:00 UTC; 02:30 does not exist.
    spring = fires_through("2026-03-28T23:00:00+00:00", 4, fixed="30 2 * * *", hourly="30 * * * *")
    assert spring == {"fixed": ["01:00"], "hourly": ["23:30", "00:30", "01:30", "02:30"]}


def test_a_file_applied_again_keeps_the_paused_state_set_over_the_wire_unless_the_file_changes_it():
    d = driver()
    base = {"everyMillis": MINUTE, "taskType": "SLEEP", "payload": {"durationMillis": 1}}
    assert d.core.apply_schedules_file(0, [dict(base, name="f1"), dict(base, name="f2", paused=True)]) is None
    d.end_batch(0)
    # Paused (and resumed) over the wire, then the unchanged file is applied again (SIGHUP, restart)
    d.request(1, m.SchedulePause("f1"))
    d.request(1, m.ScheduleResume("f2"))
    d.end_batch(1)
    assert d.core.apply_schedules_file(2, [dict(base, name="f1"), dict(base, name="f2", paused=True)]) is None
    d.end_batch(2)
    assert show(d, "f1")["paused"] is True and show(d, "f1")["nextFireMillis"] is None
    assert show(d, "f2")["paused"] is False
    # A file whose own `paused` changed decides again
    assert d.core.apply_schedules_file(3, [dict(base, name="f1", paused=True), dict(base, name="f2")]) is None
    d.end_batch(3)
    assert d.core.apply_schedules_file(4, [dict(base, name="f1"), dict(base, name="f2", paused=True)]) is None
    d.end_batch(4)
    assert (show(d, "f1")["paused"], show(d, "f2")["paused"]) == (False, True)


def test_a_file_naming_types_no_worker_declared_yet_is_applied_once_one_does():
    # Given a fresh database: GREET is not known when the file is applied at start
    d = driver()
    greet = {"name": "hello", "everyMillis": MINUTE, "taskType": "GREET", "payload": {"name": "Ada"}}
    assert d.core.apply_schedules_file(0, [greet]) is None
    d.end_batch(0)
    assert d.core.schedules.waiting_for() == ["GREET"] and d.request(0, m.ScheduleList()).schedules == []
    # (a file with another error is still refused at once)
    problem = d.core.apply_schedules_file(0, [dict(greet, cron="bad")])
    assert problem is not None and "hello" in problem
    sweep(d, 10)
    assert d.request(0, m.ScheduleList()).schedules == []
    # When a worker declares GREET, the next sweep applies the file
    d.apply(20, ev.Registered(object(), m.WorkerRegister("w-greet", 1, ["GREET"], None)))
    d.end_batch(20)
    sweep(d, 30)
    assert d.core.schedules.waiting_for() == []
    assert show(d, "hello")["taskType"] == "GREET" and show(d, "hello")["origin"] == "file"


YEAR_9999 = 253_370_764_800_000  # 9999-01-01T00:00:00Z


@pytest.mark.parametrize("every", [2 ** 62, 10 ** 20, 253_402_300_800_000])
def test_a_schedule_whose_next_fire_is_after_the_year_9999_is_an_error(every):
    d = driver()
    schedule = {"name": "far", "everyMillis": every, "taskType": "SLEEP", "payload": {"durationMillis": 1}}
    for paused in (False, True):
        reply = d.request(0, m.SchedulePut(dict(schedule, paused=paused)))
        assert isinstance(reply, m.Error) and "after the year 9999" in reply.message, reply
    problem = d.core.apply_schedules_file(0, [schedule])
    assert problem is not None and "after the year 9999" in problem
    d.end_batch(0)
    assert d.request(0, m.ScheduleList()).schedules == []


def test_a_schedule_whose_later_fire_times_pass_the_year_9999_fires_no_more():
    # Given a schedule whose first fire is in 9999 and whose second would be far later
    d = driver()
    every = YEAR_9999 + MINUTE - T0
    made = put(d, 0, everyMillis=every, overlap="allow")
    assert made["nextFireMillis"] == YEAR_9999 + MINUTE
    sweep(d, every)
    # Then it fired once and has no next fire time, though it is not paused
    shown = show(d, "s")
    assert shown["firedCount"] == 1 and shown["nextFireMillis"] is None and shown["paused"] is False


def test_every_schedule_reply_and_listing_has_one_shape():
    d = driver()
    shapes = {"put": put(d, 0, name="a")}
    sweep(d, MINUTE)
    shapes["get"] = show(d, "a")
    shapes["list"] = d.request(0, m.ScheduleList()).schedules[0]
    for label, msg in (("pause", m.SchedulePause("a")), ("resume", m.ScheduleResume("a")),
                       ("delete", m.ScheduleDelete("a"))):
        reply = d.request(MINUTE, msg)
        assert isinstance(reply, m.Schedule), reply
        shapes[label] = reply.schedule
    keys = set(shapes["get"])
    assert {"recentJobs", "lastJobState", "nextFireMillis", "firedCount"} <= keys
    assert {label: set(shape) for label, shape in shapes.items()} == {label: keys for label in shapes}
    assert shapes["delete"]["lastJobState"] == "QUEUED" and shapes["delete"]["recentJobs"][0]["state"] == "QUEUED"


def test_preview_where_the_zones_dates_end_before_utcs_is_short_not_an_error():
    d = driver()
    last_evening = at("9999-12-31T05:00:00+00:00")  # 19:00 on 31 December 9999 at UTC+14
    reply = d.request(0, m.SchedulePreview(cron="@hourly", timezone="Pacific/Kiritimati", from_millis=last_evening))
    assert isinstance(reply, m.SchedulePreview) and len(reply.fire_times) == 4, reply
    reply = d.request(0, m.SchedulePreview(cron="@hourly", timezone="Pacific/Kiritimati",
                                           from_millis=at("9999-12-31T20:00:00+00:00")))
    assert isinstance(reply, m.SchedulePreview) and reply.fire_times == [], reply
