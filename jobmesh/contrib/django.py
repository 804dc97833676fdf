"""``JobmeshBackend``: a backend for Django's tasks that submits them to a jobmesh coordinator.

::

    # settings.py
    TASKS = {
        "default": {
            "BACKEND": "jobmesh.contrib.django.JobmeshBackend",
            "OPTIONS": {"coordinator": "127.0.0.1:7071", "token": None},
        }
    }

The task framework is Django's own ``django.tasks`` (Django 6, Python 3.12+) when there is
one, and else its backport ``django_tasks`` (the ``django-tasks`` package, Django 4.2+); the
two have the same API and this module takes whichever it finds.

A Django task is a jobmesh job of the task type named by the task's module path
(``myapp.tasks.send_mail``); ``jobmesh worker --django=SETTINGS`` declares those types and runs
them (``jobmesh.contrib.django_worker``). On the wire:

- payload ``{"args": [...], "kwargs": {...}}`` (the task's arguments, as JSON);
- result ``{"returnValue": ...}`` (what the function returned, as JSON);
- a failed attempt's error: ``module.ExceptionClass: message`` on its first line, then the
  traceback (``failure_text``), which ``get_result`` turns back into a ``TaskError``.

The result id is the jobId. ``get_result`` reads the job: its snapshot, its payload (the
task's arguments) and, once it was attempted or cancelled, its timeline. A job's state maps
to Django's statuses: QUEUED, SCHEDULED and RETRY_WAIT are READY, RUNNING is RUNNING,
COMPLETED is SUCCESSFUL, FAILED and CANCELLED are FAILED. Django's priority (-100..100)
maps to the nearest of jobmesh's three: 100 HIGH, 0 NORMAL, -100 LOW (51..100 HIGH, -50..50
NORMAL, -100..-51 LOW). Queue names are checked against the backend's ``QUEUES`` as Django
does, and otherwise not used: jobmesh routes jobs by task type.

The client is the blocking ``CoordinatorClient`` (stdlib sockets: no gevent, no patching),
one per backend instance, that is one per thread (Django keeps task backends per thread);
``aenqueue`` and ``aget_result`` run the blocking calls in a thread, as Django's base
class does.
"""

from __future__ import annotations

import importlib
import re
import traceback
import uuid
from datetime import datetime, timezone as dt_timezone
from types import ModuleType
from typing import Any

from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import RequestFailed
from jobmesh.protocol.jobs import Priority
from jobmesh.protocol.payloads import TASK_NAME_RULE, is_task_type_name


def _framework() -> ModuleType:
    """``django.tasks`` (Django 6) if this Django has it, else the ``django_tasks`` backport."""
    try:
        return importlib.import_module("django.tasks")
    except ImportError:
        return importlib.import_module("django_tasks")


_package = _framework().__name__
framework: Any = importlib.import_module(_package + ".base")  # Task, TaskResult, TaskContext, TaskError ...
_backends: Any = importlib.import_module(_package + ".backends.base")
_exceptions: Any = importlib.import_module(_package + ".exceptions")
_signals: Any = importlib.import_module(_package + ".signals")
# Django 6 names it InvalidTask; the backport, InvalidTaskError.
InvalidTask: type[Exception] = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist: type[Exception] = _exceptions.TaskResultDoesNotExist

RETURN_VALUE = "returnValue"  # the result's one key
OPTIONS = ("coordinator", "token")
_STATUS = {"QUEUED": "READY", "SCHEDULED": "READY", "RETRY_WAIT": "READY", "RUNNING": "RUNNING",
           "COMPLETED": "SUCCESSFUL", "FAILED": "FAILED", "CANCELLED": "FAILED"}
# The timeline events that end an attempt, or the job, without a result.
_FAILURE_EVENTS = ("ATTEMPT_FAILED", "LEASE_EXPIRED", "WORKER_LOST", "CANCELLED")
_RAISED = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::|$)")


class JobFailed(Exception):
    """What a result's ``errors`` name when an attempt, or the job, ended without the task
    function raising: its lease expired, its worker or task process was lost, its result
    was too large, or the job was cancelled. The error's traceback is jobmesh's reason."""


def jobmesh_priority(priority: int) -> Priority:
    """Django's priority (-100..100) as the nearest of jobmesh's three; a tie goes to NORMAL."""
    if priority > 50:
        return Priority.HIGH
    if priority < -50:
        return Priority.LOW
    return Priority.NORMAL


def failure_text(exc: BaseException, limit: int) -> str:
    """A failed attempt's error for ``exc``: ``module.Class: message`` on the first line,
    then the traceback, cut in the middle to at most ``limit`` characters (the end of a
    traceback says the most)."""
    kind = type(exc)
    message = " ".join(str(exc).split())
    head = "%s.%s" % (kind.__module__, kind.__qualname__) + (": " + message if message else "")
    head = head[: limit // 4]
    body = "".join(traceback.format_exception(exc))
    room = limit - len(head) - 1
    if len(body) > room:
        body = "...\n" + body[len(body) - room + 4:]
    return head + "\n" + body


def task_error(text: str) -> Any:
    """The ``TaskError`` a failed attempt's error stands for (``failure_text``'s form, or
    else a ``JobFailed`` carrying jobmesh's reason)."""
    first, _, rest = text.partition("\n")
    raised = _RAISED.match(first)
    if raised is not None and rest:
        return framework.TaskError(exception_class_path=raised.group(1), traceback=rest)
    return framework.TaskError(exception_class_path="%s.%s" % (JobFailed.__module__, JobFailed.__qualname__),
                               traceback=text)


def as_datetime(millis: int | None) -> datetime | None:
    """Epoch milliseconds as Django wants a time: aware, or naive local time without USE_TZ."""
    if millis is None:
        return None
    from django.conf import settings
    from django.utils import timezone

    at = datetime.fromtimestamp(millis / 1000.0, tz=dt_timezone.utc)
    return at if settings.USE_TZ else timezone.make_naive(at)


class JobmeshBackend(_backends.BaseTaskBackend):
    """Django's ``TASKS`` backend for jobmesh (OPTIONS: ``coordinator``, ``token``)."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        from django.core.exceptions import ImproperlyConfigured

        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ImproperlyConfigured("TASKS[%r]: unknown OPTIONS %s; JobmeshBackend takes %s"
                                       % (alias, ", ".join(unknown), ", ".join(OPTIONS)))
        self._coordinator = self.options.get("coordinator")
        self._token = self.options.get("token")
        self._client: CoordinatorClient | None = None

    @property
    def client(self) -> CoordinatorClient:
        """The backend's client, connected on first use."""
        if self._client is None:
            self._client = CoordinatorClient(self._coordinator, token=self._token)
        return self._client

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        if not is_task_type_name(task.module_path):
            raise InvalidTask("the task's module path %r is no jobmesh task type: those are %s"
                              % (task.module_path, TASK_NAME_RULE))

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        """Submit the task as a job; its result's id is the jobId."""
        from django.utils import timezone

        self.validate_task(task)
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # USE_TZ = False: local time
            run_at = timezone.make_aware(run_at)
        draft = make_result(task, "", "READY", list(args), dict(kwargs), self.alias)  # its args as JSON
        # A random key makes the submit safe to send again after a lost connection.
        job_id = self.client.submit(task.module_path, {"args": draft.args, "kwargs": draft.kwargs},
                                    priority=jobmesh_priority(task.priority), run_at=run_at,
                                    idempotency_key=uuid.uuid4().hex)
        result = make_result(task, job_id, "READY", draft.args, draft.kwargs, self.alias, enqueued_at=timezone.now())
        send_signal("task_enqueued", self, result)
        return result

    def get_result(self, result_id: str) -> Any:
        """The job ``result_id`` as a ``TaskResult``, with its ``args`` and ``kwargs``;
        ``TaskResultDoesNotExist`` if there is no such job, or it is not a Django task's."""
        client = self.client
        try:
            job = client.status(result_id)
            task = self._task_of(job)
            arguments = task_arguments(client.payload(result_id))
        except RequestFailed as exc:
            if exc.message.startswith("unknown job"):
                raise TaskResultDoesNotExist(result_id) from None
            raise
        if arguments is None:
            raise TaskResultDoesNotExist("job %s is a %s job whose payload is no Django task's arguments"
                                         % (result_id, job["taskType"]))
        args, kwargs = arguments
        events = client.events(result_id) if job["attempts"] or job["state"] == "CANCELLED" else []
        assigned = [e for e in events if e["event"] == "ASSIGNED"]
        finished = job["state"] in ("COMPLETED", "FAILED", "CANCELLED")
        result = make_result(
            task, result_id, _STATUS[job["state"]], args, kwargs, self.alias,
            enqueued_at=as_datetime(job["createdAtMillis"]),
            started_at=as_datetime(assigned[0]["atMillis"]) if assigned else None,
            last_attempted_at=as_datetime(assigned[-1]["atMillis"]) if assigned else None,
            finished_at=as_datetime(job["updatedAtMillis"]) if finished else None,
            worker_ids=[str(e.get("workerId")) for e in assigned],
            errors=[task_error(str(e.get("detail") or e["event"].lower().replace("_", " ")))
                    for e in events if e["event"] in _FAILURE_EVENTS])
        if job["state"] == "COMPLETED":
            object.__setattr__(result, "_return_value", (job["result"] or {}).get(RETURN_VALUE))
        return result

    def close(self) -> None:
        """Close the connection (the next call opens another); Django's ``close_all`` of
        its task backends calls it."""
        if self._client is not None:
            self._client.close()

    def _task_of(self, job: dict[str, Any]) -> Any:
        from django.utils.module_loading import import_string

        try:
            task = import_string(job["taskType"])
        except ImportError:
            task = None
        if not isinstance(task, framework.Task):
            raise TaskResultDoesNotExist("job %s is a %s job, not a Django task's" % (job["jobId"], job["taskType"]))
        return task


def task_arguments(payload: dict[str, Any] | None) -> tuple[list[Any], dict[str, Any]] | None:
    """A Django task's args and kwargs from its job's payload (either may be absent), as the
    worker calls the function with them; None if the payload is not of that shape."""
    if payload is None:
        return None
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return None
    return args, kwargs


def make_result(task: Any, result_id: str, status: str, args: Any, kwargs: Any, backend: str, *,
                enqueued_at: datetime | None = None, started_at: datetime | None = None,
                last_attempted_at: datetime | None = None, finished_at: datetime | None = None,
                worker_ids: list[str] | None = None, errors: list[Any] | None = None) -> Any:
    """A ``TaskResult`` of the framework in use (its args and kwargs normalized to JSON)."""
    return framework.TaskResult(
        task=task, id=result_id, status=framework.TaskResultStatus[status], enqueued_at=enqueued_at,
        started_at=started_at, last_attempted_at=last_attempted_at, finished_at=finished_at,
        args=args, kwargs=kwargs, backend=backend, errors=errors or [], worker_ids=worker_ids or [])


def send_signal(name: str, backend: Any, result: Any) -> None:
    """Send the framework's ``task_enqueued``, ``task_started`` or ``task_finished`` for
    ``result`` (a version of it without that signal is sent nothing)."""
    signal = getattr(_signals, name, None)
    if signal is not None:
        signal.send(type(backend), task_result=result)
