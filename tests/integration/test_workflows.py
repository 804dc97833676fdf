"""Workflows against a real coordinator, on SQLite and PostgreSQL: a diamond run by a real
worker, the join's TASK_ASSIGN with its parents' results, WAIT_WORKFLOW, WORKFLOW_CANCEL,
a failed parent's subtree cancelled beside a branch that goes on, bad workflows that make
nothing, and a restart with jobs still waiting.

Spec: CONTRACT.md "Workflows"; docs/PROTOCOL.md "Workflows". The tests of a store share
one coordinator; each uses task types of its own (its scripted worker alone declares
them), except the real worker's, which only its test submits.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.pg_support import on_both_stores
from tests.support.peers import wait_registered

USER_TASKS = Path(__file__).resolve().parent.parent / "user_tasks_module.py"
_serial = itertools.count(1)


def own_type() -> str:
    return "WF-%d" % next(_serial)


def job(ref: str, task_type: str, *depends: str, **fields) -> dict:
    item = {"ref": ref, "taskType": task_type, "payload": {"ref": ref}}
    if depends:
        item["dependsOn"] = list(depends)
    item.update(fields)
    return item


def submit(client, *jobs: dict, **fields) -> dict:
    return client.request(dict({"type": "SUBMIT_WORKFLOW", "jobs": list(jobs)}, **fields))


def submit_ok(client, *jobs: dict, **fields) -> tuple[str, dict]:
    reply = submit(client, *jobs, **fields)
    assert reply["type"] == "WORKFLOW_SUBMITTED", reply
    return reply["workflowId"], reply["jobIds"]


def workflow(client, workflow_id: str) -> dict:
    reply = client.request({"type": "WORKFLOW_STATUS", "workflowId": workflow_id})
    assert reply["type"] == "WORKFLOW", reply
    return reply


def diamond(task_type: str) -> list[dict]:
    return [job("a", task_type), job("b", task_type, "a"), job("c", task_type, "a"), job("d", task_type, "b", "c")]


def started(coord, peers, jobs_of) -> tuple:
    """A client, a scripted worker of a task type of its own, and the workflow
    ``jobs_of(task_type)`` submitted: ``(client, worker, workflow id, job ids by ref)``."""
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-" + task_type, capacity=4, task_types=[task_type])
    workflow_id, ids = submit_ok(client, *jobs_of(task_type))
    return client, worker, workflow_id, ids


@on_both_stores
def test_a_diamond_runs_on_a_real_worker_and_wait_workflow_answers_when_it_ends(shared_on_store, worker_procs,
                                                                                   peers, tmp_path):
    coord = shared_on_store
    client = peers.client(coord)
    worker_id = "w-real-%s" % next(_serial)
    worker_procs.start(coord, worker_id, capacity=2, tasks="user_tasks_module", cwd=USER_TASKS.parent)
    wait_registered(client, [worker_id])
    jobs = [dict(j, payload={"name": j["ref"]}) for j in diamond("GREET")]
    workflow_id, ids = submit_ok(client, *jobs, name="greetings")
    reply = client.request({"type": "WAIT_WORKFLOW", "workflowId": workflow_id, "timeoutMillis": 60_000})
    assert reply["type"] == "WORKFLOW" and reply["state"] == "COMPLETED", reply
    assert (reply["workflowId"], reply["name"]) == (workflow_id, "greetings")
    assert reply["jobs"] == [{"ref": r, "jobId": ids[r], "state": "COMPLETED", "dependsOn": d}
                             for r, d in (("a", []), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"]))]
    snap = client.status(ids["d"])
    assert (snap["workflowId"], snap["ref"], snap["result"]) == (workflow_id, "d", {"greeting": "hello d"})
    events = client.request({"type": "GET_JOB_EVENTS", "jobId": ids["d"]})["events"]
    assert [e["event"] for e in events][:3] == ["SUBMITTED", "QUEUED", "ASSIGNED"]


@on_both_stores
def test_the_join_is_assigned_with_both_parents_results_only_once_both_completed(shared_on_store, peers):
    client, worker, workflow_id, ids = started(shared_on_store, peers, diamond)
    waiting = client.list_jobs(state="WAITING", taskType=worker.worker_id[2:])["jobs"]  # "w-" + its type
    assert {j["jobId"] for j in waiting} == {ids["b"], ids["c"], ids["d"]}
    assert {j["waitingReason"] for j in waiting} == {"DEPENDENCIES"}
    a = worker.await_assign()
    assert a["jobId"] == ids["a"] and "parents" not in a
    worker.complete(a, {"v": "a"})
    first, second = worker.await_assign(), worker.await_assign()
    assert {first["jobId"], second["jobId"]} == {ids["b"], ids["c"]}
    assert first["parents"] == second["parents"] == {"a": {"v": "a"}}
    worker.complete(first, {"v": first["payload"]["ref"]})
    assert worker.poll_assign(0.3) is None
    assert client.state(ids["d"]) == "WAITING"
    worker.complete(second, {"v": second["payload"]["ref"]})
    join = worker.await_assign()
    assert join["jobId"] == ids["d"] and join["parents"] == {"b": {"v": "b"}, "c": {"v": "c"}}
    worker.complete(join, {})
    assert client.request({"type": "WAIT_WORKFLOW", "workflowId": workflow_id,
                           "timeoutMillis": 10_000})["state"] == "COMPLETED"


@on_both_stores
def test_a_failed_parent_cancels_its_subtree_and_an_independent_branch_goes_on(shared_on_store, peers):
    client, worker, workflow_id, ids = started(shared_on_store, peers, lambda t: [
        job("load", t, maxAttempts=1), job("clean", t, "load"), job("report", t, "clean"), job("other", t),
        job("after", t, "other")])
    assigned = {a["jobId"]: a for a in (worker.await_assign(), worker.await_assign())}
    worker.fail(assigned[ids["load"]], "boom")
    client.wait_state(ids["report"], "CANCELLED")
    clean = client.status(ids["clean"])
    assert clean["state"] == "CANCELLED" and clean["error"] == "dependency load (job %s) FAILED" % ids["load"]
    assert workflow(client, workflow_id)["state"] == "RUNNING"
    worker.complete(assigned[ids["other"]], {"ok": True})
    after = worker.await_assign()
    assert after["jobId"] == ids["after"] and after["parents"] == {"other": {"ok": True}}
    worker.complete(after, {})
    client.wait_state(ids["after"], "COMPLETED")
    assert workflow(client, workflow_id)["state"] == "FAILED"


@on_both_stores
def test_workflow_cancel_cancels_what_has_not_ended_and_revokes_running_attempts(shared_on_store, peers):
    client, worker, workflow_id, ids = started(shared_on_store, peers, diamond)
    running = worker.await_assign()
    reply = client.request({"type": "WORKFLOW_CANCEL", "workflowId": workflow_id})
    assert reply["type"] == "WORKFLOW" and reply["state"] == "CANCELLED"
    assert {j["state"] for j in reply["jobs"]} == {"CANCELLED"}
    assert worker.await_cancel()["jobId"] == running["jobId"] == ids["a"]
    unknown = client.request({"type": "WORKFLOW_CANCEL", "workflowId": "no-such-workflow"})
    assert unknown["type"] == "ERROR" and "unknown workflow" in unknown["message"]


def sleep(ref: str, *depends: str) -> dict:
    return job(ref, "SLEEP", *depends, payload={"durationMillis": 1})


@pytest.mark.parametrize("jobs, words", [
    ([sleep("a", "b"), sleep("b", "a")], "cycle"),
    ([sleep("a", "nope")], "unknown ref"),
    ([sleep("a"), sleep("a")], "appears twice"),
    ([sleep("a"), job("b", "NO_SUCH_TYPE")], "job 'b': unknown task type"),
    ([sleep("a"), dict(sleep("b"), payload={})], "job 'b': SLEEP payload needs field"),
    ([sleep("j%d" % i) for i in range(10_001)], "1..10000 jobs"),
])
def test_a_bad_workflow_is_an_error_that_makes_nothing_and_keeps_the_connection(shared_coordinator, peers, jobs,
                                                                                   words):
    client = peers.client(shared_coordinator)
    before = client.list_jobs(limit=1000)["jobs"]
    reply = submit(client, *jobs)
    assert reply["type"] == "ERROR" and words in reply["message"], reply
    assert client.list_jobs(limit=1000)["jobs"] == before
    unknown = client.request({"type": "WORKFLOW_STATUS", "workflowId": "no-such-workflow"})
    assert unknown["type"] == "ERROR" and "unknown workflow" in unknown["message"]


@on_both_stores
def test_a_restart_keeps_waiting_jobs_and_the_join_still_gets_every_parent(coordinator_factory, peers):
    # Given a diamond whose first job completed and one branch runs when the coordinator is killed
    coord = coordinator_factory()
    client = peers.client(coord)
    task_type = own_type()
    worker = peers.worker(coord, "w-" + task_type, capacity=1, task_types=[task_type])
    workflow_id, ids = submit_ok(client, *diamond(task_type))
    worker.complete(worker.await_assign(), {"v": "a"})
    running = worker.await_assign()
    coord.kill()
    # When it starts again on the same database
    coord.start()
    client = peers.client(coord)
    assert {j["jobId"] for j in client.list_jobs(state="WAITING")["jobs"]} == {ids["d"]}
    worker = peers.worker(coord, "w2-" + task_type, capacity=2, task_types=[task_type])
    # Then the branches run again with the parents they were released with, and the join gets both
    branches = {a["jobId"]: a for a in (worker.await_assign(), worker.await_assign())}
    assert set(branches) == {ids["b"], ids["c"]} and running["jobId"] in branches
    assert all(a["parents"] == {"a": {"v": "a"}} for a in branches.values())
    for a in branches.values():
        worker.complete(a, {"v": a["payload"]["ref"]})
    join = worker.await_assign()
    assert join["jobId"] == ids["d"] and join["parents"] == {"b": {"v": "b"}, "c": {"v": "c"}}
    worker.complete(join, {})
    reply = client.request({"type": "WAIT_WORKFLOW", "workflowId": workflow_id, "timeoutMillis": 10_000})
    assert reply["state"] == "COMPLETED"



def test_parents_results_past_a_frame_fail_the_join_with_an_error_saying_so(shared_coordinator, peers):
    # Given a fan-in of 17 parents whose results (63 KB each, within a result's 64 KiB) together pass 1 MiB
    parents = ["p%d" % i for i in range(17)]
    client, worker, workflow_id, ids = started(shared_coordinator, peers, lambda t: [
        job(p, t) for p in parents] + [job("join", t, *parents), job("after", t, "join")])
    # When every parent completes
    for _ in parents:
        worker.complete(worker.await_assign(), {"blob": "x" * 63_000})
    # Then the join is never assigned: it fails, saying why, and what follows it is cancelled
    join = client.wait_state(ids["join"], "FAILED")
    assert "more than fit in a task assignment" in join["error"] and "1 MiB" in join["error"], join
    after = client.wait_state(ids["after"], "CANCELLED")
    assert after["error"] == "dependency join (job %s) FAILED" % ids["join"]
    assert workflow(client, workflow_id)["state"] == "FAILED"
    assert worker.poll_assign(0) is None


def test_a_delay_counts_from_the_submit_and_a_job_released_before_its_time_is_scheduled(shared_coordinator, peers):
    client, worker, workflow_id, ids = started(shared_coordinator, peers, lambda t: [
        job("first", t), job("later", t, "first", delayMillis=3_600_000)])
    submitted = client.status(ids["later"])
    assert (submitted["state"], submitted["waitingReason"]) == ("WAITING", "DEPENDENCIES")
    assert submitted["runAtMillis"] == submitted["createdAtMillis"] + 3_600_000
    worker.complete(worker.await_assign(), {})
    released = client.wait_state(ids["later"], "SCHEDULED")
    assert (released["runAtMillis"], released["waitingReason"]) == (submitted["runAtMillis"], "SCHEDULED")
    events = client.request({"type": "GET_JOB_EVENTS", "jobId": ids["later"]})["events"]
    assert [e["event"] for e in events] == ["SUBMITTED", "RELEASED"]
    # A wait that runs out is answered with the workflow as it stands, as WAIT_JOB's is
    waited = client.request({"type": "WAIT_WORKFLOW", "workflowId": workflow_id, "timeoutMillis": 50})
    assert (waited["type"], waited["state"]) == ("WORKFLOW", "RUNNING"), waited
    assert [j["state"] for j in waited["jobs"]] == ["COMPLETED", "SCHEDULED"]
    client.request({"type": "WORKFLOW_CANCEL", "workflowId": workflow_id})


def test_a_workflow_past_the_frame_limit_pages_its_jobs_with_cursor_and_next_cursor(shared_coordinator, peers):
    # Given 5,000 jobs with long refs: the whole WORKFLOW would pass a frame
    refs = ["child-%05d-%s" % (i, "r" * 108) for i in range(5_000)]
    client, worker, workflow_id, ids = started(shared_coordinator, peers, lambda t: [
        {"ref": "root", "taskType": t, "payload": {}}] + [
        {"ref": ref, "taskType": t, "payload": {}, "dependsOn": ["root"]} for ref in refs])
    # When its pages are read, each following the last one's nextCursor
    pages = [workflow(client, workflow_id)]
    while "nextCursor" in pages[-1]:
        pages.append(client.request({"type": "WORKFLOW_STATUS", "workflowId": workflow_id,
                                     "cursor": pages[-1]["nextCursor"]}))
    # Then there are several, and together they hold every job once, in the submit's order
    assert len(pages) > 1 and {p["type"] for p in pages} == {"WORKFLOW"}, [p.get("message") for p in pages]
    jobs = [j for page in pages for j in page["jobs"]]
    assert [(j["ref"], j["jobId"]) for j in jobs] == [(ref, ids[ref]) for ref in ["root"] + refs]
    assert {j["state"] for j in jobs[1:]} == {"WAITING"} and {tuple(j["dependsOn"]) for j in jobs[1:]} == {("root",)}
    # and WORKFLOW_CANCEL's answer, too, is a page that fits a frame
    cancelled = client.request({"type": "WORKFLOW_CANCEL", "workflowId": workflow_id})
    assert cancelled["type"] == "WORKFLOW" and cancelled["state"] == "CANCELLED" and "nextCursor" in cancelled


def test_a_step_that_succeeds_on_a_retry_releases_its_dependents_and_priorities_order_released_jobs(
        shared_coordinator, peers):
    # Given a step with two attempts, and two dependents of it, the second of higher priority
    client, worker, workflow_id, ids = started(shared_coordinator, peers, lambda t: [
        job("flaky", t, maxAttempts=2), job("low", t, "flaky", priority="LOW"),
        job("high", t, "flaky", priority="HIGH")])
    # When its first attempt fails and its second completes
    worker.fail(worker.await_assign(), "passing trouble")
    retried = worker.await_assign()
    assert retried["jobId"] == ids["flaky"] and retried["attemptNumber"] == 2, retried
    assert client.state(ids["low"]) == "WAITING"
    worker.complete(retried, {"v": 2})
    # Then both dependents are released with its result, the HIGH one assigned first
    first, second = worker.await_assign(), worker.await_assign()
    assert (first["jobId"], second["jobId"]) == (ids["high"], ids["low"])
    assert first["parents"] == second["parents"] == {"flaky": {"v": 2}}
    worker.complete(first, {})
    worker.complete(second, {})
    reply = client.request({"type": "WAIT_WORKFLOW", "workflowId": workflow_id, "timeoutMillis": 10_000})
    assert reply["state"] == "COMPLETED", reply
