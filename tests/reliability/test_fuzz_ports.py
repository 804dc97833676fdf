"""Fuzz both ports of one real coordinator (FAILURE_MODEL.md, "Hostile and broken peers").

Each example opens a fresh connection, sends something (random bytes; well-framed random
JSON; or a valid request with one field mutated: wrong type, huge or odd string, deep
nesting, negative or huge number, null, missing), closes its sending side and reads
everything until the coordinator closes. Every example must end with the connection
closed, having received only well-formed frames legal on that port, an ERROR (with a
message) only last; and a well-behaved client on its own connection must still be served
(the status of a known job). The coordinator is one subprocess for the module (port 0,
temp database), started with the monitor thread like every coordinator under test.

Profiles: ``ci`` (the default) is derandomized, so every run tries the same examples;
``JOBMESH_FUZZ_PROFILE=explore`` draws new ones, ten times as many.
"""

from __future__ import annotations

import os
import socket

import pytest
import ujson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import HEADER, MAX_FRAME, FrameReader
from tests.support.peers import Client

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", max_examples=600, deadline=None, derandomize=False, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile(os.environ.get("JOBMESH_FUZZ_PROFILE", "ci"))

CLOSE_SECONDS = 10.0  # an example's connection must be closed by then

# ---- the coordinator and the bystander -------------------------------------------------------


@pytest.fixture(scope="module")
def coord(module_coordinator):
    return module_coordinator


@pytest.fixture(scope="module")
def bystander(coord):
    """A well-behaved client, connected before any fuzzing, and a job it knows (QUEUED for
    good: no worker runs FAIL... a fuzz worker might, so the check is only that it is served)."""
    client = Client(coord.client_addr)
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 10)  # SCHEDULED for months
    yield client, job_id
    client.close()


def still_served(coord, bystander) -> None:
    client, job_id = bystander
    assert coord.proc.poll() is None, "the coordinator exited:\n%s" % coord.stderr()[-3000:]
    assert client.status(job_id)["jobId"] == job_id


# ---- one exchange -------------------------------------------------------------------------------

_worker_ids = iter(range(10 ** 9))


def exchange(addr, data: bytes, prelude: list[dict] = ()) -> list[dict]:
    """Send ``prelude`` frames and ``data``, close the sending side, read until the coordinator
    closes. Returns the frames (the prelude's replies included); fails on a malformed one."""
    sock = socket.create_connection(addr, timeout=CLOSE_SECONDS)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for obj in prelude:
            sock.sendall(encode(obj))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # it may already have closed on us (a violation early in the data)
        reader = FrameReader(sock.recv)
        frames = []
        while True:
            try:
                frame = reader.read_frame()
            except ProtocolError as exc:
                raise AssertionError("the coordinator sent a malformed frame: %s" % exc) from exc
            except ConnectionResetError:
                return frames  # it closed with our bytes unread: a violation, also a close
            except (socket.timeout, TimeoutError):
                raise AssertionError("connection still open %.0f s after our EOF; frames %r"
                                     % (CLOSE_SECONDS, frames)) from None
            if frame is None:
                return frames
            frames.append(frame)
    finally:
        sock.close()


def check_frames(frames: list[dict], legal: frozenset[str]) -> None:
    for i, frame in enumerate(frames):
        msg = m.decode(frame, legal)  # well formed and legal in this direction
        if isinstance(msg, m.Error):
            assert msg.message, frame
            assert len(msg.message) <= m.MAX_ERROR_CHARS + 40, len(msg.message)
            assert i == len(frames) - 1, "frames after an ERROR: %r" % frames[i:]


# ---- encoding what the strategies draw -----------------------------------------------------------


class Raw:
    """JSON text to splice in as it is (deeper than any encoder goes, or huge integers)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return "Raw(%d chars: %s...)" % (len(self.text), self.text[:40])


def encode(obj) -> bytes:
    """A frame for ``obj``; ``Raw`` values are spliced in verbatim. The length is always
    right; the body may exceed MAX_FRAME on purpose (the coordinator must refuse it)."""
    raws: list[str] = []

    def walk(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return "\x00raw%d\x00" % (len(raws) - 1)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = ujson.dumps(walk(obj), ensure_ascii=False, escape_forward_slashes=False)
    for i, raw in enumerate(raws):
        text = text.replace('"\\u0000raw%d\\u0000"' % i, raw)
    body = text.encode("utf-8", "surrogatepass")
    return HEADER.pack(len(body) & 0xFFFFFFFF) + body


def deep(depth: int, array: bool) -> Raw:
    return Raw(("[" * depth + "1" + "]" * depth) if array else ('{"a":' * depth + "1" + "}" * depth))


class Big(str):
    """A huge string that a failing example prints briefly."""

    def __repr__(self) -> str:
        return "Big(%r…, %d characters)" % (self[:4], len(self))


HUGE_STRINGS = [Big(s) for s in ("\x7f" * 300_000, "\x01\x1b" * 75_000, "\U0001f600" * 200_000,
                                 "x" * (MAX_FRAME - 200), "\u202e\u0000\ufeff" * 1000)]
MISSING = object()  # the field is left out

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1),
    st.sampled_from([-1, 0, 1, 2 ** 31, 2 ** 53 + 1, -2 ** 63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
mutants = st.one_of(
    json_values,
    st.just(MISSING),
    st.sampled_from(HUGE_STRINGS),
    st.builds(deep, st.integers(min_value=1, max_value=1100), st.booleans()),
    st.sampled_from([Raw("9" * 5000), Raw("-" + "9" * 400), Raw("1e400"), Raw("NaN"), Raw("-Infinity"),
                     Raw('"\\ud800"'), Raw('"\\udfff\\ud800x"'), Raw("1.5e-400")]),
)

# A valid example of every request, per port; each field of each gets mutated.
CLIENT_REQUESTS = {
    "SUBMIT_JOB": {"type": "SUBMIT_JOB", "taskType": "WORD_COUNT", "payload": {"text": "a b"}, "maxAttempts": 2,
                   "idempotencyKey": None, "priority": "HIGH", "runAtMillis": None, "delayMillis": 1000},
    "GET_JOB_STATUS": {"type": "GET_JOB_STATUS", "jobId": "j"},
    "LIST_JOBS": {"type": "LIST_JOBS", "limit": 5, "state": "QUEUED", "cursor": None, "taskType": "SLEEP"},
    "LIST_WORKERS": {"type": "LIST_WORKERS"},
    "CANCEL_JOB": {"type": "CANCEL_JOB", "jobId": "j"},
    "GET_JOB_EVENTS": {"type": "GET_JOB_EVENTS", "jobId": "j"},
    "RETRY_JOB": {"type": "RETRY_JOB", "jobId": "j"},
    "PURGE_JOBS": {"type": "PURGE_JOBS", "olderThanMillis": 10 ** 12, "limit": 1},
    "WAIT_JOB": {"type": "WAIT_JOB", "jobId": "j", "timeoutMillis": 0},
    "GET_STATS": {"type": "GET_STATS"},
    "SUBMIT_WORKFLOW": {"type": "SUBMIT_WORKFLOW", "name": "fuzzed", "jobs": [
        {"ref": "a", "taskType": "SLEEP", "payload": {"durationMillis": 1}, "delayMillis": 10 ** 10},
        {"ref": "b", "taskType": "SLEEP", "payload": {"durationMillis": 1}, "dependsOn": ["a"]}]},
    "WORKFLOW_STATUS": {"type": "WORKFLOW_STATUS", "workflowId": "w", "cursor": "0"},
    "WORKFLOW_CANCEL": {"type": "WORKFLOW_CANCEL", "workflowId": "w"},
    "WAIT_WORKFLOW": {"type": "WAIT_WORKFLOW", "workflowId": "w", "timeoutMillis": 0},
}
# A workflow's job, each of whose fields gets mutated (and one it should not have, added).
WORKFLOW_JOB = {"ref": "b", "taskType": "SLEEP", "payload": {"durationMillis": 1}, "dependsOn": ["a"],
                "maxAttempts": 2, "priority": "LOW", "delayMillis": 1000, "timeoutMillis": 5000,
                "idempotencyKey": None, "concurrencyKey": None, "uniqueKey": None, "resultTtlMillis": None}
WORKER_REQUESTS = {
    "WORKER_REGISTER": {"type": "WORKER_REGISTER", "workerId": "w", "capacity": 1, "taskTypes": ["SLEEP"]},
    "HEARTBEAT": {"type": "HEARTBEAT", "workerId": "w"},
    "TASK_RESULT": {"type": "TASK_RESULT", "workerId": "w", "jobId": "j", "attemptId": "j.1", "success": True,
                    "result": {"words": 1}, "error": None},
    "TASK_PROGRESS": {"type": "TASK_PROGRESS", "workerId": "w", "jobId": "j", "attemptId": "j.1", "fraction": 0.5,
                      "message": "half"},
}


def mutated(base: dict, field: str, value) -> dict:
    out = dict(base)
    if value is MISSING:
        out.pop(field, None)
    else:
        out[field] = value
    return out


def field_mutations(requests: dict[str, dict]):
    return st.sampled_from(sorted(requests)).flatmap(
        lambda kind: st.tuples(st.just(kind), st.sampled_from(sorted(requests[kind])), mutants))


random_frames = st.one_of(
    json_values.map(lambda v: encode(v)),  # any JSON, mostly not an object
    st.dictionaries(st.text(max_size=10), json_values, max_size=5).flatmap(
        lambda d: st.sampled_from(sorted(m.BY_TYPE) + ["", "nope", 7, None]).map(
            lambda t: encode(dict(d, type=t)))),
)
random_bytes = st.one_of(
    st.binary(max_size=600),
    st.binary(min_size=1, max_size=600).map(lambda b: HEADER.pack(len(b)) + b),  # a right length, junk inside
)

PORTS = {"client": ("client_addr", m.TO_CLIENT), "worker": ("worker_addr", m.TO_WORKER)}


# ---- the tests ----------------------------------------------------------------------------------


JUNK = {"bytes": random_bytes, "frames": random_frames}


@pytest.mark.parametrize("junk", sorted(JUNK))
@pytest.mark.parametrize("port", sorted(PORTS))
@settings(PROFILE)
@given(data=st.data())
def test_random_bytes_and_frames(coord, bystander, port, junk, data):
    attr, legal = PORTS[port]
    check_frames(exchange(getattr(coord, attr), data.draw(JUNK[junk], label=junk)), legal)
    still_served(coord, bystander)


@settings(PROFILE)
@given(case=field_mutations(CLIENT_REQUESTS))
def test_every_client_request_field_mutated(coord, bystander, case):
    kind, field, value = case
    frames = exchange(coord.client_addr, encode(mutated(CLIENT_REQUESTS[kind], field, value)))
    check_frames(frames, m.TO_CLIENT)
    assert len(frames) <= 1, frames  # one request: one reply (or a refusal), never more
    still_served(coord, bystander)


@settings(PROFILE)
@given(field=st.sampled_from(sorted(WORKFLOW_JOB)), value=mutants, place=st.integers(min_value=0, max_value=2))
def test_every_field_of_a_workflow_s_job_mutated(coord, bystander, field, value, place):
    first = dict(CLIENT_REQUESTS["SUBMIT_WORKFLOW"]["jobs"][0])
    jobs = [first, first, mutated(WORKFLOW_JOB, field, value)][place:]  # after a job, after a duplicate, alone
    frames = exchange(coord.client_addr, encode(dict(CLIENT_REQUESTS["SUBMIT_WORKFLOW"], jobs=jobs)))
    check_frames(frames, m.TO_CLIENT)
    assert len(frames) <= 1, frames
    still_served(coord, bystander)


@settings(PROFILE)
@given(case=field_mutations(WORKER_REQUESTS))
def test_every_worker_message_field_mutated(coord, bystander, case):
    kind, field, value = case
    worker_id = "w-fuzz-%d" % next(_worker_ids)
    base = dict(WORKER_REQUESTS[kind], workerId=worker_id)
    prelude = [] if kind == "WORKER_REGISTER" else [dict(WORKER_REQUESTS["WORKER_REGISTER"], workerId=worker_id)]
    frames = exchange(coord.worker_addr, encode(mutated(base, field, value)), prelude)
    check_frames(frames, m.TO_WORKER)
    if prelude and frames:
        # The registration is answered by the core, a violation's ERROR by the handler at
        # once, so an ERROR may come first. (A worker that leaves at once may hear nothing:
        # its handler stops writing when it sees the EOF.)
        assert frames[0]["type"] in ("WORKER_REGISTERED", "ERROR"), frames
    still_served(coord, bystander)


@settings(PROFILE)
@given(case=field_mutations(CLIENT_REQUESTS))
def test_client_requests_on_the_worker_port_are_refused_with_the_right_port(coord, bystander, case):
    kind, field, value = case
    if field == "type":
        return  # a mutated type is no longer a client request
    frames = exchange(coord.worker_addr, encode(mutated(CLIENT_REQUESTS[kind], field, value)))
    check_frames(frames, m.TO_WORKER)
    assert frames, "no ERROR for %s on the worker port" % kind
    message = frames[-1]["message"]
    assert ("belongs on the client port" in message or "invalid frame length" in message
            or "JSON" in message or "surrogate" in message), message
    still_served(coord, bystander)
