"""Workflows under kill -9 (CONTRACT.md "Workflows"; docs/PROTOCOL.md "Workflows"), with
real processes.

A 500-job fan-out / fan-in (a root, 480 parallel jobs, 16 joins over slices of 30, two
joins over 8 of those, a final join) is submitted while a client submits plain jobs (and
the coordinator is killed around that submit, which the client sends again), and run by
real worker processes (one job in 20 fails its first attempt and is retried) whose task
(a module this test writes) appends one line per start and per end of each run to a file
(O_APPEND, one write): job id, ref, attempt, a digest of ``ctx.parents`` and, at the end,
the nonce it returns in its result. The coordinator is killed with SIGKILL at random
points (each once a random number of steps have ended, after a random delay; seeded: the
seed is printed, and JOBMESH_CRASH_SEED replays it) and restarted on the same database,
until the workflow ends. Then: the workflow is COMPLETED; no job of it is missing; each
job was released once (retries aside) and completed once; each one's COMPLETED result is
from a run that saw exactly the results its parents' final snapshots hold; each join's
runs ended once (a join is started again only if its earlier attempt never ended); every
plain job ended; a WAIT_WORKFLOW sent before the crashes saw the workflow's end.

test_standby.py runs the same across takeovers on PostgreSQL, with this module's parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable

from jobmesh.client import CoordinatorClient
from jobmesh.errors import ClientError
from tests.support.peers import wait_registered
from tests.support.processes import WorkerProc
from tests.support.waiting import wait_until

TYPE = "WFC"
TASKS_MODULE = "jm_wfc_tasks"
TASKS_SOURCE = '''
import hashlib
import json
import os
import time

from jobmesh.worker import task


def record(path, line):
    """One line appended in one write (O_APPEND): whole, whatever else writes to the file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, sort_keys=True) + "\\n").encode())
    finally:
        os.close(fd)


def digest(parents):
    return hashlib.sha256(json.dumps(parents, sort_keys=True).encode()).hexdigest()


@task("%s")
def step(payload, ctx):
    line = {"jobId": ctx.job_id, "ref": payload["ref"], "attempt": ctx.attempt, "parents": digest(ctx.parents)}
    record(payload["log"], dict(line, run="start"))
    time.sleep(payload.get("ms", 0) / 1000)
    if ctx.attempt == 1 and payload.get("flaky"):
        raise RuntimeError("a first attempt that fails")
    nonce = os.urandom(8).hex()
    record(payload["log"], dict(line, run="end", nonce=nonce))
    return {"ref": payload["ref"], "nonce": nonce, "parents": line["parents"]}
''' % TYPE

LEAVES, SLICE, UPPER = 480, 30, 8
KILLS = 5  # at most, while the workflow runs (after one around its submit)
ENDED = 60.0  # generous bound on the workflow's end once the kills are over


def digest(parents: dict[str, Any]) -> str:
    """The tasks module's digest of ``ctx.parents``."""
    return hashlib.sha256(json.dumps(parents, sort_keys=True).encode()).hexdigest()


def seeded(name: str) -> random.Random:
    """The run's random generator; its seed printed (shown with a failure) for a replay."""
    seed = int(os.environ.get("JOBMESH_CRASH_SEED") or random.randrange(1 << 32))
    print("%s: JOBMESH_CRASH_SEED=%d" % (name, seed))
    return random.Random(seed)


def write_tasks(where: Path) -> Path:
    (where / (TASKS_MODULE + ".py")).write_text(TASKS_SOURCE)
    return where


def fan_out_fan_in(log: Path, rng: random.Random) -> list[dict[str, Any]]:
    """The 500 jobs: root; leaf.0..479 after it; mid.0..15 each after 30 leaves; upper.0..1
    each after 8 mids; final after both uppers. One in 20, chosen at random, fails its
    first attempt (after its start line: no end line) and completes on its second."""
    def one(ref: str, depends: list[str] | None = None, ms: int = 0) -> dict[str, Any]:
        # one job in 20 fails its first attempt: its retry must get the same parents
        flaky = rng.random() < 0.05
        item: dict[str, Any] = {"ref": ref, "taskType": TYPE, "maxAttempts": 3,
                                "payload": {"ref": ref, "log": str(log), "ms": ms, "flaky": flaky}}
        if depends:
            item["dependsOn"] = list(depends)
        return item

    leaves = ["leaf.%d" % i for i in range(LEAVES)]
    mids = ["mid.%d" % k for k in range(LEAVES // SLICE)]
    uppers = ["upper.%d" % u for u in range(len(mids) // UPPER)]
    jobs = [one("root")]
    jobs += [one(ref, ["root"], rng.randrange(10, 60)) for ref in leaves]
    jobs += [one(ref, leaves[k * SLICE:(k + 1) * SLICE]) for k, ref in enumerate(mids)]
    jobs += [one(ref, mids[u * UPPER:(u + 1) * UPPER]) for u, ref in enumerate(uppers)]
    jobs.append(one("final", uppers))
    assert len(jobs) == 500
    return jobs


class PlainLoad:
    """A client submitting plain jobs of the same type (each with its own idempotency key,
    sent again until answered) from a thread until ``stop``; ``acknowledged``: key -> job id."""

    def __init__(self, target: str, log: Path) -> None:
        self.target = target
        self.log = log
        self.acknowledged: dict[str, str] = {}
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with CoordinatorClient(self.target, timeout=30, failover_timeout=30) as client:
                n = 0
                while not self._stop.is_set():
                    key = "plain-%d" % n
                    while not self._stop.is_set():
                        try:
                            self.acknowledged[key] = client.submit(TYPE, {"ref": key, "log": str(self.log)},
                                                                   idempotency_key=key)
                            break
                        except ClientError:
                            self._stop.wait(0.05)  # the coordinator is gone: the same key again
                    n += 1
                    self._stop.wait(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.failures.append(exc)

    def stop(self) -> dict[str, str]:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive() and not self.failures, self.failures
        return self.acknowledged


def runs(log: Path) -> dict[str, list[dict[str, Any]]]:
    """The log's lines by job id."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        by_job.setdefault(entry["jobId"], []).append(entry)
    return by_job


def steps_ended(log: Path) -> tuple[int, bool]:
    """How many runs of the workflow's jobs have ended, and whether the final join's has
    (read from the log: no coordinator asked)."""
    ended, final = 0, False
    for line in log.read_text().splitlines() if log.exists() else ():
        if line.endswith('"run": "end"}') and '"ref": "plain-' not in line:
            ended += 1
            final = final or '"ref": "final"' in line
    return ended, final


def submit_across_a_crash(client: CoordinatorClient, jobs: list[dict[str, Any]], rng: random.Random,
                          crash: Callable[[int], None]) -> tuple[str, dict[str, str]]:
    """The workflow submitted with every job keyed (so the client sends it again after a
    lost connection) while the coordinator is killed at a random moment around it: before
    it arrives, before its commit, or before its reply."""
    got: list[tuple[str, dict[str, str]]] = []
    failures: list[BaseException] = []

    def submit() -> None:
        try:
            got.append(client.submit_workflow(jobs, "fan", idempotency_key="fan"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    thread = threading.Thread(target=submit)
    thread.start()
    time.sleep(rng.uniform(0, 0.05))
    crash(0)
    thread.join(90)
    assert not thread.is_alive() and not failures, failures
    return got[0]


class Waited(threading.Thread):
    """``wait_workflow`` in a thread of its own; ``outcome``: [the state it returned] or [the error]."""

    def __init__(self, target: str, workflow_id: str) -> None:
        super().__init__(daemon=True)
        self.target, self.workflow_id = target, workflow_id
        self.outcome: list[Any] = []

    def run(self) -> None:
        try:
            with CoordinatorClient(self.target, timeout=30, failover_timeout=60) as client:
                self.outcome.append(client.wait_workflow(self.workflow_id, timeout=4 * ENDED)["state"])
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.outcome.append(exc)


def wait_through_crashes(target: str, workflow_id: str) -> Waited:
    waited = Waited(target, workflow_id)
    waited.start()
    return waited


def crash_loop(rng: random.Random, log: Path, crash: Callable[[int], None], made: int) -> int:
    """``crash(n)`` (kill -9, then a coordinator on the same database leads) at random
    points of the workflow: each once a random number of its steps have ended (so the
    crashes fall among the leaves' results and the joins' releases alike, however fast
    the machine), after a random delay; until the final join has run or KILLS crashes.
    ``made``: crashes made before; returns how many were made in all."""
    points = sorted(rng.sample(range(1, 500), KILLS))
    for point in points:
        def reached() -> tuple[int, bool] | None:
            ended, final = steps_ended(log)
            return (ended, final) if ended >= point or final else None

        if wait_until(reached, timeout=ENDED, message="%d steps ended" % point)[1]:
            break
        time.sleep(rng.uniform(0, 0.05))
        crash(made)
        made += 1
    print("crash points (steps ended): %s" % [p for p in points if p <= steps_ended(log)[0]])
    return made


def check_outcomes(client: CoordinatorClient, log: Path, workflow_id: str, job_ids: dict[str, str],
                   jobs: list[dict[str, Any]], plain: dict[str, str], seed_note: str) -> None:
    """Every guarantee of the module docstring, from the coordinator's answers and the log."""
    done = client.wait_workflow(workflow_id, timeout=ENDED)
    assert done["state"] == "COMPLETED", (seed_note, done["state"])
    assert [(j["ref"], j["jobId"], j["state"]) for j in done["jobs"]] == [
        (item["ref"], job_ids[item["ref"]], "COMPLETED") for item in jobs], seed_note
    by_job = runs(log)
    results = {ref: client.status(job_id) for ref, job_id in job_ids.items()}
    for item in jobs:
        ref, job_id = item["ref"], job_ids[item["ref"]]
        snapshot = results[ref]
        assert (snapshot["workflowId"], snapshot["ref"]) == (workflow_id, ref), seed_note
        events = [e["event"] for e in client.events(job_id)]
        # released once (a QUEUED event other than a retry's; a root is queued by its submit), completed once
        releases = [b for a, b in zip(events, events[1:]) if b == "QUEUED" and a != "RETRY_WAIT"]
        assert len(releases) == (1 if item.get("dependsOn") else 0), (seed_note, ref, events)
        assert events.count("COMPLETED") == 1, (seed_note, ref, events)
        lines = by_job.get(job_id, [])
        assert {line["ref"] for line in lines} == {ref}, (seed_note, ref, lines)
        ends = [line for line in lines if line["run"] == "end"]
        [completing] = [line for line in ends if line["nonce"] == snapshot["result"]["nonce"]]
        seen = digest({p: results[p]["result"] for p in item.get("dependsOn", ())})
        assert completing["parents"] == snapshot["result"]["parents"] == seen, (seed_note, ref)
        if len(item.get("dependsOn", ())) > 1:  # a join: its runs ended once, the one whose result it kept
            assert ends == [completing], (seed_note, ref, lines)
            assert all(line["attempt"] <= completing["attempt"] for line in lines), (seed_note, ref, lines)
    workflow_ids = set(job_ids.values())
    assert not [line for job_id, lines in by_job.items() if job_id not in workflow_ids
                for line in lines if not line["ref"].startswith("plain-")], seed_note
    for key, job_id in plain.items():
        assert client.wait(job_id, timeout=ENDED)["state"] == "COMPLETED", (seed_note, key)


def run_under_crashes(tmp_path: Path, name: str, client_target: str, worker_target: str,
                      crash: Callable[[int], None], started: list[WorkerProc]) -> None:
    """The whole scenario against coordinators on ``client_target`` / ``worker_target``
    (one address, or a list), ``crash(n)`` making the n-th crash and takeover."""
    rng = seeded(name)
    seed_note = "replay with JOBMESH_CRASH_SEED as printed above"
    where = write_tasks(tmp_path)
    log = tmp_path / "runs.log"
    for n in (1, 2):
        started.append(WorkerProc(tmp_path, worker_target, worker_id="wfc-%d" % n, capacity=4,
                                  tasks=TASKS_MODULE, cwd=where, log_level="INFO").start())
    with CoordinatorClient(client_target, timeout=30, failover_timeout=60) as client:
        wait_registered(client, ["wfc-1", "wfc-2"], timeout=30)
        load = PlainLoad(client_target, log)
        wait_until(lambda: len(load.acknowledged) >= 10, timeout=30, message="plain jobs before the workflow")
        jobs = fan_out_fan_in(log, rng)
        try:
            workflow_id, job_ids = submit_across_a_crash(client, jobs, rng, crash)
            waited = wait_through_crashes(client_target, workflow_id)
            made = crash_loop(rng, log, crash, 1)
        finally:
            plain = load.stop()
        print("%s: %d crashes, %d plain jobs" % (name, made, len(plain)))
        assert made >= 3, "the workflow ended before a third crash: this run tests too little"
        check_outcomes(client, log, workflow_id, job_ids, jobs, plain, seed_note)
        # a WAIT_WORKFLOW sent before the crashes, sent again after each, saw the workflow's end
        waited.join(ENDED)
        assert waited.outcome == ["COMPLETED"], (seed_note, waited.outcome)
        # one workflow was made of the submit sent again: the same submit now is answered with it
        assert client.submit_workflow(jobs, "fan", idempotency_key="fan") == (workflow_id, job_ids), seed_note


def test_kill_9_of_the_coordinator_at_random_points_of_a_fan_out_fan_in_loses_and_repeats_no_step(
        coordinator_factory, tmp_path):
    # Given a coordinator on SQLite that lets workers keep their attempts across a restart
    coord = coordinator_factory(lease_grace_millis=10_000)
    ports = {"worker_port": coord.worker_addr[1], "client_port": coord.client_addr[1]}
    started: list[WorkerProc] = []

    def crash(n: int) -> None:
        # When it is killed, and started again on the same database and ports
        coord.kill()
        coord.start(**ports)

    try:
        # Then the workflow completes with every step once, with all its parents' results
        run_under_crashes(tmp_path, "sqlite", coord.client_target, coord.worker_target, crash, started)
    finally:
        for worker in started:
            worker.cleanup()
