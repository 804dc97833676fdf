"""The client commands: submit, status, list, workers, cancel, wait.

Each handler takes a connected-on-demand ``CoordinatorClient`` and docopt's dict, prints
its output (text, or one JSON document with ``--json``) and returns the exit code the
contract names (README.md, "Command line"). Bad flag values raise ``ConfigError``
before anything is sent; ``cli.main`` turns that into exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

from jobmesh.cli import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_UNREACHABLE
from jobmesh.client import render
from jobmesh.client.api import CoordinatorClient, WaitTimeout
from jobmesh.config import parse_hostport
from jobmesh.errors import ConfigError, CoordinatorUnavailable, RequestFailed, SubmitRejected
from jobmesh.protocol.jobs import JobState, Priority

MAX_PAGE = 1000


def _now_millis() -> int:
    return int(time.time() * 1000)


def _print(text: str) -> None:
    print(text, flush=True)


def _error(command: str, text: str) -> None:
    print("jobmesh %s: %s" % (command, text), file=sys.stderr, flush=True)


def _int_flag(args: dict[str, Any], flag: str, low: int) -> int:
    raw = args[flag]
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError("%s must be an integer, got %r" % (flag, raw)) from None
    if value < low:
        raise ConfigError("%s must be >= %d, got %d" % (flag, low, value))
    return value


def _timeout_seconds(args: dict[str, Any]) -> float | None:
    millis = _int_flag(args, "--timeout-millis", 0)
    return None if millis == 0 else millis / 1000.0


def parse_payload(text: str | None, stdin: Any = None) -> dict[str, Any]:
    """PAYLOAD_JSON as a dict: absent means ``{}``, ``-`` reads stdin; ConfigError if not an object."""
    if text is None:
        return {}
    source = "PAYLOAD_JSON"
    if text == "-":
        text = (stdin or sys.stdin).read()
        source = "the payload on stdin"
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise ConfigError("%s is not valid JSON (%s): %r" % (source, exc, text[:200])) from None
    if not isinstance(payload, dict):
        raise ConfigError("%s must be a JSON object like {\"text\": \"...\"}, got %r" % (source, text[:200]))
    return payload


def _show_job(job: dict[str, Any], as_json: bool, **extra: Any) -> None:
    if as_json:
        _print(render.to_json(dict(job, **extra)))
    else:
        _print(render.job_detail(job, _now_millis()))


def _await(command: str, client: CoordinatorClient, job_id: str, timeout: float | None, as_json: bool) -> int:
    """Wait for the job, print its final snapshot, and map its end state to an exit code."""
    try:
        job = client.wait(job_id, timeout=timeout)
    except WaitTimeout as exc:
        _show_job(exc.job, as_json)
        _error(command, "timed out: %s" % exc)
        return EXIT_TIMEOUT
    _show_job(job, as_json)
    if job.get("state") == JobState.COMPLETED.value:
        return EXIT_OK
    _error(command, "job %s ended %s: %s" % (job_id, job.get("state"), job.get("error") or "no error recorded"))
    return EXIT_FAILED


# ---- handlers ---------------------------------------------------------------------------


def submit(client: CoordinatorClient, args: dict[str, Any]) -> int:
    task_type = str(args["TASK_TYPE"]).upper()
    try:
        priority = Priority.parse(str(args["--priority"]).upper())
    except ValueError as exc:
        raise ConfigError("--priority: %s" % exc) from None
    max_attempts = _int_flag(args, "--max-attempts", 0)
    retries = _int_flag(args, "--submit-retries", 0)
    timeout = _timeout_seconds(args)
    payload = parse_payload(args["PAYLOAD_JSON"])
    as_json = args["--json"]
    try:
        job_id = client.submit(task_type, payload, max_attempts, priority.value,
                               args["--idempotency-key"], submit_retries=retries)
    except SubmitRejected as exc:
        _error("submit", "rejected, the coordinator is overloaded: %s%s"
               % (exc, "; try --submit-retries=N" if exc.retryable and not retries else ""))
        return EXIT_FAILED
    if not args["--wait"]:
        _print(render.to_json({"jobId": job_id}) if as_json else render.submitted(job_id))
        return EXIT_OK
    if not as_json:
        _print(render.submitted(job_id))
    try:
        return _await("submit", client, job_id, timeout, as_json)
    except CoordinatorUnavailable as exc:
        raise CoordinatorUnavailable("job %s was submitted, then: %s" % (job_id, exc)) from exc


def status(client: CoordinatorClient, args: dict[str, Any]) -> int:
    _show_job(client.status(args["JOB_ID"]), args["--json"])
    return EXIT_OK


def list_jobs(client: CoordinatorClient, args: dict[str, Any]) -> int:
    limit = _int_flag(args, "--limit", 1)
    state = args["--state"]
    if state is not None:
        try:
            state = JobState(state.upper()).value
        except ValueError:
            raise ConfigError("--state must be one of %s, got %r"
                              % (", ".join(s.value for s in JobState), state)) from None
    jobs: list[dict[str, Any]] = []
    cursor = None
    while len(jobs) < limit:
        page, cursor = client.list_jobs(min(MAX_PAGE, limit - len(jobs)), state, cursor)
        jobs.extend(page)
        if cursor is None or not page:
            break
    jobs = jobs[:limit]
    _print(render.to_json(jobs) if args["--json"] else render.job_table(jobs, _now_millis()))
    return EXIT_OK


def workers(client: CoordinatorClient, args: dict[str, Any]) -> int:
    found = client.workers()
    _print(render.to_json(found) if args["--json"] else render.worker_table(found, _now_millis()))
    return EXIT_OK


def cancel(client: CoordinatorClient, args: dict[str, Any]) -> int:
    was_cancelled, job = client.cancel(args["JOB_ID"])
    if args["--json"]:
        _show_job(job, True, cancelled=was_cancelled)
    else:
        _print(render.cancelled(was_cancelled, job))
        _show_job(job, False)
    return EXIT_OK


def wait(client: CoordinatorClient, args: dict[str, Any]) -> int:
    return _await("wait", client, args["JOB_ID"], _timeout_seconds(args), args["--json"])


HANDLERS: dict[str, Callable[[CoordinatorClient, dict[str, Any]], int]] = {
    "submit": submit,
    "status": status,
    "list": list_jobs,
    "workers": workers,
    "cancel": cancel,
    "wait": wait,
}


def run_client_command(command: str, args: dict[str, Any]) -> int:
    """Run one client command; returns its exit code. ConfigError propagates (exit 2)."""
    host, port = parse_hostport(args["--coordinator"])
    handler = HANDLERS[command]
    try:
        with CoordinatorClient(host, port) as client:
            return handler(client, args)
    except CoordinatorUnavailable as exc:
        _error(command, "coordinator unreachable: %s" % exc)
        return EXIT_UNREACHABLE
    except RequestFailed as exc:
        _error(command, "the coordinator refused: %s" % exc.message)
        return EXIT_FAILED
