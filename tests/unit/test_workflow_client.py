"""Workflows from the client side, against a scripted coordinator (tests/support/scripted_server.py):
the library's four requests (blocking and asyncio), what they send and send again, paging,
waiting and its timeout; the ``jobmesh workflow`` commands' files, output and exit codes; and
``jobmesh status`` of a workflow's job."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from jobmesh.aio import AsyncClient
from jobmesh.canvas import chord, group, step
from jobmesh.cli import main, parse
from jobmesh.client.api import SubmittedWorkflow, WaitTimeout, WorkflowWaitTimeout
from jobmesh.errors import ConfigError, CoordinatorUnavailable, RequestFailed
from jobmesh.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE
from tests.support.scripted_server import CLOSE, Delayed, ScriptedServer

SUBMITTED = {"type": "WORKFLOW_SUBMITTED", "workflowId": "w-1", "jobIds": {"a": "j-1", "b": "j-2"}}
JOBS = [{"ref": "a", "jobId": "j-1", "state": "COMPLETED", "dependsOn": []},
        {"ref": "b", "jobId": "j-2", "state": "WAITING", "dependsOn": ["a"]}]


WAITING_JOB = {"jobId": "j-3", "taskType": "C", "state": "WAITING", "waitingReason": "DEPENDENCIES", "attempts": 0,
               "maxAttempts": 3, "priority": "NORMAL", "workflowId": "w-1", "ref": "c", "createdAtMillis": 1,
               "updatedAtMillis": 1}


def workflow(state="RUNNING", jobs=JOBS, **extra):
    return dict({"type": "WORKFLOW", "workflowId": "w-1", "name": "etl", "state": state, "jobs": jobs}, **extra)


def whole(state="RUNNING", jobs=JOBS):
    return {"workflowId": "w-1", "name": "etl", "state": state, "jobs": jobs}


# ---- the library ----------------------------------------------------------------------------


def test_submit_workflow_sends_the_compiled_shape_and_returns_its_ids(serve):
    server, client = serve(SUBMITTED)
    got = client.submit_workflow(chord(group(step("A"), step("A")), step("B", ref="b")), "etl")
    assert got == SubmittedWorkflow("w-1", {"a": "j-1", "b": "j-2"})
    workflow_id, job_ids = got
    assert (workflow_id, job_ids["b"]) == ("w-1", "j-2")
    [sent] = server.requests
    assert sent == {"type": "SUBMIT_WORKFLOW", "name": "etl", "jobs": [
        {"ref": "A.0", "taskType": "A", "payload": {}}, {"ref": "A.1", "taskType": "A", "payload": {}},
        {"ref": "b", "taskType": "B", "payload": {}, "dependsOn": ["A.0", "A.1"]}]}


def test_a_keyed_workflow_goes_again_after_a_lost_connection_and_an_unkeyed_one_does_not(serve):
    server, client = serve(CLOSE, SUBMITTED)
    assert client.submit_workflow([{"ref": "a", "taskType": "A", "payload": {}}], idempotency_key="k").workflow_id \
        == "w-1"
    first, again = server.requests
    assert first == again and first["jobs"][0]["idempotencyKey"] == "k:a"
    server, client = serve(CLOSE, SUBMITTED)
    with pytest.raises(CoordinatorUnavailable):
        client.submit_workflow([{"ref": "a", "taskType": "A", "payload": {}}])
    assert len(server.requests) == 1


def test_workflow_status_follows_next_cursor_to_every_job(serve):
    server, client = serve(workflow(jobs=JOBS[:1], nextCursor="c-1"), workflow(jobs=JOBS[1:]))
    assert client.workflow_status("w-1") == whole()
    assert server.requests == [{"type": "WORKFLOW_STATUS", "workflowId": "w-1"},
                               {"type": "WORKFLOW_STATUS", "workflowId": "w-1", "cursor": "c-1"}]


def test_a_status_read_goes_again_after_a_lost_connection(serve):
    server, client = serve(CLOSE, workflow())
    assert client.workflow_status("w-1") == whole()
    assert len(server.requests) == 2


def test_cancel_workflow_sends_workflow_cancel_once(serve):
    server, client = serve(workflow("CANCELLED"))
    assert client.cancel_workflow("w-1")["state"] == "CANCELLED"
    assert server.requests == [{"type": "WORKFLOW_CANCEL", "workflowId": "w-1"}]


def test_an_unknown_workflow_is_request_failed(serve):
    _server, client = serve({"type": "ERROR", "message": "unknown workflowId 'nope'"})
    with pytest.raises(RequestFailed, match="unknown workflowId"):
        client.workflow_status("nope")


def test_wait_workflow_asks_again_until_the_workflow_ends(serve):
    server, client = serve(workflow(), workflow("COMPLETED", nextCursor="c-1"), workflow("COMPLETED", jobs=[]))
    assert client.wait_workflow("w-1") == whole("COMPLETED")
    first, second, page = server.requests
    assert first == second == {"type": "WAIT_WORKFLOW", "workflowId": "w-1", "timeoutMillis": 60_000}
    assert page == {"type": "WORKFLOW_STATUS", "workflowId": "w-1", "cursor": "c-1"}


def test_wait_workflow_that_times_out_raises_a_wait_timeout_with_the_workflow(serve):
    server, client = serve(workflow())
    with pytest.raises(WaitTimeout) as caught:
        client.wait_workflow("w-1", timeout=0.05)
    assert isinstance(caught.value, WorkflowWaitTimeout) and isinstance(caught.value, TimeoutError)
    assert caught.value.workflow == whole() and caught.value.workflow_id == "w-1"
    assert "workflow w-1 still RUNNING" in str(caught.value)
    assert server.requests[0]["timeoutMillis"] <= 50


def test_the_reply_timeout_of_a_workflow_wait_covers_the_wait(serve):
    _server, client = serve(Delayed(0.5, workflow("COMPLETED")), timeout=0.2)
    assert client.wait_workflow("w-1", timeout=5)["state"] == "COMPLETED"


def test_the_async_client_submits_reads_and_cancels_as_the_blocking_one():
    server = ScriptedServer([SUBMITTED, workflow(jobs=JOBS[:1], nextCursor="c-1"), workflow(jobs=JOBS[1:]),
                             workflow("CANCELLED")])

    async def main_() -> None:
        async with AsyncClient("127.0.0.1:%d" % server.port) as client:
            assert await client.submit_workflow(step("A"), idempotency_key="k") == ("w-1", {"a": "j-1", "b": "j-2"})
            assert await client.workflow_status("w-1") == whole()
            assert (await client.cancel_workflow("w-1"))["state"] == "CANCELLED"

    try:
        asyncio.run(main_())
    finally:
        server.close()
    kinds = [r["type"] for r in server.requests]
    assert kinds == ["SUBMIT_WORKFLOW", "WORKFLOW_STATUS", "WORKFLOW_STATUS", "WORKFLOW_CANCEL"]
    assert server.requests[0]["jobs"] == [{"ref": "A.0", "taskType": "A", "payload": {}, "idempotencyKey": "k:A.0"}]


@pytest.mark.parametrize("steps,timeout,ended", [([Delayed(0.5, workflow("COMPLETED"))], 5, True),
                                                 ([workflow()], 0.05, False)])
def test_the_async_wait_covers_its_wait_and_times_out_as_the_blocking_one(steps, timeout, ended):
    # a wait goes on a connection of its own: alone on its scripted coordinator
    server = ScriptedServer(steps)

    async def main_() -> None:
        async with AsyncClient("127.0.0.1:%d" % server.port, timeout=0.2) as client:
            if ended:
                assert (await client.wait_workflow("w-1", timeout=timeout))["state"] == "COMPLETED"
            else:
                with pytest.raises(WorkflowWaitTimeout):
                    await client.wait_workflow("w-1", timeout=timeout)

    try:
        asyncio.run(main_())
    finally:
        server.close()
    assert [r["type"] for r in server.requests] == ["WAIT_WORKFLOW"]


# ---- jobmesh workflow ------------------------------------------------------------------------

FILE = {"name": "etl", "jobs": [{"ref": "a", "taskType": "A", "payload": {}},
                                {"ref": "b", "taskType": "B", "payload": {"x": 1}, "dependsOn": ["a"]}]}


@pytest.fixture
def workflow_file(tmp_path):
    path = tmp_path / "etl.json"
    path.write_text(json.dumps(FILE))
    return str(path)


def test_submit_prints_the_workflow_id_and_sends_the_file_with_keys(jm, workflow_file):
    code, out, err, server = jm([SUBMITTED], "workflow", "submit", workflow_file)
    assert (code, out, err) == (EXIT_OK, "w-1\n", "")
    [sent] = server.requests
    assert sent["type"] == "SUBMIT_WORKFLOW" and sent["name"] == "etl"
    keys = [job.pop("idempotencyKey") for job in sent["jobs"]]
    assert sent["jobs"] == FILE["jobs"]
    assert keys[0].startswith("cli-") and keys[0].endswith(":a") and keys[1] == keys[0][:-1] + "b"


def test_submit_reads_stdin_and_prints_json(jm):
    code, out, _err, server = jm([SUBMITTED], "workflow", "submit", "-", "--json", "--idempotency-key=run-7",
                                 stdin=io.StringIO(json.dumps(FILE)))
    assert code == EXIT_OK and json.loads(out) == {"workflowId": "w-1", "jobIds": {"a": "j-1", "b": "j-2"}}
    assert [j["idempotencyKey"] for j in server.requests[0]["jobs"]] == ["run-7:a", "run-7:b"]


@pytest.mark.parametrize("text,message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object with a list of jobs"),
    ('{"jobs": {}}', "must be a JSON object with a list of jobs"),
    ('{"jobs": [], "job": []}', "unknown field 'job'"),
    ('{"jobs": [3]}', "job 1 is not an object"),
    ('{"jobs": [], "name": 5}', "name must be a string"),
    ('{"type": "SUBMIT_JOB", "jobs": []}', "type is 'SUBMIT_JOB'"),
    # a misspelt dependsOn would make a job that runs at once
    ('{"jobs": [{"ref": "a", "taskType": "A", "payload": {}}, {"ref": "b", "taskType": "A", "payload": {}, '
     '"depends_on": ["a"]}]}', "job 'b': unknown field 'depends_on'; a job has ref, dependsOn and a submit's fields"),
])
def test_a_bad_workflow_file_is_a_usage_error_and_sends_nothing(jm, tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        jm([SUBMITTED], "workflow", "submit", str(path))
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["workflow", "submit", str(tmp_path / "nope.json"), "--coordinator=127.0.0.1:1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read workflow file" in err and "No such file" in err


def test_more_than_ten_thousand_jobs_are_a_usage_error_before_sending(jm, tmp_path):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"jobs": [{"ref": "r%d" % i, "taskType": "A", "payload": {}} for i in range(10_001)]}))
    with pytest.raises(ConfigError, match="at most 10000 jobs"):
        jm([SUBMITTED], "workflow", "submit", str(path))


@pytest.mark.parametrize("state,code,ends", [("COMPLETED", EXIT_OK, ("COMPLETED", "COMPLETED")),
                                             ("FAILED", EXIT_FAILED, ("FAILED", "CANCELLED")),
                                             ("CANCELLED", EXIT_FAILED, ("COMPLETED", "CANCELLED"))])
def test_submit_wait_exits_as_the_workflow_ended(jm, workflow_file, state, code, ends):
    jobs = [dict(job, state=end) for job, end in zip(JOBS, ends)]
    got, out, err, server = jm([SUBMITTED, workflow(state, jobs)], "workflow", "submit", workflow_file, "--wait")
    assert got == code
    assert out.startswith("submitted workflow w-1 (2 jobs)\nworkflow  w-1\n")
    assert "state     %s" % state in out
    if state == "COMPLETED":
        assert err == ""
    else:
        assert err.count("\n") == 1 and "workflow w-1 ended %s" % state in err and err.endswith("cancelled: b\n")
        assert ("failed: a; " in err) == (state == "FAILED")
    assert server.requests[1]["type"] == "WAIT_WORKFLOW"


def test_wait_that_times_out_exits_4_with_the_workflow_as_it_stood(jm):
    code, out, err, server = jm([workflow()], "workflow", "wait", "w-1", "--timeout-millis=50", "--json")
    assert code == EXIT_TIMEOUT and json.loads(out) == whole()
    assert "timed out: workflow w-1 still RUNNING" in err
    assert server.requests[0]["timeoutMillis"] <= 50


def test_status_text_counts_first_then_a_line_per_job(jm):
    code, out, err, _server = jm([workflow()], "workflow", "status", "w-1")
    assert (code, err) == (EXIT_OK, "")
    lines = out.splitlines()
    assert lines[:4] == ["workflow  w-1", "name      etl", "state     RUNNING", "jobs      2 jobs: 1 WAITING, 1 COMPLETED"]
    assert lines[4].split() == ["REF", "STATE", "JOB", "DEPENDS", "ON"]
    assert lines[5].split() == ["a", "COMPLETED", "j-1", "-"] and lines[6].split() == ["b", "WAITING", "j-2", "a"]


def test_status_of_a_large_workflow_lists_only_what_has_not_completed(jm):
    jobs = [{"ref": "s%d" % i, "jobId": "j%d" % i, "state": "COMPLETED", "dependsOn": []} for i in range(150)]
    jobs.append({"ref": "merge", "jobId": "jm", "state": "RUNNING", "dependsOn": ["s%d" % i for i in range(150)]})
    code, out, _err, _server = jm([workflow(jobs=jobs)], "workflow", "status", "w-1")
    assert code == EXIT_OK
    assert "151 jobs: 1 RUNNING, 150 COMPLETED" in out
    assert "merge  RUNNING  jm   s0, s1, s2 +147 more" in out and "s7 " not in out
    assert out.endswith("(not listed: 150 COMPLETED jobs; --json lists every job)\n")
    code, out, _err, _server = jm([workflow(jobs=jobs)], "workflow", "status", "w-1", "--json")
    assert len(json.loads(out)["jobs"]) == 151


def test_status_and_cancel_of_an_unknown_workflow_are_one_line_and_exit_1(jm):
    for command in ("status", "cancel", "wait"):
        code, out, err, _server = jm([{"type": "ERROR", "message": "unknown workflowId 'nope'"}],
                                     "workflow", command, "nope")
        assert (code, out) == (EXIT_FAILED, "")
        assert err == "jobmesh workflow: the coordinator refused: unknown workflowId 'nope'\n"


def test_cancel_says_so_and_prints_the_workflow(jm):
    code, out, _err, server = jm([workflow("CANCELLED", [dict(JOBS[0]), dict(JOBS[1], state="CANCELLED")])],
                                 "workflow", "cancel", "w-1")
    assert code == EXIT_OK and out.startswith("cancelled workflow w-1") and "state     CANCELLED" in out
    assert server.requests == [{"type": "WORKFLOW_CANCEL", "workflowId": "w-1"}]


def test_help_explains_the_file_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        parse(["workflow", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "dependsOn" in text and "jobmesh workflow submit FILE" in text and "exit 0 when every job COMPLETED" in text


# ---- jobmesh status of a workflow's job ------------------------------------------------------


def test_status_of_a_waiting_job_names_its_workflow_and_the_dependencies_it_waits_for(jm):
    jobs = JOBS + [{"ref": "z", "jobId": "j-9", "state": "RUNNING", "dependsOn": []},
                   {"ref": "c", "jobId": "j-3", "state": "WAITING", "dependsOn": ["a", "b", "z"]}]
    code, out, _err, server = jm([{"type": "JOB_STATUS", "job": WAITING_JOB}, workflow(jobs=jobs)], "status", "j-3")
    assert code == EXIT_OK
    assert "workflow  w-1 (ref c)" in out
    assert "waiting   waiting for dependencies: b, z" in out
    assert server.requests[1] == {"type": "WORKFLOW_STATUS", "workflowId": "w-1"}


def test_a_workflow_reply_with_odd_jobs_still_renders():
    from jobmesh.client import render
    text = render.workflow_detail({"workflowId": "w", "state": "RUNNING", "jobs": [1, {"ref": "a", "dependsOn": "x"}]})
    assert "1 job: 1 None" in text and text.splitlines()[-1].split() == ["a", "-", "-", "-"]
    assert render.workflow_detail({"workflowId": "w", "jobs": None}).splitlines()[-1] == "jobs      0 jobs"


def test_status_of_a_waiting_job_whose_workflow_is_gone_still_says_why_it_waits(jm):
    code, out, _err, _server = jm([{"type": "JOB_STATUS", "job": WAITING_JOB}, {"type": "ERROR", "message": "unknown"}],
                                  "status", "j-3")
    assert code == EXIT_OK and "waiting   waiting for its dependencies in workflow w-1" in out
