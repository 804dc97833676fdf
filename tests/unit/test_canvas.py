"""Workflow shapes (jobmesh/canvas.py) compiled into SUBMIT_WORKFLOW's jobs: refs, dependsOn,
nesting, the options of a step, and what is refused before anything is sent. Pure."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from jobmesh.canvas import MAX_WORKFLOW_JOBS, CanvasError, Step, chain, chord, compile_jobs, group, step
from jobmesh.client.api import resends_workflow, workflow_request
from jobmesh.protocol import messages as m
from jobmesh.worker import task
from jobmesh.worker.usertasks import unregister


def shape(node) -> dict[str, list[str]]:
    """ref -> the refs it depends on, in order."""
    return {job.ref: list(job.depends_on) for job in compile_jobs(node)}


def test_a_chain_runs_each_stage_after_the_one_before():
    assert shape(chain(step("FETCH"), step("TRANSFORM"), step("LOAD"))) == {
        "FETCH.0": [], "TRANSFORM.0": ["FETCH.0"], "LOAD.0": ["TRANSFORM.0"]}


def test_a_group_runs_side_by_side_and_takes_a_generator():
    assert shape(group(step("A", {"i": i}) for i in range(3))) == {"A.0": [], "A.1": [], "A.2": []}
    assert shape(group([step("A"), step("B")])) == {"A.0": [], "B.0": []}


def test_a_chord_s_callback_follows_every_member_of_its_group():
    assert shape(chord(group(step("RESIZE", {"i": i}) for i in range(3)), step("ALBUM"))) == {
        "RESIZE.0": [], "RESIZE.1": [], "RESIZE.2": [], "ALBUM.0": ["RESIZE.0", "RESIZE.1", "RESIZE.2"]}
    # a header given as a list (or generator) is a group
    assert shape(chord([step("A"), step("A")], step("B"))) == {"A.0": [], "A.1": [], "B.0": ["A.0", "A.1"]}


def test_a_chain_of_groups_makes_each_member_follow_every_leaf_before_it():
    got = shape(chain(group(step("A"), step("A")), group(step("B"), step("B")), step("C")))
    assert got == {"A.0": [], "A.1": [], "B.0": ["A.0", "A.1"], "B.1": ["A.0", "A.1"], "C.0": ["B.0", "B.1"]}


def test_a_group_of_chains_runs_the_chains_side_by_side_and_a_chain_after_it_waits_for_their_ends():
    got = shape(chain(step("START"), group(chain(step("X"), step("Y")), chain(step("X"), step("Y"))), step("END")))
    assert got == {"START.0": [], "X.0": ["START.0"], "Y.0": ["X.0"], "X.1": ["START.0"], "Y.1": ["X.1"],
                   "END.0": ["Y.0", "Y.1"]}


def test_a_diamond_and_a_chord_inside_a_chain():
    diamond = chain(step("TOP"), group(step("LEFT"), step("RIGHT")), step("BOTTOM"))
    assert shape(diamond) == {"TOP.0": [], "LEFT.0": ["TOP.0"], "RIGHT.0": ["TOP.0"],
                              "BOTTOM.0": ["LEFT.0", "RIGHT.0"]}
    inner = chain(step("PREP"), chord(group(step("MAP"), step("MAP")), step("REDUCE")), step("PUBLISH"))
    assert shape(inner) == {"PREP.0": [], "MAP.0": ["PREP.0"], "MAP.1": ["PREP.0"], "REDUCE.0": ["MAP.0", "MAP.1"],
                            "PUBLISH.0": ["REDUCE.0"]}


def test_an_empty_group_lets_the_next_stage_follow_what_came_before():
    assert shape(chain(step("A"), group(), step("B"))) == {"A.0": [], "B.0": ["A.0"]}


def test_pipe_is_chain():
    assert shape(step("A") | group(step("B"), step("B")) | step("C")) == {
        "A.0": [], "B.0": ["A.0"], "B.1": ["A.0"], "C.0": ["B.0", "B.1"]}


def test_refs_given_are_kept_and_generated_ones_step_around_them():
    got = shape(chain(step("A", ref="A.0"), step("A"), step("A", ref="last")))
    assert got == {"A.0": [], "A.1": ["A.0"], "last": ["A.1"]}
    assert shape(step("RESIZE").set(ref="cover")) == {"cover": []}


def test_the_same_shape_gets_the_same_refs():
    def make():
        return chord(group(step("RESIZE", {"i": i}) for i in range(5)), step("ALBUM"))
    assert [j.ref for j in compile_jobs(make())] == [j.ref for j in compile_jobs(make())]


def test_a_step_used_twice_is_two_jobs():
    s = step("PING")
    assert shape(chain(s, s)) == {"PING.0": [], "PING.1": ["PING.0"]}


def test_a_generated_ref_of_a_long_task_type_stays_within_128_characters():
    long_type = "T" * 128
    refs = [j.ref for j in compile_jobs(group(step(long_type), step(long_type)))]
    assert [len(r) for r in refs] == [128, 128] and len(set(refs)) == 2


@pytest.mark.parametrize("node,message", [
    (chain(step("A", ref="x"), step("B", ref="x")), "ref 'x' is given to two steps"),
    (step("A", ref="has space"), "ref 'has space' is invalid"),
    (step("A", ref=""), "ref '' is invalid"),
    (step("bad type!"), "task type 'bad type!' is invalid"),
    (group(), "at least one job"),
])
def test_shapes_that_cannot_be_workflows_are_refused(node, message):
    with pytest.raises(CanvasError, match=message):
        compile_jobs(node)


def test_more_than_ten_thousand_jobs_are_refused_before_anything_is_sent():
    assert len(compile_jobs(group(step("A") for _ in range(MAX_WORKFLOW_JOBS)))) == MAX_WORKFLOW_JOBS
    with pytest.raises(CanvasError, match="at most 10000 jobs; this one has 10001"):
        compile_jobs(group(step("A") for _ in range(MAX_WORKFLOW_JOBS + 1)))
    with pytest.raises(CanvasError, match="at most 10000 jobs"):
        workflow_request([{"ref": "r%d" % i, "taskType": "A", "payload": {}} for i in range(MAX_WORKFLOW_JOBS + 1)])


@pytest.mark.parametrize("bad", [lambda: group(step("A"), "B"), lambda: chain(step("A"), 3),
                                 lambda: chord(group(step("A")), "B"), lambda: compile_jobs([step("A")])])
def test_members_that_are_not_shapes_are_refused(bad):
    with pytest.raises(CanvasError):
        bad()


def test_step_options_are_submit_s_and_compile_to_its_wire_fields():
    s = step("RESIZE", {"image": "a.png"}, priority="HIGH", max_attempts=5, delay=timedelta(seconds=2),
             timeout_millis=30_000, concurrency_key="acme", unique_key="u", idempotency_key="mine")
    (job,) = workflow_request(s).jobs
    assert job == {"ref": "RESIZE.0", "taskType": "RESIZE", "payload": {"image": "a.png"}, "priority": "HIGH",
                   "maxAttempts": 5, "delayMillis": 2000, "timeoutMillis": 30_000,
                   "concurrencyKey": "acme", "uniqueKey": "u", "idempotencyKey": "mine"}
    # a plain step carries only what it says: 10,000 of them fit in a frame
    assert workflow_request(step("A")).jobs == [{"ref": "A.0", "taskType": "A", "payload": {}}]
    with pytest.raises(CanvasError, match="unknown step option retries"):
        step("A").set(retries=3)
    with pytest.raises(TypeError, match="max_attempts"):
        workflow_request(step("A", max_attempts="many"))  # type: ignore[arg-type]


def test_a_time_to_live_of_its_own_is_refused_before_sending_since_a_workflow_is_purged_whole():
    # The coordinator refuses resultTtlMillis in a workflow; the library says so first
    with pytest.raises(CanvasError, match="a step takes no result_ttl_millis: a workflow's jobs are kept and purged"):
        step("A").set(result_ttl_millis=60_000)
    with pytest.raises(TypeError):
        step("A", result_ttl_millis=60_000)  # type: ignore[call-arg]


def test_a_request_s_jobs_get_keys_from_its_idempotency_key_and_only_then_is_it_resent():
    node = chain(step("A"), step("B", idempotency_key="own"))
    keyed = workflow_request(node, "etl", idempotency_key="k1")
    assert isinstance(keyed, m.SubmitWorkflow) and keyed.name == "etl"
    assert [j["idempotencyKey"] for j in keyed.jobs] == ["k1:A.0", "own"]
    assert resends_workflow(keyed)
    assert not resends_workflow(workflow_request(node))  # one job has no key: a resend could make a second
    listed = workflow_request([{"ref": "x", "taskType": "A", "payload": {}}], idempotency_key="k2")
    assert listed.jobs == [{"ref": "x", "taskType": "A", "payload": {}, "idempotencyKey": "k2:x"}]


def test_a_list_of_job_objects_goes_as_it_is_and_anything_else_is_a_type_error():
    jobs = [{"ref": "a", "taskType": "A", "payload": {}}, {"ref": "b", "taskType": "B", "payload": {},
                                                           "dependsOn": ["a"]}]
    assert workflow_request(jobs).jobs == jobs
    with pytest.raises(TypeError):
        workflow_request(["a"])
    with pytest.raises(TypeError):
        workflow_request("a workflow")


def test_a_job_object_with_a_field_no_job_has_is_refused_before_sending():
    jobs = [{"ref": "a", "taskType": "A", "payload": {}}, {"ref": "b", "taskType": "A", "payload": {}, "after": ["a"]}]
    with pytest.raises(CanvasError, match="job 'b': unknown field 'after'; a job has ref, dependsOn and"):
        workflow_request(jobs)
    jobs[1] = {"ref": "b", "taskType": "A", "payload": {}, "dependsOn": ["a"], "priority": "HIGH", "delayMillis": 5}
    assert workflow_request(jobs).jobs == jobs


def test_a_task_function_s_s_is_a_step_of_its_type():
    name = "RESIZE-%s" % uuid.uuid4().hex[:8]
    album_name = name + "-album"
    try:
        @task(name)
        def resize(payload):
            return {}

        @task(album_name)
        def album(payload, ctx):
            return {}

        images = ["a.png", "b.png"]
        got = compile_jobs(chord(group(resize.s(image=i) for i in images), album.s({"title": "t"})))
        assert [(j.step.task_type, j.step.payload) for j in got] == [
            (name, {"image": "a.png"}), (name, {"image": "b.png"}), (album_name, {"title": "t"})]
        assert resize({}) == {}  # still the function
        assert isinstance(resize.s().set(priority="LOW", ref="r"), Step)
    finally:
        unregister([name, album_name])
