"""Django's tasks on jobmesh: ``JobmeshBackend`` in a real Django project made here, and a
real ``jobmesh worker --django=SETTINGS`` running the project's task functions.

The project (``jmdj_site`` settings, an app ``jmdj_app`` with a ``tasks`` module, an SQLite
database) is written to a temporary directory. The test process plays the web side: it
sets Django up itself (unpatched, as ``manage.py shell`` or a web server would) and
enqueues through ``django.tasks`` (Django 6) or the ``django_tasks`` backport. One
coordinator with tokens on and one worker (capacity 1, so one task process runs every
attempt) serve the whole module; the backend presents its ``token`` OPTION, the worker its
token file. Every test uses tasks of its own.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

try:
    import django
except ImportError:  # the dev extra brings it: a missing Django is a broken install, said loudly
    pytest.skip("Django is not installed: pip install -e '.[dev]' brings it (and django-tasks before "
                "Python 3.12); the Django backend is untested", allow_module_level=True)

from jobmesh import auth
from jobmesh.client.api import CoordinatorClient
from jobmesh.errors import RequestFailed
from tests.support.cli import run_cli
from tests.support.processes import CoordinatorProc, WorkerProc
from tests.support.waiting import wait_until

TASKS_MODULE = '''
import os

from django.db import connection

from {framework} import task


@task
def add(a, b):
    return a + b


@task
def greet(name, punctuation="!"):
    return {{"greeting": "hello " + name + punctuation}}


@task
def boom(message):
    raise LookupError(message)


@task(takes_context=True)
def whoami(context, tag):
    result = context.task_result
    return {{"id": result.id, "attempt": context.attempt, "tag": tag, "args": result.args,
            "workers": result.worker_ids, "status": str(result.status)}}


@task(takes_context=True)
def flaky(context):
    if context.attempt < 2:
        raise RuntimeError("attempt %d fails" % context.attempt)
    return context.attempt


@task
def db_state():
    open_at_start = connection.connection is not None
    with connection.cursor() as cursor:
        cursor.execute("SELECT 40 + 2")
        answer = cursor.fetchone()[0]
    return {{"openAtStart": open_at_start, "answer": answer, "pid": os.getpid()}}


@task
async def double(x):
    return 2 * x


@task
def not_json():
    return {{1, 2}}
'''

SETTINGS_MODULE = '''
SECRET_KEY = "not a secret: a test project"
USE_TZ = True
INSTALLED_APPS = {apps!r}
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": {db!r}}}}}
TASKS = {{"default": {{"BACKEND": "jobmesh.contrib.django.JobmeshBackend",
                      "OPTIONS": {{"coordinator": {coordinator!r}, "token": {token!r}}}}}}}
'''


def framework() -> str:
    """The task framework this Django has: its own (Django 6) or the backport."""
    try:
        importlib.import_module("django.tasks")
        return "django.tasks"
    except ImportError:
        return "django_tasks"


def write_project(root: Path, coordinator: str, token: str) -> None:
    (root / "jmdj_site").mkdir()
    (root / "jmdj_site" / "__init__.py").write_text("")
    apps = ["jmdj_app"] + (["django_tasks"] if framework() == "django_tasks" else [])
    (root / "jmdj_site" / "settings.py").write_text(SETTINGS_MODULE.format(
        apps=apps, db=str(root / "db.sqlite3"), coordinator=coordinator, token=token))
    (root / "jmdj_app").mkdir()
    (root / "jmdj_app" / "__init__.py").write_text("")
    (root / "jmdj_app" / "tasks.py").write_text(textwrap.dedent(TASKS_MODULE.format(framework=framework())))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """The module's coordinator with an auth file; ``.tokens`` by name: ``django-web``
    (client, the backend's), ``django-worker`` (worker) and ``tests`` (admin)."""
    directory = tmp_path_factory.mktemp("django-coord")
    auth_file = directory / "auth.toml"
    tokens = {name: auth.new_token(str(auth_file), name, role)
              for name, role in (("django-web", "client"), ("django-worker", "worker"), ("tests", "admin"))}
    proc = CoordinatorProc(directory, auth_file=auth_file).start()
    proc.tokens = tokens
    yield proc
    proc.cleanup()


@pytest.fixture(scope="module")
def project(coordinator, tmp_path_factory):
    """The project, its worker, and the Django side set up in this process: the app's tasks module."""
    root = tmp_path_factory.mktemp("django-project")
    write_project(root, coordinator.client_target, coordinator.tokens["django-web"])
    token_file = root / "worker.token"
    token_file.write_text(coordinator.tokens["django-worker"])
    token_file.chmod(0o600)
    worker = WorkerProc(root, coordinator.worker_target, worker_id="django-w", capacity=1, cwd=root,
                        extra=("--django=jmdj_site.settings", "--token-file=%s" % token_file)).start()
    sys.path.insert(0, str(root))
    os.environ["DJANGO_SETTINGS_MODULE"] = "jmdj_site.settings"
    try:
        django.setup()
        tasks = importlib.import_module("jmdj_app.tasks")
        with CoordinatorClient(coordinator.client_target, token=coordinator.tokens["tests"]) as client:
            wait_until(lambda: any("jmdj_app.tasks.add" in w["taskTypes"] for w in client.workers()), timeout=30,
                       message="the --django worker declaring the project's tasks (log: %s)" % worker.err_path)
        yield tasks
    finally:
        worker.cleanup()
        sys.path.remove(str(root))
        os.environ.pop("DJANGO_SETTINGS_MODULE", None)


@pytest.fixture(scope="module")
def client(coordinator):
    with CoordinatorClient(coordinator.client_target, token=coordinator.tokens["tests"]) as c:
        yield c


def millis(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1)


def finished(client, task, result):
    """The result once its job has ended (WAIT_JOB), read again through the backend."""
    client.wait(result.id, timeout=30)
    return task.get_result(result.id)


def test_enqueue_runs_the_function_in_the_worker_and_get_result_reads_the_job(project, client):
    result = project.add.enqueue(2, 40)
    assert result.status == "READY" and result.args == [2, 40] and result.kwargs == {}
    job = client.status(result.id)  # the result id is the jobId, the type the task's module path
    assert job["taskType"] == "jmdj_app.tasks.add" and job["priority"] == "NORMAL"
    assert job["submittedBy"] == "django-web"  # the backend presented its OPTIONS token
    done = finished(client, project.add, result)  # read by id: the job's payload gives the arguments
    assert done.status == "SUCCESSFUL" and done.is_finished
    assert done.args == [2, 40] and done.kwargs == {}
    assert done.return_value == 42
    assert done.errors == [] and done.worker_ids == ["django-w"]
    assert done.enqueued_at <= done.started_at <= done.finished_at and done.started_at.tzinfo is not None
    result.refresh()
    assert result.status == "SUCCESSFUL" and result.return_value == 42 and result.args == [2, 40]
    greeting = finished(client, project.greet, project.greet.enqueue("Ada", punctuation="?"))
    assert greeting.return_value == {"greeting": "hello Ada?"}
    assert greeting.args == ["Ada"] and greeting.kwargs == {"punctuation": "?"}


def test_an_exception_fails_the_attempts_with_its_class_and_traceback(project, client):
    result = finished(client, project.boom, project.boom.enqueue("no such thing"))
    job = client.status(result.id)
    assert job["state"] == "FAILED" and job["attempts"] == job["maxAttempts"] >= 2
    assert result.status == "FAILED"
    assert len(result.errors) == job["attempts"] and len(result.worker_ids) == job["attempts"]
    error = result.errors[-1]
    assert error.exception_class is LookupError
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert "in boom" in error.traceback and "LookupError: no such thing" in error.traceback
    assert job["error"].startswith("builtins.LookupError: no such thing\nTraceback")
    with pytest.raises(ValueError):
        result.return_value
    # A return value that is not JSON fails the same way, with its own traceback.
    bad = finished(client, project.not_json, project.not_json.enqueue())
    assert bad.status == "FAILED" and bad.errors[-1].exception_class is TypeError


def test_takes_context_gets_the_job_and_the_attempt(project, client):
    result = finished(client, project.whoami, project.whoami.enqueue("t1"))
    assert result.return_value == {"id": result.id, "attempt": 1, "tag": "t1", "args": ["t1"],
                                   "workers": ["django-w"], "status": "RUNNING"}
    retried = finished(client, project.flaky, project.flaky.enqueue())
    assert retried.status == "SUCCESSFUL" and retried.return_value == 2
    assert len(retried.errors) == 1 and retried.errors[0].exception_class is RuntimeError
    assert "attempt 1 fails" in retried.errors[0].traceback


def test_database_connections_are_closed_around_each_task(project, client):
    """Django's close_old_connections before and after each task: with CONN_MAX_AGE 0 a task
    never finds the connection the last one opened in the same task process."""
    first = finished(client, project.db_state, project.db_state.enqueue()).return_value
    second = finished(client, project.db_state, project.db_state.enqueue()).return_value
    assert first["answer"] == second["answer"] == 42
    assert first["pid"] == second["pid"]  # the same task process ran both
    assert first["openAtStart"] is False and second["openAtStart"] is False
    # ... and, idle now, it holds no connection: the database file is not open in it.
    fds = Path("/proc/%d/fd" % second["pid"])
    database = str(Path(project.__file__).parents[1] / "db.sqlite3")
    assert [f for f in fds.iterdir() if os.readlink(f).startswith(database)] == []


def test_priority_maps_to_the_nearest_jobmesh_priority(project, client):
    from jobmesh.contrib.django import jobmesh_priority

    expected = {100: "HIGH", 51: "HIGH", 50: "NORMAL", 0: "NORMAL", -50: "NORMAL", -51: "LOW", -100: "LOW"}
    assert {p: jobmesh_priority(p).value for p in expected} == expected
    for priority, name in (100, "HIGH"), (-100, "LOW"), (70, "HIGH"):
        result = project.add.using(priority=priority).enqueue(priority, 1)
        assert client.status(result.id)["priority"] == name
        assert finished(client, project.add, result).return_value == priority + 1


def test_run_after_schedules_the_job(project, client):
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    result = project.add.using(run_after=later).enqueue(1, 1)
    job = client.status(result.id)
    assert job["state"] == "SCHEDULED" and job["runAtMillis"] == millis(later)
    assert project.add.get_result(result.id).status == "READY"
    client.cancel(result.id)
    cancelled = project.add.get_result(result.id)
    assert cancelled.status == "FAILED" and cancelled.errors[-1].exception_class.__name__ == "JobFailed"
    # Without USE_TZ, Django's times are naive, in the project's TIME_ZONE.
    from django.conf import settings
    from django.test.utils import override_settings

    with override_settings(USE_TZ=False):
        naive = datetime.now() + timedelta(hours=2)
        local = project.add.using(run_after=naive).enqueue(3, 3)
        expected = millis(naive.replace(tzinfo=ZoneInfo(settings.TIME_ZONE)))
        assert client.status(local.id)["runAtMillis"] == expected
        assert project.add.get_result(local.id).enqueued_at.tzinfo is None
        client.cancel(local.id)
    soon = datetime.now(timezone.utc) + timedelta(milliseconds=300)
    done = finished(client, project.add, project.add.using(run_after=soon).enqueue(2, 2))
    assert done.return_value == 4 and millis(done.started_at) >= millis(soon)


def test_aenqueue_and_aget_result_and_an_async_task(project, client):
    async def go():
        result = await project.double.aenqueue(21)
        await asyncio.to_thread(client.wait, result.id, 30)
        return await project.double.aget_result(result.id)

    result = asyncio.run(go())
    assert result.status == "SUCCESSFUL" and result.return_value == 42


def test_get_result_of_no_django_job_does_not_exist(project, client):
    from jobmesh.contrib.django import TaskResultDoesNotExist

    with pytest.raises(TaskResultDoesNotExist):
        project.add.get_result("0" * 32)
    other = client.submit("WORD_COUNT", {"text": "a b"})
    with pytest.raises(TaskResultDoesNotExist):
        project.add.get_result(other)
    # A job of a task's type whose payload is no task's arguments (submitted by hand, not
    # by enqueue) is not a Django task's result either
    odd = client.submit("jmdj_app.tasks.add", {"args": "2, 40"}, delay=3600)
    try:
        with pytest.raises(TaskResultDoesNotExist, match="no Django task's arguments"):
            project.add.get_result(odd)
    finally:
        client.cancel(odd)


def test_worker_with_a_settings_module_that_cannot_load_exits_2_in_one_line(project, coordinator, tmp_path):
    proc = run_cli("worker", "--coordinator=%s" % coordinator.worker_target, "--django=jmdj_nosuch.settings",
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "--django=jmdj_nosuch.settings" in proc.stderr and "jmdj_nosuch" in proc.stderr


def test_the_django_side_and_the_task_processes_import_no_gevent():
    # A Django process (web server, manage.py) and the task processes run unpatched: the
    # backend and the worker's Django module are plain Python on stdlib sockets.
    code = ("import json, sys, jobmesh.contrib.django, jobmesh.contrib.django_worker; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'gevent')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_the_backend_refuses_options_it_does_not_take(project):
    from django.core.exceptions import ImproperlyConfigured

    from jobmesh.contrib.django import JobmeshBackend

    with pytest.raises(ImproperlyConfigured, match="unknown OPTIONS cordinator"):
        JobmeshBackend("other", {"OPTIONS": {"cordinator": "127.0.0.1:7071"}})


def test_the_backend_presents_the_token_its_options_name(project, coordinator):
    from jobmesh.contrib.django import JobmeshBackend

    target = coordinator.client_target
    wrong = JobmeshBackend("wrong", {"OPTIONS": {"coordinator": target, "token": "not-a-token"}})
    with pytest.raises(RequestFailed, match="authentication failed"):
        wrong.enqueue(project.add, [1, 1], {})
    wrong.close()
    none = JobmeshBackend("none", {"OPTIONS": {"coordinator": target}})
    with pytest.raises(RequestFailed, match="authentication required"):
        none.enqueue(project.add, [1, 1], {})
    none.close()
