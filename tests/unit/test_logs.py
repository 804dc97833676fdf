"""``--log-format``: the JSON log formatter, the stream adapter for gevent's hub, the flag in
each server command's config, and the CLI's own errors in JSON."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

import pytest

from jobmesh.cli import main, parse
from jobmesh.config import coordinator_config, worker_config
from jobmesh.errors import ConfigError
from jobmesh.logs import JsonFormatter, JsonLines, id_fields, utc_iso
from jobmesh.up import coordinator_argv

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")


def record(msg, *args, level=logging.INFO, name="jobmesh.coordinator.core.face", exc_info=None, **extra):
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    for key, value in extra.items():
        setattr(rec, key, value)
    return rec


def formatted(rec) -> dict:
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    return json.loads(line)


def test_a_line_has_ts_level_logger_message_and_the_ids_of_its_pairs():
    obj = formatted(record("deadline expired job=%s attempt=%s worker=%s", "j-1", "j-1.2", "w-7",
                           level=logging.WARNING))
    assert TS.match(obj["ts"])
    assert (obj["level"], obj["logger"]) == ("WARNING", "jobmesh.coordinator.core.face")
    assert obj["message"] == "deadline expired job=j-1 attempt=j-1.2 worker=w-7"
    assert (obj["jobId"], obj["attemptId"], obj["workerId"]) == ("j-1", "j-1.2", "w-7")


def test_an_attempt_number_is_not_a_lease():
    obj = formatted(record("retry job=%s attempt=%d/%d in=%dms error=%s", "j-1", 1, 3, 20, "boom"))
    assert (obj["jobId"], obj["attempt"]) == ("j-1", "1/3")
    assert "attemptId" not in obj and "workerId" not in obj


def test_extra_fields_win_over_the_message():
    obj = formatted(record("something about job=j-old", job_id="j-new", worker_id="w-1", attempt_id="a-1"))
    assert (obj["jobId"], obj["workerId"], obj["attemptId"]) == ("j-new", "w-1", "a-1")


def test_a_traceback_stays_inside_the_object():
    try:
        raise ValueError("bad")
    except ValueError:
        rec = record("core died", level=logging.ERROR, exc_info=sys.exc_info())
    obj = formatted(rec)
    assert obj["message"] == "core died"
    assert "Traceback" in obj["exc"] and "ValueError: bad" in obj["exc"]


@pytest.mark.parametrize("message,fields", [
    ("worker connection error peer=1.2.3.4:5 worker=w-1: [Errno 9] closed", {"workerId": "w-1"}),
    ("listening worker=127.0.0.1:7070 client=127.0.0.1:7071", {}),
    ("stale result dropped job=j-1 attempt=None worker=w-2", {"jobId": "j-1", "workerId": "w-2"}),
    ("task finished job=j-1, then", {"jobId": "j-1"}),
    ("subjob=x myworker=y", {}),
    ("no ids here", {}),
])
def test_id_fields(message, fields):
    assert id_fields(message) == fields


def test_utc_iso():
    assert utc_iso(1_796_055_997.317) == "2026-11-30T16:26:37.317Z"
    assert utc_iso(0.9996) == "1970-01-01T00:00:01.000Z"


def test_json_lines_turns_printed_text_into_objects():
    target = io.StringIO()
    stream = JsonLines(target, "gevent.hub")
    stream.write("Traceback (most recent call last):\n  File \"x\", line 1")
    stream.write(", in f\nValueError: boom\n\n<Greenlet> failed with ValueError\n")
    stream.write("partial")
    stream.flush()
    objs = [json.loads(line) for line in target.getvalue().splitlines()]
    assert [o["message"] for o in objs] == ["Traceback (most recent call last):", '  File "x", line 1, in f',
                                            "ValueError: boom", "<Greenlet> failed with ValueError", "partial"]
    assert {(o["level"], o["logger"]) for o in objs} == {("ERROR", "gevent.hub")}


# ---- the flag --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["coordinator", "up"])
def test_coordinator_and_up_take_log_format_and_retain_finished_millis(command):
    cfg = coordinator_config(parse([command])[1])
    assert (cfg.log_format, cfg.retain_finished_millis) == ("text", 604_800_000)
    cfg = coordinator_config(parse([command, "--log-format=JSON", "--retain-finished-millis=0"])[1])
    assert (cfg.log_format, cfg.retain_finished_millis) == ("json", 0)


def test_worker_takes_log_format():
    assert worker_config(parse(["worker"])[1]).log_format == "text"
    assert worker_config(parse(["worker", "--log-format=json"])[1]).log_format == "json"


@pytest.mark.parametrize("argv", [["coordinator", "--log-format=xml"], ["coordinator", "--retain-finished-millis=-1"],
                                  ["coordinator", "--retain-finished-millis=week"]])
def test_bad_values_are_config_errors(argv):
    with pytest.raises(ConfigError):
        coordinator_config(parse(argv)[1])
    with pytest.raises(ConfigError):
        worker_config(parse(["worker", "--log-format=xml"])[1])


def test_up_passes_the_format_and_retention_to_its_coordinator():
    argv = coordinator_argv(coordinator_config(parse(["up", "--log-format=json", "--retain-finished-millis=5"])[1]))
    assert "--log-format=json" in argv and "--retain-finished-millis=5" in argv


@pytest.mark.parametrize("argv", [["coordinator", "--log-format=json", "--worker-port=x"],
                                  ["worker", "--log-format", "json", "--capacity=0"],
                                  ["coordinator", "--log-format=json", "--no-such-flag"]])
def test_cli_errors_are_json_too(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    objs = [json.loads(line) for line in err.splitlines()]
    assert len(objs) == 1 and objs[0]["level"] == "ERROR" and objs[0]["message"].startswith("jobmesh ")


def test_cli_errors_stay_text_without_json(capsys):
    assert main(["coordinator", "--worker-port=x"]) == 2
    assert capsys.readouterr().err.startswith("jobmesh coordinator: --worker-port must be")
