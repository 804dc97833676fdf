"""Job state machine, priorities and snapshots (PROTOCOL.md snapshot; the lease/deadline PR's CANCELLED)."""

from __future__ import annotations

import itertools

import pytest

from jobmesh.errors import IllegalTransition, JobmeshError
from jobmesh.store.job import Job
from jobmesh.protocol.jobs import (
    MAX_LEVEL, TERMINAL, TRANSITIONS, JobState, Priority, check_transition,
)

S = JobState

# The moves the seeds allow, written out independently of the table under test:
# assign, success, failure with/without budget, restart requeue, due retry, cancel.
EXPECTED_MOVES = {
    (S.QUEUED, S.RUNNING),
    (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.COMPLETED),
    (S.RUNNING, S.RETRY_WAIT),
    (S.RUNNING, S.FAILED),
    (S.RUNNING, S.QUEUED),        # restart during a non-final attempt requeues
    (S.RUNNING, S.CANCELLED),
    (S.RETRY_WAIT, S.QUEUED),
    (S.RETRY_WAIT, S.CANCELLED),
    (S.SCHEDULED, S.QUEUED),      # a scheduled job fell due
    (S.SCHEDULED, S.CANCELLED),
    (S.QUEUED, S.SCHEDULED),      # a pending Periodic job replaced with a later sched_at
    (S.RETRY_WAIT, S.SCHEDULED),  # the same while it waits for its retry
    (S.RUNNING, S.SCHEDULED),     # put back for later without an attempt counted (Periodic SCHED_LATER)
    (S.WAITING, S.QUEUED),        # a workflow's job whose last dependency completed
    (S.WAITING, S.SCHEDULED),     # the same, before its run-at time
    (S.WAITING, S.CANCELLED),     # cancelled, or a dependency failed or was cancelled
    (S.WAITING, S.FAILED),        # its dependencies' results do not fit a task assignment
}


def test_state_names_are_the_wire_spellings():
    assert [s.value for s in JobState] == ["QUEUED", "SCHEDULED", "RUNNING", "RETRY_WAIT", "WAITING",
                                       "COMPLETED", "FAILED", "CANCELLED"]
    for s in JobState:
        assert s == s.value and JobState(s.value) is s


def test_terminal_states():
    assert TERMINAL == {S.COMPLETED, S.FAILED, S.CANCELLED}


def test_table_covers_every_state():
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize("current,target", list(itertools.product(JobState, JobState)))
def test_every_pair(current, target):
    if (current, target) in EXPECTED_MOVES:
        assert target in TRANSITIONS[current]
        check_transition(current, target)  # does not raise
    else:
        assert target not in TRANSITIONS[current]
        with pytest.raises(IllegalTransition):
            check_transition(current, target)


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_exits(state):
    assert TRANSITIONS[state] == frozenset()
    for target in JobState:
        with pytest.raises(IllegalTransition):
            check_transition(state, target)


def test_no_self_loops():
    for s in JobState:
        assert s not in TRANSITIONS[s]


def test_every_non_terminal_state_can_be_cancelled():
    for s in set(JobState) - TERMINAL:
        check_transition(s, S.CANCELLED)


def test_illegal_transition_is_a_jobmesh_error():
    assert issubclass(IllegalTransition, JobmeshError)


def test_priority_parse():
    assert Priority.parse(None) is Priority.NORMAL
    assert Priority.parse("HIGH") is Priority.HIGH
    assert Priority.parse("NORMAL") is Priority.NORMAL
    assert Priority.parse("LOW") is Priority.LOW


@pytest.mark.parametrize("bad", ["high", "URGENT", "", "2", " HIGH", "MEDIUM"])
def test_priority_parse_rejects_other_names(bad):
    with pytest.raises(ValueError):
        Priority.parse(bad)


def test_priority_levels():
    assert (Priority.LOW.level, Priority.NORMAL.level, Priority.HIGH.level) == (0, 1, 2)
    assert MAX_LEVEL == Priority.HIGH.level


def test_snapshot_wire_fields_are_the_protocols():
    job = Job(job_id="j-1", seq=1, task_type="SLEEP", payload={"durationMillis": 5}, max_attempts=3,
              priority=Priority.LOW, created_at=1_700_000_000_000, state=S.RUNNING, attempts=1,
              worker_id="w-1", error="boom", updated_at=1_700_000_000_500)
    wire = job.snapshot()
    assert wire == {
        "jobId": "j-1", "taskType": "SLEEP", "state": "RUNNING", "attempts": 1, "maxAttempts": 3,
        "workerId": "w-1", "result": None, "error": "boom", "createdAtMillis": 1_700_000_000_000,
        "updatedAtMillis": 1_700_000_000_500, "priority": "LOW", "runAtMillis": None,
        "retryAtMillis": None, "retryOf": None, "waitingReason": None, "protocol": "json", "name": None,
        "submittedBy": None, "concurrencyKey": None, "uniqueKey": None, "progress": None,
        "workflowId": None, "ref": None,
    }
