"""``CoordinatorClient.submit(delay=..., run_at=...)``: the wire fields it sends, and what it refuses unsent."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from jobmesh.client.api import schedule_millis

SUBMITTED = {"type": "JOB_SUBMITTED", "jobId": "j-1"}
XMAS = datetime(2026, 12, 24, 18, tzinfo=timezone.utc)
XMAS_MILLIS = 1_798_135_200_000


def test_xmas_millis_is_right():
    assert XMAS.timestamp() * 1000 == XMAS_MILLIS


@pytest.mark.parametrize("delay,millis", [
    (0, 0), (1, 1000), (1.5, 1500), (0.0004, 0), (0.0006, 1), (86400, 86_400_000),
    (timedelta(minutes=5), 300_000), (timedelta(milliseconds=1, microseconds=999), 1), (timedelta(0), 0),
])
def test_delay_is_sent_as_delay_millis(serve, delay, millis):
    server, client = serve(SUBMITTED)
    assert client.submit("SLEEP", {"durationMillis": 1}, delay=delay) == "j-1"
    (request,) = server.requests
    assert (request["delayMillis"], request["runAtMillis"]) == (millis, None)


@pytest.mark.parametrize("run_at,millis", [
    (XMAS, XMAS_MILLIS),
    (XMAS.astimezone(timezone(timedelta(hours=-5))), XMAS_MILLIS),        # the same instant, another zone
    (XMAS + timedelta(microseconds=1500), XMAS_MILLIS + 1),
    (XMAS_MILLIS / 1000, XMAS_MILLIS),                                      # epoch seconds, a float
    (1_798_135_200, XMAS_MILLIS),                                           # epoch seconds, an int
    (1_798_135_200.25, XMAS_MILLIS + 250),
    (0, 0),
])
def test_run_at_is_sent_as_run_at_millis(serve, run_at, millis):
    server, client = serve(SUBMITTED)
    assert client.submit("GREET", {"name": "Ada"}, run_at=run_at) == "j-1"
    (request,) = server.requests
    assert (request["runAtMillis"], request["delayMillis"]) == (millis, None)
    assert request["taskType"] == "GREET" and request["payload"] == {"name": "Ada"}


@pytest.mark.parametrize("kwargs,message", [
    ({"run_at": datetime(2026, 12, 24, 18)}, "aware datetime"),
    ({"delay": -1}, "delay must not be negative"),
    ({"delay": -0.5}, "delay must not be negative"),
    ({"delay": timedelta(seconds=-1)}, "delay must not be negative"),
    ({"delay": 5, "run_at": XMAS}, "not both"),
    ({"delay": float("nan")}, "finite"),
    ({"run_at": float("inf")}, "finite"),
    ({"run_at": -1}, "before the epoch"),
    ({"run_at": datetime(1969, 12, 31, tzinfo=timezone.utc)}, "before the epoch"),
])
def test_bad_schedules_are_value_errors_before_anything_is_sent(serve, kwargs, message):
    server, client = serve(SUBMITTED)
    with pytest.raises(ValueError) as info:
        client.submit("SLEEP", {"durationMillis": 1}, **kwargs)
    assert message in str(info.value)
    assert server.connections == 0 and server.requests == []


@pytest.mark.parametrize("kwargs", [{"delay": "5"}, {"delay": True}, {"run_at": "2026-12-24T18:00:00Z"}])
def test_schedules_of_the_wrong_type_are_type_errors(kwargs):
    with pytest.raises(TypeError):
        schedule_millis(kwargs.get("delay"), kwargs.get("run_at"))


def test_list_jobs_and_iter_jobs_send_task_type(serve):
    page = {"type": "JOB_LIST", "jobs": [], "nextCursor": None}
    server, client = serve(page, page)
    assert client.list_jobs(task_type="GREET") == ([], None)
    assert list(client.iter_jobs(state="SCHEDULED", task_type="resize.image")) == []
    assert [(r["taskType"], r["state"]) for r in server.requests] == [("GREET", None),
                                                                      ("resize.image", "SCHEDULED")]
