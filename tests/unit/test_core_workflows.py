"""Workflows in the core: SUBMIT_WORKFLOW's checks, WAITING and every move out of it, the
release in the same commit as the last parent's result, cascades, the workflow's own
requests, and recovery of the index (CONTRACT.md "Workflows"; docs/PROTOCOL.md "Workflows").

The Harness (test_core.py) commits each batch and then checks that the store holds what
the core holds, so a release that did not commit with its parent's result fails there.
"""

from __future__ import annotations

from typing import Any

import pytest

from jobmesh.coordinator.core import events as ev
from jobmesh.coordinator.core.waiters import Slot
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import MAX_FRAME, encode_frame
from tests.unit.test_core import SLEEP, Conn, Harness


@pytest.fixture
def h() -> Harness:
    return Harness()


def job(ref: str, *depends: str, **fields: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"ref": ref, "taskType": "SLEEP", "payload": dict(SLEEP)}
    if depends:
        item["dependsOn"] = list(depends)
    item.update(fields)
    return item


def submit(h: Harness, now: int, *jobs: dict[str, Any], name: str | None = None) -> m.Message:
    reply = h.request(now, m.SubmitWorkflow(list(jobs), name))
    h.step(now)
    return reply


def submit_ok(h: Harness, now: int, *jobs: dict[str, Any], name: str | None = None) -> tuple[str, dict[str, str]]:
    reply = submit(h, now, *jobs, name=name)
    assert isinstance(reply, m.WorkflowSubmitted), reply
    return reply.workflow_id, reply.job_ids


def flow(h: Harness, workflow_id: str, now: int = 0, cursor: str | None = None) -> m.Workflow:
    reply = h.request(now, m.WorkflowStatus(workflow_id, cursor))
    assert isinstance(reply, m.Workflow), reply
    return reply


def events(h: Harness, job_id: str) -> list[dict[str, Any]]:
    reply = h.request(0, m.GetJobEvents(job_id))
    assert isinstance(reply, m.JobEvents)
    return reply.events


def test_a_chain_runs_step_by_step_each_with_its_parents_results(h):
    wf, ids = submit_ok(h, 0, job("fetch"), job("transform", "fetch"), job("load", "transform"), name="etl")
    snap = h.status(ids["transform"])
    assert (snap["state"], snap["waitingReason"], snap["workflowId"], snap["ref"]) == (
        "WAITING", "DEPENDENCIES", wf, "transform")
    assert h.status(ids["fetch"])["state"] == "QUEUED"
    assert h.list(state="WAITING").jobs and {j["jobId"] for j in h.list(state="WAITING").jobs} == {
        ids["transform"], ids["load"]}
    h.register(1, "w1")
    assert h.assign_of(ids["fetch"]).parents is None
    h.report(2, ids["fetch"], result={"rows": 3})
    # released in the batch of its parent's result, committed with it, and assigned
    assign = h.assign_of(ids["transform"])
    assert assign.parents == {"fetch": {"rows": 3}}
    assert h.store.get(ids["transform"]).parents == {"fetch": {"rows": 3}}
    assert [e["event"] for e in events(h, ids["transform"])] == ["SUBMITTED", "QUEUED", "ASSIGNED"]
    assert h.state(ids["load"]) == "WAITING"
    h.report(3, ids["transform"], result={"rows": 2})
    assert h.store.get(ids["transform"]).parents is None  # a finished job keeps no parents
    assert h.assign_of(ids["load"]).parents == {"transform": {"rows": 2}}
    assert flow(h, wf).state == "RUNNING"
    h.report(4, ids["load"])
    reply = flow(h, wf)
    assert (reply.name, reply.state) == ("etl", "COMPLETED")
    assert reply.jobs == [
        {"ref": "fetch", "jobId": ids["fetch"], "state": "COMPLETED", "dependsOn": []},
        {"ref": "transform", "jobId": ids["transform"], "state": "COMPLETED", "dependsOn": ["fetch"]},
        {"ref": "load", "jobId": ids["load"], "state": "COMPLETED", "dependsOn": ["transform"]}]
    assert h.core.workflows.live == {} and not h.core.workflows._listening


def test_a_diamond_releases_the_join_only_when_both_branches_completed(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a"), job("c", "a"), job("d", "b", "c"))
    h.register(1, "w1")
    h.report(2, ids["a"], result={"v": "a"})
    h.report(3, ids["b"], result={"v": "b"})
    assert h.state(ids["d"]) == "WAITING"
    h.report(4, ids["c"], result={"v": "c"})
    assert h.assign_of(ids["d"]).parents == {"b": {"v": "b"}, "c": {"v": "c"}}
    assert h.core.workflows.live[wf].results == {}  # no child waits for a result any more


def test_a_fan_in_of_many_parents(h):
    roots = [job("part%d" % i) for i in range(6)]
    wf, ids = submit_ok(h, 0, *roots, job("merge", *[r["ref"] for r in roots]))
    h.register(1, "w1", capacity=8)
    for i in range(6):
        h.report(2 + i, ids["part%d" % i], result={"n": i})
    assert h.assign_of(ids["merge"]).parents == {"part%d" % i: {"n": i} for i in range(6)}


def test_a_failed_dependency_cancels_its_subtree_but_not_an_independent_branch(h):
    wf, ids = submit_ok(h, 0, job("load", maxAttempts=1), job("clean", "load"), job("report", "clean"),
                        job("other"), job("after_other", "other"))
    h.register(1, "w1")
    h.report(2, ids["load"], success=False, error="boom")
    for ref in ("clean", "report"):
        snap = h.status(ids[ref])
        assert snap["state"] == "CANCELLED"
    assert h.status(ids["clean"])["error"] == "dependency load (job %s) FAILED" % ids["load"]
    assert h.status(ids["report"])["error"] == "dependency clean (job %s) CANCELLED" % ids["clean"]
    assert events(h, ids["clean"])[-1]["detail"] == "dependency load (job %s) FAILED" % ids["load"]
    assert flow(h, wf).state == "RUNNING"
    h.report(3, ids["other"])
    assert h.assign_of(ids["after_other"]).parents is not None
    h.report(4, ids["after_other"])
    assert flow(h, wf).state == "FAILED"


def test_cancelling_a_waiting_job_cancels_its_dependents(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a"), job("c", "b"))
    reply = h.cancel(1, ids["b"])
    assert isinstance(reply, m.JobCancel) and reply.cancelled
    assert h.status(ids["c"])["state"] == "CANCELLED"
    assert h.state(ids["a"]) == "QUEUED"
    h.register(2, "w1")
    h.report(3, ids["a"])
    assert flow(h, wf).state == "CANCELLED"


def test_a_delayed_job_released_before_its_time_is_scheduled_from_the_submit(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a", delayMillis=5000))
    h.register(1, "w1")
    h.report(2, ids["a"])
    snap = h.status(ids["b"])
    assert (snap["state"], snap["runAtMillis"]) == ("SCHEDULED", 5000)
    assert [e["event"] for e in events(h, ids["b"])] == ["SUBMITTED", "RELEASED"]
    h.sweep(5000)
    assert h.assign_of(ids["b"]).parents == {"a": {"sleptMillis": 10}}


def test_a_job_released_after_its_time_is_queued_at_once(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a", delayMillis=5))
    h.register(1, "w1")
    h.report(10, ids["a"])
    assert h.assign_of(ids["b"]).parents == {"a": {"sleptMillis": 10}}


def test_parents_results_past_a_frame_fail_the_job_and_cancel_its_dependents(h):
    big = "x" * 63_000  # each result within its own limit; 17 of them pass 1 MiB
    parts = [job("p%d" % i) for i in range(17)]
    wf, ids = submit_ok(h, 0, *parts, job("join", *[p["ref"] for p in parts]), job("after", "join"))
    h.register(1, "w1", capacity=32)
    for i in range(17):
        h.report(2, ids["p%d" % i], result={"blob": big})
    snap = h.status(ids["join"])
    assert snap["state"] == "FAILED" and "more than fit in a task assignment" in snap["error"]
    assert h.status(ids["after"])["state"] == "CANCELLED"
    assert flow(h, wf).state == "FAILED"


@pytest.mark.parametrize("jobs, words", [
    ([job("a"), {"ref": "b", "taskType": "SLEEP"}], "job 'b' is missing field 'payload'"),
    ([job("a", maxAttempts="3")], "job 'a': field 'maxAttempts' must be an integer, got a string"),
    ([job("a", "b"), job("b", "a")], "cycle: 'a' depends on 'b', which depends on 'a'"),
    ([job("x"), job("a", "x", "c"), job("b", "a"), job("c", "b")],
     "cycle: 'a' depends on 'c', which depends on 'b', which depends on 'a'"),
    ([job("j%d" % i, "j%d" % ((i + 1) % 20)) for i in range(20)],
     "cycle: 'j0' depends on 'j1', which depends on 'j2', which depends on 'j3', which depends on 'j4', "
     "which depends on 'j5', which depends on 'j6', which depends on 'j7', ... (20 jobs in all)"),
    ([job("a"), job("b", "c")], "unknown ref"),
    ([job("a"), job("a")], "appears twice"),
    ([job("a", "a")], "depends on itself"),
    ([job("a"), job("b", "a", "a")], "twice"),
    ([job("a"), job("b", taskType="NO_SUCH_TYPE")], "job 'b': unknown task type"),
    ([job("a"), job("b", payload={"durationMillis": "x"})], "job 'b'"),
    ([job("a"), job("b", maxAttempts="3")], "job 'b'"),
    ([job("a"), job("b", resultTtlMillis=10)], "resultTtlMillis"),
    ([job("a b")], "ref must be"),
    ([job("a", dependsOn="b")], "dependsOn must be a list"),
    ([job("a"), job("b", dependsOn=[{"ref": "a"}])], "unknown ref"),
    ([job("a"), 7], "jobs[1] must be an object"),
    ([{"ref": 5, "taskType": "SLEEP", "payload": {}}], "ref must be"),
    ([{"ref": "x" * 129, "taskType": "SLEEP", "payload": {}}], "ref must be"),
    ([job("a", taskType=None)], "job 'a'"),
    ([job("a", idempotencyKey="schedule:x:1")], "belong to recurring schedules"),
    ([], "1..10000 jobs"),
    ([job("j%d" % i) for i in range(10_001)], "1..10000 jobs"),
])
def test_a_bad_workflow_is_an_error_and_creates_nothing(h, jobs, words):
    h.submit_ok(0)
    before = h.store.count()
    reply = submit(h, 1, *jobs)
    assert isinstance(reply, m.Error) and words in reply.message, reply
    assert h.store.count() == before and h.core.active_count == 1 and h.core.workflows.live == {}


def test_admission_takes_a_workflow_whole_or_refuses_it_whole():
    h = Harness(max_active_jobs=5)
    h.submit_ok(0)
    reply = submit(h, 1, *[job("j%d" % i) for i in range(5)])
    assert isinstance(reply, m.SubmitRejected) and reply.limit == 5
    assert h.store.count() == 1
    submit_ok(h, 2, *[job("j%d" % i) for i in range(4)])
    assert h.core.active_count == 5


def test_idempotency_keys_a_resend_answers_the_same_workflow_and_a_foreign_key_is_an_error(h):
    first = submit_ok(h, 0, job("a", idempotencyKey="k-a"), job("b", "a", idempotencyKey="k-b"), job("c", "b"))
    assert submit(h, 1, job("a", idempotencyKey="k-a"), job("b", "a", idempotencyKey="k-b"), job("c", "b")) == \
        m.WorkflowSubmitted(*first)
    count = h.store.count()
    lone = h.submit_ok(2, key="lone")
    reply = submit(h, 3, job("a", idempotencyKey="lone"))
    assert isinstance(reply, m.Error) and lone in reply.message
    reply = submit(h, 4, job("x", idempotencyKey="k-a"), job("y", idempotencyKey="fresh"))
    assert isinstance(reply, m.Error) and "k-a" in reply.message
    assert h.store.count() == count + 1


def test_a_unique_key_held_by_a_live_job_is_an_error(h):
    held = h.request(0, m.SubmitJob("SLEEP", dict(SLEEP), unique_key="u1"))
    h.step(0)
    reply = submit(h, 1, job("a"), job("b", uniqueKey="u1"))
    assert isinstance(reply, m.Error) and held.job_id in reply.message and "'b'" in reply.message
    reply = submit(h, 2, job("a", uniqueKey="u2"), job("b", uniqueKey="u2"))
    assert isinstance(reply, m.Error) and "same uniqueKey" in reply.message


def test_workflow_cancel_cancels_every_job_not_finished_and_revokes_running_ones(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b"), job("c", "a", "b"))
    conn = h.register(1, "w1")
    h.report(2, ids["a"])
    reply = h.request(3, m.WorkflowCancel(wf))
    h.step(3)
    assert isinstance(reply, m.Workflow) and reply.state == "CANCELLED"
    assert [j["state"] for j in reply.jobs] == ["COMPLETED", "CANCELLED", "CANCELLED"]
    assert [c.job_id for c in h.cancels(conn)] == [ids["b"]]


def test_unknown_workflows_are_errors(h):
    for msg in (m.WorkflowStatus("nope"), m.WorkflowCancel("nope"), m.WaitWorkflow("nope", 10)):
        reply = h.request(0, msg)
        assert isinstance(reply, m.Error) and "unknown workflow" in reply.message


def test_wait_workflow_is_answered_when_it_ends_or_when_its_time_is_up(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a"))
    assert h.request(1, m.WaitWorkflow(wf, 0)).state == "RUNNING"
    assert isinstance(h.request(1, m.WaitWorkflow(wf, -1)), m.Error)
    pending = h.request(1, m.WaitWorkflow(wf, 60_000))
    timed = h.request(1, m.WaitWorkflow(wf, 100), Conn("other"))
    assert isinstance(pending, Slot) and isinstance(timed, Slot)
    h.step(1)
    assert h.core.next_deadlines().waits == 101
    h.apply(101, ev.Expire())
    h.step(101)
    [(waiter, reply)] = h.take_answers()
    assert waiter.token is timed and reply.state == "RUNNING"
    h.register(200, "w1")
    h.report(201, ids["a"])
    assert h.take_answers() == []
    h.report(202, ids["b"])
    [(waiter, reply)] = h.take_answers()
    assert waiter.token is pending and reply.state == "COMPLETED"
    assert h.request(203, m.WaitWorkflow(wf, 60_000)).state == "COMPLETED"


def test_a_large_workflow_pages_its_jobs():
    h = Harness(max_active_jobs=20_000)
    refs = ["r%0125d" % i for i in range(10_000)]
    wf, ids = submit_ok(h, 0, *[{"ref": ref, "taskType": "SLEEP", "payload": dict(SLEEP)} for ref in refs])
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        reply = flow(h, wf, cursor=cursor)
        assert len(encode_frame(reply.to_wire())) < MAX_FRAME
        seen += [j["ref"] for j in reply.jobs]
        pages += 1
        cursor = reply.next_cursor
        if cursor is None:
            break
    assert seen == refs and pages > 1
    assert isinstance(h.request(0, m.WorkflowStatus(wf, "bad")), m.Error)


def test_a_page_is_built_once_while_its_workflow_does_not_change_and_anew_once_it_does(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a"))
    first = flow(h, wf)
    assert flow(h, wf, 1) is first and h.request(1, m.WaitWorkflow(wf, 0)) is first  # readers share one page
    assert flow(h, wf, 1, cursor="1") is not first and flow(h, wf, 1) is not first  # another page is another
    h.register(2, "w1")
    h.report(3, ids["a"])
    moved = flow(h, wf, 4)
    assert [j["state"] for j in moved.jobs] == ["COMPLETED", "RUNNING"] and moved is flow(h, wf, 4)
    cancelled = h.request(5, m.WorkflowCancel(wf))
    h.step(5)
    assert isinstance(cancelled, m.Workflow) and cancelled.state == "CANCELLED"
    assert [j["state"] for j in cancelled.jobs] == ["COMPLETED", "CANCELLED"] and flow(h, wf, 6) is cancelled


def test_recovery_rebuilds_the_index_and_the_join_gets_every_parent(tmp_path):
    from jobmesh.store.sqlite import SQLiteStore
    path = str(tmp_path / "wf.db")
    h = Harness(store=SQLiteStore(path))
    wf, ids = submit_ok(h, 0, job("a"), job("b"), job("c", "a", "b"), job("d", "c"))
    h.register(1, "w1")
    h.report(2, ids["a"], result={"v": "a"})
    h.store.close()
    # restarted: a's result is read back from the store for c
    h2 = Harness(store=SQLiteStore(path), prefix="n")
    stats = h2.core.recover(100)
    h2.commit()
    assert (stats.waiting, stats.workflows) == (2, 1)
    assert h2.core.workflows.live[wf].pending == {2: 1, 3: 1}
    h2.register(101, "w2")
    h2.report(102, ids["b"], result={"v": "b"})
    assert h2.assign_of(ids["c"]).parents == {"a": {"v": "a"}, "b": {"v": "b"}}
    h2.report(103, ids["c"])
    h2.report(104, ids["d"])
    assert flow(h2, wf).state == "COMPLETED"
    h2.store.close()
    # a finished workflow that left memory is read back from the store
    h3 = Harness(store=SQLiteStore(path), prefix="m")
    h3.core.recover(200)
    assert h3.core.workflows.live == {}
    reply = flow(h3, wf)
    assert reply.state == "COMPLETED" and [j["ref"] for j in reply.jobs] == ["a", "b", "c", "d"]
    h3.store.close()


def test_recovery_cancels_the_dependents_of_a_final_attempt_lost_in_the_restart(tmp_path):
    from jobmesh.store.sqlite import SQLiteStore
    path = str(tmp_path / "wf.db")
    h = Harness(store=SQLiteStore(path))
    wf, ids = submit_ok(h, 0, job("a", maxAttempts=1), job("b", "a"))
    h.register(1, "w1")
    assert h.state(ids["a"]) == "RUNNING"
    h.store.close()
    h2 = Harness(store=SQLiteStore(path), prefix="n")
    h2.core.recover(100)
    h2.commit()
    assert h2.state(ids["a"]) == "FAILED"
    assert h2.status(ids["b"])["state"] == "CANCELLED"
    assert flow(h2, wf).state == "FAILED"
    h2.store.close()


def test_purges_take_a_workflow_whole_and_only_once_it_has_ended(h):
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a"))
    h.register(1, "w1")
    h.report(2, ids["a"])
    lone = h.submit_ok(3)
    h.cancel(3, lone)
    purge = m.PurgeJobs(0)
    assert h.request(10, purge) == m.JobsPurged(1, False)  # the lone job; a's workflow runs on
    h.step(10)
    assert h.state(ids["a"]) == "COMPLETED"
    h.report(11, ids["b"])
    assert flow(h, wf, 11).state == "COMPLETED"
    assert h.request(20, purge) == m.JobsPurged(2, False)
    h.step(20)
    assert h.store.load_workflow(wf) is None and h.store.get(ids["b"]) is None
    reply = h.request(21, m.WorkflowStatus(wf))
    assert isinstance(reply, m.Error) and "unknown workflow" in reply.message


def test_retention_purges_a_finished_workflow_with_its_jobs():
    h = Harness(retain_finished_millis=100)
    wf, ids = submit_ok(h, 0, job("a"), job("b", "a", maxAttempts=1))
    h.register(1, "w1")
    h.report(2, ids["a"])
    h.sweep(1000)
    assert h.store.get(ids["a"]) is not None  # its workflow has not ended
    h.report(1001, ids["b"], success=False, error="boom")
    h.sweep(1050)
    assert h.store.get(ids["a"]) is not None and flow(h, wf, 1050).state == "FAILED"  # ended too recently
    h.sweep(2000)
    assert h.store.get(ids["a"]) is None and h.store.get(ids["b"]) is None and h.store.load_workflow(wf) is None


def test_the_workflows_gauge_counts_them_by_state(h):
    wf, ids = submit_ok(h, 0, job("a", maxAttempts=1), job("b", "a"))
    other, _ = submit_ok(h, 0, job("x"))
    assert h.core.metrics().workflows_by_state == {"RUNNING": 2, "COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}
    h.register(1, "w1")
    h.report(2, ids["a"], success=False, error="boom")
    h.request(3, m.WorkflowCancel(other))
    h.step(3)
    assert h.core.metrics().workflows_by_state == {"RUNNING": 0, "COMPLETED": 0, "FAILED": 1, "CANCELLED": 1}


def test_a_resend_whose_jobs_hold_unique_keys_answers_its_workflow(h):
    jobs = (job("a", idempotencyKey="ku-a", uniqueKey="u-a"), job("b", "a", idempotencyKey="ku-b"))
    first = submit_ok(h, 0, *jobs)
    assert submit(h, 1, *jobs) == m.WorkflowSubmitted(*first)


@pytest.mark.parametrize("seed", range(30))
def test_random_workflows_with_failures_cancels_and_restarts_release_each_job_rightly(tmp_path, seed):
    """A random graph run to its end through random completions, failures, cancels and
    restarts: a job runs only once all its parents completed, with exactly their results;
    a job with a failed or cancelled parent ends CANCELLED; the store always holds what
    memory holds (the Harness checks after each batch)."""
    import random

    from jobmesh.store.sqlite import SQLiteStore

    rng = random.Random(seed)
    n = rng.randint(2, 14)
    parents = {i: sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) for i in range(n)}
    refs = ["j%d" % i for i in range(n)]
    path = str(tmp_path / "wf.db")
    h = Harness(store=SQLiteStore(path))
    wf, ids = submit_ok(h, 0, *[job(refs[i], *[refs[p] for p in parents[i]], maxAttempts=1) for i in range(n)])
    by_id = {job_id: ref for ref, job_id in ids.items()}
    h.register(0, "w", capacity=64)
    cancelled: set[str] = set()  # cancelled by the test itself
    now, generation = 1, 0
    while flow(h, wf, now).state == "RUNNING":
        now += 1
        running = [j for j in h.core.table.jobs.values() if j.workflow_id == wf and j.state.value == "RUNNING"]
        live = [j for j in h.core.table.jobs.values() if j.workflow_id == wf]
        action = rng.random()
        if action < 0.08:  # a restart: a new core over the same file
            h.store.close()
            generation += 1
            h = Harness(store=SQLiteStore(path), prefix="g%d" % generation)
            h.core.recover(now)
            h.commit()
            h.register(now, "w", capacity=64)
        elif action < 0.18 and live:
            target = rng.choice(live)
            cancelled.add(by_id[target.job_id])
            h.cancel(now, target.job_id)
        elif running:
            target = rng.choice(running)
            assign = h.assign_of(target.job_id)
            ref = by_id[target.job_id]
            expected = {refs[p]: {"r": refs[p]} for p in parents[int(ref[1:])]}
            assert assign.parents == (expected or None), (ref, assign.parents)
            if rng.random() < 0.15:
                h.report(now, target.job_id, success=False, error="boom")
            else:
                h.report(now, target.job_id, result={"r": ref})
        else:
            h.sweep(now)
        assert now < 10_000, "the workflow never ended"
    states = {ref: h.status(ids[ref])["state"] for ref in refs}
    for i, ref in enumerate(refs):
        parent_states = {states[refs[p]] for p in parents[i]}
        if parent_states - {"COMPLETED"}:
            assert states[ref] == "CANCELLED", (ref, states)
        elif ref not in cancelled:
            assert states[ref] in ("COMPLETED", "FAILED"), (ref, states)
    h.store.close()


@pytest.mark.parametrize("name", ["", "n" * 257])
def test_a_workflow_name_out_of_bounds_is_an_error(h, name):
    reply = submit(h, 0, job("a"), name=name)
    assert isinstance(reply, m.Error) and "name is 1..256 characters" in reply.message
    assert h.store.count() == 0
