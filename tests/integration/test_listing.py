"""LIST_JOBS: newest first, limit (default 100, at most 1000), state filter, cursor paging (CONTRACT.md).

Most checks need a coordinator holding exactly their jobs and start their own. The paging
checks only read, so the limits share one coordinator per store holding 250 jobs; the
error checks share one and compare the listing before and after.
"""

from __future__ import annotations

import pytest

from tests.support.peers import Client
from tests.pg_support import on_both_stores

SNAPSHOT_FIELDS = {"jobId", "taskType", "state", "attempts", "maxAttempts", "workerId", "result", "error",
                   "createdAtMillis", "updatedAtMillis", "priority", "runAtMillis",
                   "retryAtMillis", "retryOf", "waitingReason", "protocol", "name",
                   "submittedBy", "concurrencyKey", "uniqueKey", "progress", "workflowId", "ref"}


def submit_many(client, n: int, task: str = "SLEEP") -> list[str]:
    """Pipeline ``n`` submissions on one connection (fast); returns ids in submission order."""
    ids: list[str] = []
    batch = 200
    for start in range(0, n, batch):
        count = min(batch, n - start)
        for i in range(start, start + count):
            client.conn.send({"type": "SUBMIT_JOB", "taskType": task, "payload": {"durationMillis": i % 1000}})
        for _ in range(count):
            reply = client.conn.recv()
            assert reply["type"] == "JOB_SUBMITTED", reply
            ids.append(reply["jobId"])
    return ids


@pytest.fixture(scope="module")
def _stocked():
    return {}


@pytest.fixture
def jobs_250(_stocked, module_coordinators, db_kind):
    """``(coordinator, ids in submission order)``: a coordinator on the test's store holding
    250 jobs and nothing else, shared by the module's tests that only read them."""
    if db_kind not in _stocked:
        coord = module_coordinators(store=db_kind)
        client = Client(coord.client_addr)
        try:
            _stocked[db_kind] = (coord, submit_many(client, 250))
        finally:
            client.close()
    return _stocked[db_kind]


def page(client, **fields) -> dict:
    reply = client.list_jobs(**fields)
    assert reply["type"] == "JOB_LIST", reply
    assert "nextCursor" in reply
    return reply


@on_both_stores
def test_newest_first_with_full_snapshots(coordinator, peers):
    client = peers.client(coordinator)
    ids = [client.submit_ok("WORD_COUNT", {"text": "job %d" % i}) for i in range(5)]
    reply = page(client)
    assert [j["jobId"] for j in reply["jobs"]] == ids[::-1]
    assert reply["nextCursor"] is None
    for item in reply["jobs"]:
        assert set(item) == SNAPSHOT_FIELDS
        assert item == client.status(item["jobId"])


def test_empty_list(coordinator, peers):
    reply = page(peers.client(coordinator))
    assert reply["jobs"] == [] and reply["nextCursor"] is None


def test_default_limit_is_100(coordinator, peers):
    client = peers.client(coordinator)
    ids = submit_many(client, 130)
    first = page(client)
    assert [j["jobId"] for j in first["jobs"]] == ids[::-1][:100]
    assert isinstance(first["nextCursor"], str) and first["nextCursor"]
    rest = page(client, cursor=first["nextCursor"])
    assert [j["jobId"] for j in rest["jobs"]] == ids[::-1][100:]
    assert rest["nextCursor"] is None


def test_limit_is_at_most_1000(coordinator, peers):
    # Given more than 1000 jobs
    client = peers.client(coordinator)
    ids = submit_many(client, 1010)
    # When a page of 1000 is asked for, exactly 1000 come back, newest first
    full = page(client, limit=1000)
    assert [j["jobId"] for j in full["jobs"]] == ids[::-1][:1000]
    assert full["nextCursor"] is not None
    # When more than 1000 are asked for, the reply is an ERROR or at most 1000 jobs
    reply = client.list_jobs(limit=5000)
    if reply["type"] == "JOB_LIST":
        assert len(reply["jobs"]) <= 1000
        assert [j["jobId"] for j in reply["jobs"]] == ids[::-1][:len(reply["jobs"])]
        assert reply["nextCursor"] is not None
    else:
        assert reply["type"] == "ERROR" and reply["message"]
        assert client.workers() == []  # still open


@on_both_stores
@pytest.mark.parametrize("limit", [1, 7, 40, 250])
def test_cursor_paging_visits_each_job_exactly_once(jobs_250, peers, limit):
    # Given 250 jobs
    coordinator, ids = jobs_250
    client = peers.client(coordinator)
    # When paging with the given limit until nextCursor is null
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        fields = {"limit": limit}
        if cursor is not None:
            fields["cursor"] = cursor
        reply = page(client, **fields)
        pages += 1
        assert len(reply["jobs"]) <= limit
        seen += [j["jobId"] for j in reply["jobs"]]
        cursor = reply["nextCursor"]
        if cursor is None:
            break
        assert pages <= 250, "paging does not terminate"
    # Then every job is visited exactly once, newest first overall
    assert seen == ids[::-1]


def test_no_cursor_when_the_last_page_is_exactly_full(coordinator, peers):
    # "nextCursor (null when there are no more)": 40 jobs, limit 40 -> nothing more
    client = peers.client(coordinator)
    ids = submit_many(client, 40)
    reply = page(client, limit=40)
    assert [j["jobId"] for j in reply["jobs"]] == ids[::-1]
    assert reply["nextCursor"] is None


@on_both_stores
def test_paging_is_stable_while_new_jobs_arrive(coordinator, peers):
    # Given 100 jobs, paged 30 at a time
    client = peers.client(coordinator)
    ids = submit_many(client, 100)
    other = peers.client(coordinator)
    seen: list[str] = []
    reply = page(client, limit=30)
    while True:
        seen += [j["jobId"] for j in reply["jobs"]]
        # When new jobs are submitted between pages
        submit_many(other, 5)
        if reply["nextCursor"] is None:
            break
        reply = page(client, limit=30, cursor=reply["nextCursor"])
    # Then the jobs that existed at the start are each seen exactly once, in order
    assert [j for j in seen if j in set(ids)] == ids[::-1]
    assert len(seen) == len(set(seen))


@on_both_stores
def test_state_filter(coordinator, peers):
    # Given jobs in QUEUED, RUNNING, COMPLETED, FAILED and CANCELLED
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-list", capacity=1)
    completed = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.complete(worker.await_assign(), {"sleptMillis": 1})
    client.wait_state(completed, "COMPLETED")
    failed = client.submit_ok("SLEEP", {"durationMillis": 1}, max_attempts=1)
    worker.fail(worker.await_assign(), "x")
    client.wait_state(failed, "FAILED")
    running = client.submit_ok("SLEEP", {"durationMillis": 1})
    worker.await_assign()
    client.wait_state(running, "RUNNING")
    queued = [client.submit_ok("SLEEP", {"durationMillis": i}) for i in range(3)]
    cancelled = client.submit_ok("SLEEP", {"durationMillis": 9})
    client.cancel(cancelled)
    queued2 = client.submit_ok("SLEEP", {"durationMillis": 10})

    # When filtering by each state
    def ids_in(state):
        reply = page(client, state=state)
        assert all(j["state"] == state for j in reply["jobs"]), reply
        return [j["jobId"] for j in reply["jobs"]]

    # Then only that state's jobs come back, newest first
    assert ids_in("QUEUED") == [queued2] + queued[::-1]
    assert ids_in("RUNNING") == [running]
    assert ids_in("COMPLETED") == [completed]
    assert ids_in("FAILED") == [failed]
    assert ids_in("CANCELLED") == [cancelled]
    assert ids_in("RETRY_WAIT") == []
    assert len(page(client)["jobs"]) == 8


@on_both_stores
def test_state_filter_with_limit_and_cursor(coordinator, peers):
    client = peers.client(coordinator)
    ids = submit_many(client, 60)
    cancelled = ids[::3]
    for job_id in cancelled:
        assert client.cancel(job_id)["cancelled"] is True
    seen: list[str] = []
    reply = page(client, state="CANCELLED", limit=7)
    while True:
        assert len(reply["jobs"]) <= 7
        assert all(j["state"] == "CANCELLED" for j in reply["jobs"])
        seen += [j["jobId"] for j in reply["jobs"]]
        if reply["nextCursor"] is None:
            break
        reply = page(client, state="CANCELLED", limit=7, cursor=reply["nextCursor"])
    assert seen == cancelled[::-1]


# The cursor is opaque: only strings the coordinator handed out are valid.
@pytest.mark.parametrize("cursor", ["not-a-cursor!!", "{}", "\u2603 snowman"])
def test_bad_cursor_is_an_error_and_the_connection_stays_open(shared_coordinator, peers, cursor):
    client = peers.client(shared_coordinator)
    before = [j["jobId"] for j in page(client)["jobs"]]
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    reply = client.list_jobs(cursor=cursor)
    assert reply["type"] == "ERROR", reply
    assert reply["message"]
    assert [j["jobId"] for j in page(client)["jobs"]] == [job_id] + before


@pytest.mark.parametrize("state", ["BOGUS", "queued", "DONE"])
def test_unknown_state_filter_is_an_error_and_the_connection_stays_open(shared_coordinator, peers, state):
    client = peers.client(shared_coordinator)
    before = [j["jobId"] for j in page(client)["jobs"]]
    job_id = client.submit_ok("SLEEP", {"durationMillis": 1})
    reply = client.list_jobs(state=state)
    assert reply["type"] == "ERROR", reply
    assert [j["jobId"] for j in page(client)["jobs"]] == [job_id] + before


def test_pages_with_large_results_stay_under_the_frame_limit(coordinator, peers):
    # Given 30 completed jobs whose results are ~50 KB each (~1.5 MB in total)
    client = peers.client(coordinator)
    worker = peers.worker(coordinator, "w-bulky", capacity=30)
    ids = submit_many(client, 30)
    for _ in ids:
        a = worker.await_assign()
        worker.complete(a, {"blob": a["jobId"] * (50_000 // len(a["jobId"]))})
    for job_id in ids:
        client.wait_state(job_id, "COMPLETED")
    # When all of them are listed in one request
    # Then the reply is a valid frame (no reply exceeds 1 MiB), so the page may be shorter than asked,
    # and following nextCursor still visits each job exactly once, newest first
    seen: list[str] = []
    reply = page(client, limit=1000)
    pages = 1
    while True:
        seen += [j["jobId"] for j in reply["jobs"]]
        for j in reply["jobs"]:
            assert j["result"]["blob"].startswith(j["jobId"])
        if reply["nextCursor"] is None:
            break
        assert reply["jobs"], "a page with a cursor must make progress"
        reply = page(client, limit=1000, cursor=reply["nextCursor"])
        pages += 1
        assert pages < 100
    assert seen == ids[::-1]
    assert pages >= 2
