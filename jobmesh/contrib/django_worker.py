"""``jobmesh worker --django=SETTINGS``: a Django project's tasks as jobmesh task types.

Before the worker starts, ``set_up`` sets ``DJANGO_SETTINGS_MODULE`` and runs
``load_project``: ``django.setup()``, then each installed app's ``tasks`` module is
imported, and each Django task found there whose backend is a ``JobmeshBackend`` is
registered (``jobmesh.worker.usertasks``) as the task type of its module path,
``myapp.tasks.send_mail``. The worker then takes this module as one of its task modules:
each task process (``jobmesh.worker.child``, a clean interpreter that inherits the
environment) imports it, and so sets Django up once and registers the same types.

One attempt (``run``): Django's ``close_old_connections()`` before and after the function,
as Django does around a request, so that a connection the database dropped, or one older
than ``CONN_MAX_AGE``, is never used; the function gets the payload's ``args`` and
``kwargs`` (and a ``TaskContext`` first with ``takes_context``); what it returns is the
job's result ``{"returnValue": ...}``; an exception fails the attempt with its class and
traceback (``jobmesh.contrib.django.failure_text``), and the job is retried as its
attempt budget says. The framework's ``task_started`` and ``task_finished`` signals are
sent in the task process.

Django is imported only inside the functions: without it, ``--django`` is a one-line
error, not a traceback.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from typing import Any, Callable

from jobmesh.errors import ConfigError
from jobmesh.worker.usertasks import (MAX_ERROR_CHARS, TaskContext, TaskDefinitionError, TaskFailure, describe,
                                      task as register)

log = logging.getLogger(__name__)

SETTINGS_ENV = "DJANGO_SETTINGS_MODULE"
# The worker's id, set by ``set_up``: task processes inherit it, and it tells them to load the project.
WORKER_ENV = "JOBMESH_DJANGO_WORKER"

_project: dict[str, Any] | None = None  # task type -> Task, once loaded


def set_up(settings_module: str, worker_id: str) -> list[str]:
    """Load the project of ``settings_module`` for the worker ``worker_id``; its task types."""
    os.environ[SETTINGS_ENV] = settings_module
    os.environ[WORKER_ENV] = worker_id
    return load_project()


def load_project() -> list[str]:
    """Set Django up and register the project's jobmesh tasks (once per process); the task
    types. ``ConfigError`` in one line if Django is missing, the project cannot be set up
    or its tasks modules imported, or none of its tasks uses a ``JobmeshBackend``."""
    global _project
    if _project is not None:
        return sorted(_project)
    flag = "--django=%s" % os.environ.get(SETTINGS_ENV, "")
    cwd = os.getcwd()  # where manage.py is, as for --tasks
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        import django
    except ImportError:
        raise ConfigError("%s: Django is not installed: pip install 'jobmesh[django]'" % flag) from None
    try:
        django.setup()
        found = _project_tasks()
        for path, task in found.items():
            register(path)(_runner(task))
    except (ConfigError, TaskDefinitionError) as exc:
        raise ConfigError("%s: %s" % (flag, exc)) from None
    except Exception as exc:  # the project's own code: one line, whatever it raised
        raise ConfigError("%s: %s" % (flag, " ".join(describe(exc).split()))) from None
    _project = found
    return sorted(found)


def _project_tasks() -> dict[str, Any]:
    """The Django tasks of the installed apps' ``tasks`` modules that use a JobmeshBackend."""
    from django.apps import apps
    from django.utils.module_loading import module_has_submodule

    from jobmesh.contrib.django import JobmeshBackend, framework

    found: dict[str, Any] = {}
    for app in apps.get_app_configs():
        if not module_has_submodule(app.module, "tasks"):
            continue
        module = importlib.import_module(app.name + ".tasks")
        for value in vars(module).values():
            if isinstance(value, framework.Task) and isinstance(value.get_backend(), JobmeshBackend):
                found.setdefault(value.module_path, value)
    if not found:
        raise ConfigError("no task in the installed apps' tasks modules uses a jobmesh.contrib.django.JobmeshBackend "
                          "(the BACKEND of the TASKS alias its @task names)")
    return found


def _runner(task: Any) -> Callable[[dict[str, Any], TaskContext], dict[str, Any]]:
    def run_django_task(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
        return run(task, payload, ctx)

    return run_django_task


def run(task: Any, payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """One attempt of a Django task: its result object, or ``TaskFailure`` with the error."""
    from django.db import close_old_connections
    from django.utils import timezone

    from jobmesh.contrib.django import (RETURN_VALUE, failure_text, framework, make_result, send_signal,
                                        task_arguments, task_error)

    arguments = task_arguments(payload)
    if arguments is None:
        raise TaskFailure("the payload of a Django task is {\"args\": [...], \"kwargs\": {...}}")
    args, kwargs = arguments
    started = timezone.now()
    # One worker id per attempt so far (the context's ``attempt`` counts them): the earlier
    # attempts' workers are not known here, this one's stands for them.
    result = make_result(task, ctx.job_id, "RUNNING", args, kwargs, task.backend, started_at=started,
                         last_attempted_at=started, worker_ids=[os.environ.get(WORKER_ENV, "")] * ctx.attempt)
    backend = task.get_backend()
    send_signal("task_started", backend, result)
    close_old_connections()
    try:
        if task.takes_context:
            value = task.call(framework.TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        json.dumps(value, allow_nan=False)  # a return value that is not JSON fails here, with its traceback
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        log.warning("task %s raised job=%s attempt=%d", task.module_path, ctx.job_id, ctx.attempt, exc_info=True)
        text = failure_text(exc, MAX_ERROR_CHARS)
        object.__setattr__(result, "status", framework.TaskResultStatus.FAILED)
        object.__setattr__(result, "finished_at", timezone.now())
        result.errors.append(task_error(text))
        send_signal("task_finished", backend, result)
        raise TaskFailure(text) from None
    finally:
        close_old_connections()
    object.__setattr__(result, "status", framework.TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", timezone.now())
    object.__setattr__(result, "_return_value", value)
    send_signal("task_finished", backend, result)
    return {RETURN_VALUE: value}


if os.environ.get(WORKER_ENV):  # a task process of a --django worker: what importing this module is for
    load_project()
