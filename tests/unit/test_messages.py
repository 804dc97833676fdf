"""Message codec: every type round-trips; bad messages raise ProtocolError (PROTOCOL.md, "Messages")."""

from __future__ import annotations

import dataclasses

import pytest

from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import decode_payload, encode_frame

SNAPSHOT = {
    "jobId": "j-1", "taskType": "SLEEP", "state": "RUNNING", "attempts": 1, "maxAttempts": 3,
    "workerId": "w-1", "result": None, "error": None, "createdAtMillis": 1_700_000_000_000,
    "updatedAtMillis": 1_700_000_000_001, "priority": "NORMAL",
}

# One fully populated sample of every message type, keyed by its wire type.
SAMPLES: dict[str, m.Message] = {
    "WORKER_REGISTER": m.WorkerRegister(worker_id="w-1", capacity=4, task_types=["SLEEP", "GREET"],
                                        running=[{"jobId": "j-1", "attemptId": "j-1.1"}], result_acks=True),
    "WORKER_REGISTERED": m.WorkerRegistered(worker_id="w-1", result_acks=True),
    "HEARTBEAT": m.Heartbeat(worker_id="w-1"),
    "HEARTBEAT_ACK": m.HeartbeatAck(worker_id="w-1"),
    "RESULT_ACK": m.ResultAck(attempt_ids=["j-1.1", "j-2.3"]),
    "TASK_ASSIGN": m.TaskAssign(job_id="j-1", attempt_id="a-1", attempt_number=2, task_type="SLEEP",
                                payload={"durationMillis": 5}),
    "TASK_CANCEL": m.TaskCancel(job_id="j-1", attempt_id="a-1"),
    "TASK_RESULT": m.TaskResult(worker_id="w-1", job_id="j-1", attempt_id="a-1", success=True,
                                result={"sleptMillis": 5}, error=None),
    "TASK_PROGRESS": m.TaskProgress(worker_id="w-1", job_id="j-1", attempt_id="j-1.1", fraction=0.25,
                                    message="chunk 7 ✓"),
    "ERROR": m.Error(message="nope ✓"),
    "SUBMIT_JOB": m.SubmitJob(task_type="SHA256", payload={"text": "héllo"}, max_attempts=2,
                              idempotency_key="k-1", priority="HIGH", run_at_millis=1_800_000_000_000),
    "JOB_SUBMITTED": m.JobSubmitted(job_id="j-1"),
    "SUBMIT_REJECTED": m.SubmitRejected(reason="at limit", active_count=3, limit=3, retryable=True),
    "GET_JOB_STATUS": m.GetJobStatus(job_id="j-1"),
    "JOB_STATUS": m.JobStatus(job=SNAPSHOT),
    "LIST_JOBS": m.ListJobs(limit=10, state="QUEUED", cursor="c-1", task_type="GREET"),
    "JOB_LIST": m.JobList(jobs=[SNAPSHOT], next_cursor="c-2"),
    "LIST_WORKERS": m.ListWorkers(),
    "WORKER_LIST": m.WorkerList(workers=[{"workerId": "w-1", "capacity": 4, "activeJobs": 0,
                                          "lastHeartbeatMillis": 1_700_000_000_000}]),
    "CANCEL_JOB": m.CancelJob(job_id="j-1"),
    "JOB_CANCEL": m.JobCancel(cancelled=True, job=SNAPSHOT),
    "GET_JOB_EVENTS": m.GetJobEvents(job_id="j-1"),
    "JOB_EVENTS": m.JobEvents(job_id="j-1", events=[{"atMillis": 1, "event": "SUBMITTED"},
                                                  {"atMillis": 2, "event": "ASSIGNED", "attempt": 1,
                                                   "attemptId": "j-1.1", "workerId": "w-1"}]),
    "RETRY_JOB": m.RetryJob(job_id="j-1"),
    "PURGE_JOBS": m.PurgeJobs(older_than_millis=86_400_000, limit=500),
    "JOBS_PURGED": m.JobsPurged(purged=500, more=True),
    "WAIT_JOB": m.WaitJob(job_id="j-1", timeout_millis=60_000),
    "GET_STATS": m.GetStats(),
    "STATS": m.Stats(at_millis=1_700_000_000_000, jobs={"QUEUED": 3, "SCHEDULED": 0, "RUNNING": 2, "RETRY_WAIT": 1},
                     submitted=10, finished={"COMPLETED": 3, "FAILED": 1, "CANCELLED": 0}, rejected=0, retries=2,
                     workers=1, periodic_workers=0, capacity=4, busy_slots=2, waits=0),
    "SCHEDULE_PUT": m.SchedulePut(schedule={"name": "nightly", "cron": "0 3 * * *", "timezone": "Europe/Paris",
                                            "taskType": "SLEEP", "payload": {"durationMillis": 5}}),
    "SCHEDULE": m.Schedule(schedule={"name": "nightly", "cron": "0 3 * * *", "nextFireMillis": 1_800_000_000_000}),
    "SCHEDULE_GET": m.ScheduleGet(name="nightly"),
    "SCHEDULE_LIST": m.ScheduleList(limit=10, after="a", schedules=[{"name": "nightly"}], next_after="nightly"),
    "SCHEDULE_PAUSE": m.SchedulePause(name="nightly"),
    "SCHEDULE_RESUME": m.ScheduleResume(name="nightly"),
    "SCHEDULE_DELETE": m.ScheduleDelete(name="nightly"),
    "SCHEDULE_TRIGGER": m.ScheduleTrigger(name="nightly"),
    "SCHEDULE_PREVIEW": m.SchedulePreview(cron="30 2 * * *", every_millis=None, timezone="Europe/Paris",
                                          from_millis=1_800_000_000_000, count=2,
                                          fire_times=[1_800_001_800_000, 1_800_088_200_000]),
    "AUTH": m.Auth(token="s3cret-token"),
    "AUTH_OK": m.AuthOk(name="ci", role="client"),
    "GET_JOB_PAYLOAD": m.GetJobPayload(job_id="j-1"),
    "JOB_PAYLOAD": m.JobPayload(job_id="j-1", payload={"text": "héllo ✓", "n": [1, 2.5, None]}),
    "LIMIT_PUT": m.LimitPut(limit={"taskType": "EXPORT", "maxRunning": 5, "maxRunningPerKey": 2}),
    "LIMIT": m.Limit(limit={"taskType": "EXPORT", "maxRunning": 5, "maxRunningPerKey": 2, "ratePerSecond": None,
                            "burst": None, "ratePerKeyPerSecond": None, "paused": False, "running": 1,
                            "queued": 3}),
    "LIMIT_GET": m.LimitGet(task_type="EXPORT"),
    "LIMIT_LIST": m.LimitList(limits=[{"taskType": "EXPORT"}]),
    "LIMIT_DELETE": m.LimitDelete(task_type="EXPORT"),
    "TYPE_PAUSE": m.TypePause(task_type="EXPORT"),
    "TYPE_RESUME": m.TypeResume(task_type="EXPORT"),
    "SUBMIT_WORKFLOW": m.SubmitWorkflow(jobs=[{"ref": "a", "taskType": "ECHO", "payload": {}},
                                              {"ref": "b", "taskType": "ECHO", "payload": {}, "dependsOn": ["a"]}],
                                        name="etl"),
    "WORKFLOW_SUBMITTED": m.WorkflowSubmitted(workflow_id="w-1", job_ids={"a": "j-1", "b": "j-2"}),
    "WORKFLOW_STATUS": m.WorkflowStatus(workflow_id="w-1"),
    "WORKFLOW": m.Workflow(workflow_id="w-1", name="etl", state="RUNNING",
                           jobs=[{"ref": "a", "jobId": "j-1", "state": "COMPLETED", "dependsOn": []}]),
    "WORKFLOW_CANCEL": m.WorkflowCancel(workflow_id="w-1"),
    "WAIT_WORKFLOW": m.WaitWorkflow(workflow_id="w-1", timeout_millis=1000),
}


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == {cls.TYPE for cls in m.ALL_MESSAGES}
    assert set(m.BY_TYPE) == set(SAMPLES)
    for type_name, msg in SAMPLES.items():
        assert type(msg) is m.BY_TYPE[type_name]


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_round_trip_through_wire_dict(type_name):
    msg = SAMPLES[type_name]
    wire = msg.to_wire()
    assert wire["type"] == type_name
    assert m.decode(wire) == msg


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_round_trip_through_frame_bytes(type_name):
    msg = SAMPLES[type_name]
    frame = encode_frame(msg.to_wire())
    assert m.decode(decode_payload(frame[4:])) == msg


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_wire_uses_camel_case_names_from_the_protocol(type_name):
    expected = {
        "WORKER_REGISTER": {"workerId", "capacity", "taskTypes", "running", "resultAcks"},
        "WORKER_REGISTERED": {"workerId", "resultAcks"},
        "HEARTBEAT": {"workerId", "ack"},
        "HEARTBEAT_ACK": {"workerId"},
        "RESULT_ACK": {"attemptIds"},
        "TASK_ASSIGN": {"jobId", "attemptId", "attemptNumber", "taskType", "payload"},
        "TASK_CANCEL": {"jobId", "attemptId"},
        "TASK_RESULT": {"workerId", "jobId", "attemptId", "success", "result", "error"},
        "TASK_PROGRESS": {"workerId", "jobId", "attemptId", "fraction", "message"},
        "ERROR": {"message"},
        "SUBMIT_JOB": {"taskType", "payload", "maxAttempts", "idempotencyKey", "priority", "runAtMillis",
                       "delayMillis"},
        "JOB_SUBMITTED": {"jobId"},
        "SUBMIT_REJECTED": {"reason", "activeCount", "limit", "retryable"},
        "GET_JOB_STATUS": {"jobId"},
        "JOB_STATUS": {"job"},
        "GET_JOB_PAYLOAD": {"jobId"},
        "JOB_PAYLOAD": {"jobId", "payload"},
        "LIST_JOBS": {"limit", "state", "cursor", "taskType"},
        "JOB_LIST": {"jobs", "nextCursor"},
        "LIST_WORKERS": set(),
        "WORKER_LIST": {"workers"},
        "CANCEL_JOB": {"jobId"},
        "JOB_CANCEL": {"cancelled", "job"},
        "GET_JOB_EVENTS": {"jobId"},
        "JOB_EVENTS": {"jobId", "events"},
        "RETRY_JOB": {"jobId"},
        "PURGE_JOBS": {"olderThanMillis", "limit", "dryRun"},
        "JOBS_PURGED": {"purged", "more"},
        "WAIT_JOB": {"jobId", "timeoutMillis"},
        "GET_STATS": set(),
        "STATS": {"atMillis", "jobs", "submitted", "finished", "rejected", "retries", "workers", "periodicWorkers",
                  "capacity", "busySlots", "waits"},
        "SCHEDULE_PUT": {"schedule"},
        "SCHEDULE": {"schedule"},
        "SCHEDULE_GET": {"name"},
        "SCHEDULE_LIST": {"limit", "after", "schedules", "nextAfter"},
        "SCHEDULE_PAUSE": {"name"},
        "SCHEDULE_RESUME": {"name"},
        "SCHEDULE_DELETE": {"name"},
        "SCHEDULE_TRIGGER": {"name"},
        "SCHEDULE_PREVIEW": {"cron", "everyMillis", "timezone", "fromMillis", "count", "fireTimes"},
        "AUTH": {"token"},
        "AUTH_OK": {"name", "role"},
        "LIMIT_PUT": {"limit"},
        "LIMIT": {"limit"},
        "LIMIT_GET": {"taskType"},
        "LIMIT_LIST": {"limits"},
        "LIMIT_DELETE": {"taskType"},
        "SUBMIT_WORKFLOW": {"jobs", "name"},
        "WORKFLOW_SUBMITTED": {"workflowId", "jobIds"},
        "WORKFLOW_STATUS": {"workflowId"},
        "WORKFLOW": {"workflowId", "name", "state", "jobs"},
        "WORKFLOW_CANCEL": {"workflowId"},
        "WAIT_WORKFLOW": {"workflowId", "timeoutMillis"},
        "TYPE_PAUSE": {"taskType"},
        "TYPE_RESUME": {"taskType"},
    }[type_name]
    assert set(SAMPLES[type_name].to_wire()) == expected | {"type"}


def test_optional_fields_default_when_absent():
    # SUBMIT_JOB from an older client: no maxAttempts, idempotencyKey or priority.
    msg = m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1}})
    assert msg == m.SubmitJob(task_type="SLEEP", payload={"durationMillis": 1}, max_attempts=0,
                              idempotency_key=None, priority=None)
    assert m.decode({"type": "LIST_JOBS"}) == m.ListJobs(limit=None, state=None, cursor=None)
    res = m.decode({"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a", "success": False})
    assert res.result is None and res.error is None


def test_nullable_fields_accept_null():
    msg = m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "maxAttempts": 0,
                    "idempotencyKey": None, "priority": None})
    assert msg.idempotency_key is None and msg.priority is None
    assert m.decode({"type": "JOB_LIST", "jobs": [], "nextCursor": None}).next_cursor is None


def test_unknown_fields_are_ignored():
    wire = dict(SAMPLES["HEARTBEAT"].to_wire(), v=1, extra={"nested": [1, 2]})
    assert m.decode(wire) == SAMPLES["HEARTBEAT"]
    wire = dict(SAMPLES["SUBMIT_JOB"].to_wire(), futureField="x")
    assert m.decode(wire) == SAMPLES["SUBMIT_JOB"]


@pytest.mark.parametrize("obj", [
    {"type": "NOPE"},
    {"type": "heartbeat", "workerId": "w"},     # type names are case-sensitive
    {"type": "", "workerId": "w"},
])
def test_unknown_type_is_rejected(obj):
    with pytest.raises(ProtocolError):
        m.decode(obj)


@pytest.mark.parametrize("obj", [{}, {"workerId": "w-1"}])
def test_missing_type_is_rejected(obj):
    with pytest.raises(ProtocolError):
        m.decode(obj)


@pytest.mark.parametrize("bad_type", [None, 1, ["HEARTBEAT"], {"t": 1}, True])
def test_non_string_type_is_rejected(bad_type):
    with pytest.raises(ProtocolError):
        m.decode({"type": bad_type, "workerId": "w"})


@pytest.mark.parametrize("obj", [
    {"type": "WORKER_REGISTER", "workerId": "w", "capacity": "4"},
    {"type": "WORKER_REGISTER", "workerId": "w", "capacity": 4.0},
    {"type": "WORKER_REGISTER", "workerId": "w", "capacity": True},
    {"type": "WORKER_REGISTER", "workerId": 7, "capacity": 4},
    {"type": "WORKER_REGISTER", "workerId": None, "capacity": 4},
    {"type": "WORKER_REGISTER", "workerId": "w", "capacity": 4, "running": {"jobId": "j", "attemptId": "j.1"}},
    {"type": "HEARTBEAT", "workerId": ["w"]},
    {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a", "success": "yes"},
    {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a", "success": 1},
    {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a", "success": True, "result": []},
    {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a", "success": False, "error": 5},
    {"type": "TASK_PROGRESS", "workerId": "w", "jobId": "j", "attemptId": "a", "fraction": "0.5"},
    {"type": "TASK_PROGRESS", "workerId": "w", "jobId": "j", "attemptId": "a", "fraction": True},
    {"type": "TASK_PROGRESS", "workerId": "w", "jobId": "j", "attemptId": "a", "fraction": 0.5, "message": 7},
    {"type": "TASK_ASSIGN", "jobId": "j", "attemptId": "a", "attemptNumber": "1", "taskType": "SLEEP",
     "payload": {}},
    {"type": "TASK_ASSIGN", "jobId": "j", "attemptId": "a", "attemptNumber": 1, "taskType": "SLEEP",
     "payload": []},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": []},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": "{}"},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": None},
    {"type": "SUBMIT_JOB", "taskType": 1, "payload": {}},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "maxAttempts": "3"},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "maxAttempts": 1.5},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "idempotencyKey": 5},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "priority": 2},
    {"type": "GET_JOB_STATUS", "jobId": 1},
    {"type": "CANCEL_JOB", "jobId": None},
    {"type": "LIST_JOBS", "limit": "10"},
    {"type": "LIST_JOBS", "state": 3},
    {"type": "LIST_JOBS", "cursor": {}},
    {"type": "JOB_CANCEL", "cancelled": "true", "job": {}},
    {"type": "SUBMIT_REJECTED", "reason": "r", "activeCount": 3, "limit": 3, "retryable": "true"},
])
def test_wrong_field_types_are_rejected(obj):
    with pytest.raises(ProtocolError):
        m.decode(obj)


@pytest.mark.parametrize("obj", [
    {"type": "WORKER_REGISTER", "workerId": "w"},
    {"type": "WORKER_REGISTER", "capacity": 4},
    {"type": "HEARTBEAT"},
    {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "a"},
    {"type": "TASK_PROGRESS", "workerId": "w", "jobId": "j", "attemptId": "a"},
    {"type": "TASK_ASSIGN", "jobId": "j", "attemptId": "a", "attemptNumber": 1, "taskType": "SLEEP"},
    {"type": "SUBMIT_JOB", "taskType": "SLEEP"},
    {"type": "SUBMIT_JOB", "payload": {}},
    {"type": "GET_JOB_STATUS"},
    {"type": "CANCEL_JOB"},
    {"type": "WAIT_JOB", "jobId": "j-1"},
    {"type": "ERROR"},
])
def test_missing_required_fields_are_rejected(obj):
    with pytest.raises(ProtocolError):
        m.decode(obj)


def test_port_tables_match_the_protocol():
    assert m.WORKER_PORT_REQUESTS == {"WORKER_REGISTER", "HEARTBEAT", "TASK_RESULT", "TASK_PROGRESS"}
    assert m.CLIENT_PORT_REQUESTS == {"SUBMIT_JOB", "GET_JOB_STATUS", "LIST_JOBS", "LIST_WORKERS", "CANCEL_JOB",
                                      "GET_JOB_EVENTS", "RETRY_JOB", "PURGE_JOBS", "WAIT_JOB", "GET_STATS",
                                      "SCHEDULE_PUT", "SCHEDULE_GET", "SCHEDULE_LIST", "SCHEDULE_PAUSE",
                                      "SCHEDULE_RESUME", "SCHEDULE_DELETE", "SCHEDULE_TRIGGER", "SCHEDULE_PREVIEW",
                                      "LIMIT_PUT", "LIMIT_GET", "LIMIT_LIST", "LIMIT_DELETE", "TYPE_PAUSE",
                                      "TYPE_RESUME", "GET_JOB_PAYLOAD", "SUBMIT_WORKFLOW", "WORKFLOW_STATUS",
                                      "WORKFLOW_CANCEL", "WAIT_WORKFLOW"}
    assert m.TO_WORKER == {"WORKER_REGISTERED", "TASK_ASSIGN", "TASK_CANCEL", "HEARTBEAT_ACK", "RESULT_ACK", "ERROR",
                           "AUTH_OK"}
    assert m.TO_CLIENT == {"JOB_SUBMITTED", "SUBMIT_REJECTED", "JOB_STATUS", "JOB_LIST", "WORKER_LIST",
                           "JOB_CANCEL", "JOB_EVENTS", "JOBS_PURGED", "STATS", "SCHEDULE", "SCHEDULE_LIST",
                           "SCHEDULE_PREVIEW", "ERROR", "AUTH_OK", "LIMIT", "LIMIT_LIST", "JOB_PAYLOAD",
                           "WORKFLOW_SUBMITTED", "WORKFLOW"}


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_port_legality(type_name):
    wire = SAMPLES[type_name].to_wire()
    for allowed in (m.WORKER_PORT_REQUESTS, m.CLIENT_PORT_REQUESTS, m.TO_WORKER, m.TO_CLIENT):
        if type_name in allowed:
            assert m.decode(wire, allowed) == SAMPLES[type_name]
        else:
            with pytest.raises(ProtocolError):
                m.decode(wire, allowed)


def test_client_port_refuses_worker_messages():
    with pytest.raises(ProtocolError):
        m.decode({"type": "HEARTBEAT", "workerId": "w-1"}, m.CLIENT_PORT_REQUESTS)
    with pytest.raises(ProtocolError):
        m.decode({"type": "WORKER_REGISTER", "workerId": "w-1", "capacity": 1}, m.CLIENT_PORT_REQUESTS)


def test_worker_port_refuses_client_messages():
    with pytest.raises(ProtocolError):
        m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}}, m.WORKER_PORT_REQUESTS)
    with pytest.raises(ProtocolError):
        m.decode({"type": "LIST_WORKERS"}, m.WORKER_PORT_REQUESTS)


def test_messages_are_frozen():
    msg = SAMPLES["HEARTBEAT"]
    with pytest.raises(Exception):
        msg.worker_id = "other"  # type: ignore[misc]


def test_local_fields_are_never_on_the_wire():
    # submittedBy is set by the coordinator from the connection's token, never by the peer.
    msg = m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}, "submittedBy": "forged",
                    "submitted_by": "forged"})
    assert msg.submitted_by is None
    assert "submittedBy" not in dataclasses.replace(msg, submitted_by="ci").to_wire()
    retry = m.decode({"type": "RETRY_JOB", "jobId": "j-1", "submittedBy": "forged"})
    assert retry.submitted_by is None


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_a_decoded_message_is_the_one_its_constructor_makes(type_name):
    # The decoder builds instances without calling the dataclass constructor: equal,
    # every field set (local ones to None), still frozen.
    msg = SAMPLES[type_name]
    decoded = m.decode(msg.to_wire())
    assert decoded == msg
    assert {f.name: getattr(decoded, f.name) for f in dataclasses.fields(decoded)} == \
        {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.TYPE_CHECK = 1  # type: ignore[attr-defined]


def test_a_decoded_error_is_bounded_as_a_constructed_one():
    decoded = m.decode({"type": "ERROR", "message": "x" * (m.MAX_ERROR_CHARS + 50)})
    assert decoded == m.Error("x" * (m.MAX_ERROR_CHARS + 50))
    assert len(decoded.message) < m.MAX_ERROR_CHARS + 50


def test_auth_on_a_coordinator_without_tokens_says_so():
    for port in (m.CLIENT_PORT_REQUESTS, m.WORKER_PORT_REQUESTS):
        with pytest.raises(ProtocolError, match="takes no tokens"):
            m.decode({"type": "AUTH", "token": "x"}, port)


def test_a_field_declared_omit_leaves_the_frames_that_carry_its_default_unchanged():
    # WORKER_REGISTERED without resultAcks is the frame it always was; with it, it says so
    assert m.WorkerRegistered(worker_id="w").to_wire() == {"type": "WORKER_REGISTERED", "workerId": "w"}
    assert m.WorkerRegistered(worker_id="w", result_acks=True).to_wire()["resultAcks"] is True
    assert "resultAcks" not in m.WorkerRegister(worker_id="w", capacity=1).to_wire()
    assert m.decode({"type": "WORKER_REGISTERED", "workerId": "w"}) == m.WorkerRegistered(worker_id="w")
    with pytest.raises(ProtocolError):
        m.decode({"type": "RESULT_ACK", "attemptIds": "j.1"})
