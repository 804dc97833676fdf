"""Workflows from the user's side, end to end: the library, the CLI and a real worker
process (``tests/user_tasks_module.py``'s ADDUP reads ``ctx.parents``), against one
coordinator the module's tests share (each test's workflows are its own), and the README's
"Workflows" example run as written. A workflow at the limit (10,000 jobs) is taken in one
reply and run; one job more is refused whole."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobmesh.canvas import CanvasError
from jobmesh.client import CoordinatorClient, WorkflowWaitTimeout, chain, chord, group, step
from jobmesh.errors import RequestFailed
from jobmesh.protocol import messages as m
from tests.support.cli import run_cli
from tests.support.peers import wait_registered
from tests.support.processes import WorkerProcs, child_env

MODULE_SOURCE = Path(__file__).resolve().parent.parent / "user_tasks_module.py"
README = Path(__file__).resolve().parent.parent.parent / "README.md"


@pytest.fixture(scope="module")
def coordinator(shared_coordinator):
    return shared_coordinator


@pytest.fixture(scope="module")
def workers(coordinator, tmp_path_factory):
    """One worker running ``jm_user_tasks`` and one running the README's ``wftasks``, for
    the whole module (no other test's jobs are of their types)."""
    where = tmp_path_factory.mktemp("workflow-workers")
    shutil.copy(MODULE_SOURCE, where / "jm_user_tasks.py")
    for name, body in readme_files().items():
        (where / name).write_text(body)
    procs = WorkerProcs(where)
    procs.start(coordinator, "w-workflows", capacity=4, tasks="jm_user_tasks", cwd=where)
    procs.start(coordinator, "w-readme", capacity=4, tasks="wftasks", cwd=where)
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as client:
        wait_registered(client, ["w-workflows", "w-readme"])
    yield where
    procs.cleanup()


@pytest.fixture
def client(coordinator, workers):
    with CoordinatorClient(*coordinator.client_addr, timeout=10) as c:
        yield c


def readme_files() -> dict[str, str]:
    """The README's ``# wftasks.py`` and ``# pipeline.py`` blocks, as written."""
    blocks = re.findall(r"```python\n(# (wftasks|pipeline)\.py\n.*?)```", README.read_text(), re.S)
    return {name + ".py": body for body, name in blocks}


def result_of(client, workflow, ref):
    job = next(j for j in workflow["jobs"] if j["ref"] == ref)
    return client.status(job["jobId"])


def test_a_diamond_runs_each_step_once_with_its_parents_results(client):
    diamond = chain(step("ADDUP", {"n": 1}, ref="top"), group(step("ADDUP", {"n": 2}, ref="left"),
                                                               step("ADDUP", {"n": 3}, ref="right")),
                    step("ADDUP", {"n": 4}, ref="bottom"))
    workflow_id, job_ids = client.submit_workflow(diamond, "diamond", idempotency_key="diamond-1")
    assert sorted(job_ids) == ["bottom", "left", "right", "top"]
    done = client.wait_workflow(workflow_id, timeout=30)
    assert (done["state"], done["name"]) == ("COMPLETED", "diamond")
    assert {j["ref"]: j["dependsOn"] or [] for j in done["jobs"]} == {"top": [], "left": ["top"], "right": ["top"],
                                                                 "bottom": ["left", "right"]}
    bottom = client.status(job_ids["bottom"])
    assert bottom["result"] == {"sum": 4 + (2 + 1) + (3 + 1), "parents": ["left", "right"]}
    assert (bottom["workflowId"], bottom["ref"], bottom["attempts"]) == (workflow_id, "bottom", 1)
    # the same key again answers the workflow it made
    assert client.submit_workflow(diamond, "diamond", idempotency_key="diamond-1") == (workflow_id, job_ids)


def test_a_chord_s_callback_reads_every_member_s_result(client):
    album = chord(group(step("ADDUP", {"n": i}) for i in range(5)), step("ADDUP", ref="total"))
    workflow_id, _ = client.submit_workflow(album)
    done = client.wait_workflow(workflow_id, timeout=30)
    assert done["state"] == "COMPLETED"
    assert result_of(client, done, "total")["result"] == {"sum": 10, "parents": ["ADDUP.%d" % i for i in range(5)]}


def test_a_10000_job_fan_out_and_fan_in_is_taken_in_one_reply_and_runs_to_its_join(client):
    # 9,999 parallel steps and a join: one SUBMIT_WORKFLOW, one reply, run by the real workers
    album = chord(group(step("ADDUP", {"n": i}) for i in range(9_999)), step("TALLY", ref="total"))
    workflow_id, job_ids = client.submit_workflow(album, "ten-thousand")
    assert len(job_ids) == 10_000
    done = client.wait_workflow(workflow_id, timeout=600)
    assert done["state"] == "COMPLETED" and len(done["jobs"]) == 10_000
    assert {j["state"] for j in done["jobs"]} == {"COMPLETED"}
    assert client.status(job_ids["total"])["result"] == {"parents": 9_999, "sum": sum(range(9_999))}


def test_a_workflow_of_10001_jobs_is_refused_whole(client):
    # the library refuses it before sending; the coordinator, sent it anyway, makes none of it
    jobs = [{"ref": "j%d" % i, "taskType": "ADDUP", "payload": {"n": i, "tag": "over"}} for i in range(10_001)]
    with pytest.raises(CanvasError, match="at most 10000 jobs"):
        client.submit_workflow(jobs)
    before = client.stats().submitted
    with pytest.raises(RequestFailed, match="1..10000 jobs"):
        client.request(m.SubmitWorkflow(jobs, "too-many"), m.WorkflowSubmitted)
    assert client.stats().submitted == before
    assert client.list_jobs(state="WAITING", task_type="ADDUP")[0] == []


def test_a_failed_step_cancels_its_dependents_and_the_cli_says_so(client, coordinator, tmp_path):
    path = tmp_path / "wf.json"
    path.write_text(json.dumps({"name": "breaks", "jobs": [
        {"ref": "boom", "taskType": "BOOM", "payload": {}, "maxAttempts": 1},
        {"ref": "after", "taskType": "ADDUP", "payload": {}, "dependsOn": ["boom"]},
        {"ref": "later", "taskType": "ADDUP", "payload": {}, "dependsOn": ["after"]},
        {"ref": "aside", "taskType": "ADDUP", "payload": {"n": 7}}]}))
    proc = run_cli("workflow", "submit", str(path), "--wait", "--timeout-millis=30000",
                   coordinator=coordinator.client_target, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "ended FAILED" in proc.stderr and "failed: boom" in proc.stderr and proc.stderr.count("\n") == 1
    workflow_id = re.search(r"workflow  (\S+)", proc.stdout).group(1)
    states = {j["ref"]: j["state"] for j in client.workflow_status(workflow_id)["jobs"]}
    assert states == {"boom": "FAILED", "after": "CANCELLED", "later": "CANCELLED", "aside": "COMPLETED"}
    status = run_cli("workflow", "status", workflow_id, "--json", coordinator=coordinator.client_target)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "FAILED"
    waited = run_cli("workflow", "wait", workflow_id, coordinator=coordinator.client_target)
    assert waited.returncode == 1


def test_waiting_jobs_are_shown_listed_waited_for_and_cancelled_from_the_cli(client, coordinator):
    workflow_id, job_ids = client.submit_workflow([
        {"ref": "first", "taskType": "ADDUP", "payload": {}, "delayMillis": 600_000},
        {"ref": "second", "taskType": "ADDUP", "payload": {}, "dependsOn": ["first"]}])
    target = coordinator.client_target
    shown = run_cli("status", job_ids["second"], coordinator=target)
    assert shown.returncode == 0, shown.stderr
    assert "workflow  %s (ref second)" % workflow_id in shown.stdout
    assert "waiting for dependencies: first" in shown.stdout
    listed = run_cli("list", "--state=WAITING", "--json", coordinator=target)
    assert listed.returncode == 0 and job_ids["second"] in {j["jobId"] for j in json.loads(listed.stdout)}
    timed_out = run_cli("workflow", "wait", workflow_id, "--timeout-millis=100", coordinator=target)
    assert timed_out.returncode == 4 and "state     RUNNING" in timed_out.stdout
    with pytest.raises(WorkflowWaitTimeout):
        client.wait_workflow(workflow_id, timeout=0.1)
    cancelled = run_cli("workflow", "cancel", workflow_id, "--json", coordinator=target)
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["state"] == "CANCELLED"
    assert run_cli("workflow", "wait", workflow_id, coordinator=target).returncode == 1


def test_an_unknown_workflow_is_one_line_and_exit_1(coordinator, workers):
    for command in ("status", "cancel", "wait"):
        proc = run_cli("workflow", command, "no-such-workflow", coordinator=coordinator.client_target)
        assert proc.returncode == 1 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr


def test_the_readme_s_workflows_run_as_written(coordinator, workers):
    env = dict(child_env(), JOBMESH_COORDINATOR=coordinator.client_target)
    proc = subprocess.run([sys.executable, "pipeline.py"], cwd=workers, env=env, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "COMPLETED {'table': 'people', 'loaded': 3}\nCOMPLETED {'words': 9}\n"
