"""The ``task`` decorator, its registry, the module loader and one call (``run_task``), in-process.

The registry is process-wide; the ``names`` fixture forgets what a test registered, and
``modules`` removes the test's throwaway modules (written to ``tmp_path``) and its
``sys.path`` entry again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from jobmesh.config import parse_task_modules
from jobmesh.errors import ConfigError
from jobmesh.protocol.payloads import TASK_TYPES
from jobmesh.worker import TaskContext, TaskDefinitionError, load_modules, task
from jobmesh.worker.usertasks import declared_defaults, registered, run_task, unregister


@pytest.fixture
def names():
    """Unique task names for this test, unregistered afterwards."""
    made: list[str] = []

    def make(base="T"):
        made.append("%s-%s" % (base, uuid.uuid4().hex[:8]))
        return made[-1]

    yield make
    unregister(made)


@pytest.fixture
def modules(tmp_path):
    """``modules.write(source) -> module name``: importable while the test runs."""

    class Modules:
        def __init__(self):
            self.made: list[str] = []

        def write(self, source: str) -> str:
            name = "jm_test_%s" % uuid.uuid4().hex[:10]
            (tmp_path / (name + ".py")).write_text(source)
            self.made.append(name)
            return name

    before = set(registered())
    sys.path.insert(0, str(tmp_path))
    m = Modules()
    yield m
    sys.path.remove(str(tmp_path))
    for name in m.made:
        sys.modules.pop(name, None)
    unregister(set(registered()) - before)


def ctx(attempt=1):
    return TaskContext("j-1", attempt, "a-%d" % attempt)


# ---- the decorator ------------------------------------------------------------------

def test_task_registers_the_function_and_returns_it_unchanged(names):
    name = names()

    @task(name)
    def greet(payload):
        return {"greeting": "hello " + payload["name"]}

    assert registered()[name] is greet
    assert greet({"name": "ada"}) == {"greeting": "hello ada"}
    assert run_task(name, {"name": "ada"}, ctx()) == (True, {"greeting": "hello ada"}, None)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "naïve", "a/b", "a,b", None, 5])
def test_invalid_names_are_refused(bad):
    with pytest.raises(TaskDefinitionError, match="letters, digits"):
        task(bad)


@pytest.mark.parametrize("good", ["a", "my.task:v1-2_X", "x" * 128])
def test_names_the_rule_allows(good):
    task(good)(lambda payload: {})
    try:
        assert good in registered()
    finally:
        unregister([good])


@pytest.mark.parametrize("builtin", TASK_TYPES)
def test_builtin_names_are_refused(builtin):
    with pytest.raises(TaskDefinitionError, match="built-in"):
        task(builtin)


def test_two_functions_for_one_name_are_refused(names):
    name = names()

    @task(name)
    def first(payload):
        return {}

    with pytest.raises(TaskDefinitionError, match="defined twice.*first.*second"):
        @task(name)
        def second(payload):
            return {}

    assert registered()[name] is first


def test_signatures(names):
    def one(payload):
        return {"ctx": False}

    def two(payload, ctx):
        return {"ctx": ctx.attempt}

    def default_ctx(payload, ctx=None):
        return {"ctx": ctx is not None}

    def star(*args):
        return {"ctx": len(args)}

    calls = {one: {"ctx": False}, two: {"ctx": 2}, default_ctx: {"ctx": True}, star: {"ctx": 2}}
    for fn, expected in calls.items():
        name = names()
        task(name)(fn)
        assert run_task(name, {}, ctx(attempt=2)) == (True, expected, None), fn.__name__


@pytest.mark.parametrize("source", [
    "def f(): return {}",
    "def f(a, b, c): return {}",
    "def f(payload, *, key): return {}",
    "async def f(payload): return {}",
])
def test_signatures_that_are_neither_form_are_refused(names, source):
    scope: dict = {}
    exec(source, scope)
    with pytest.raises(TaskDefinitionError, match="f"):
        task(names())(scope["f"])


# ---- one call -------------------------------------------------------------------------

def test_run_task_reports_what_the_function_did(names):
    outcomes = {
        "raises": (lambda p: (_ for _ in ()).throw(ValueError("bad name")), "ValueError: bad name"),
        "exits": (lambda p: sys.exit(3), "SystemExit: 3"),
        "bare": (lambda p: (_ for _ in ()).throw(KeyError()), "KeyError"),
        "list": (lambda p: [1], "returned list, not a dict"),
        "none": (lambda p: None, "returned NoneType, not a dict"),
        "set": (lambda p: {"s": {1}}, "not JSON: TypeError"),
        "nan": (lambda p: {"x": float("nan")}, "not JSON: ValueError"),
    }
    for label, (fn, error) in outcomes.items():
        name = names(label)
        task(name)(fn)
        success, result, message = run_task(name, {}, ctx())
        assert (success, result) == (False, None), label
        assert error in message, (label, message)
    assert run_task("NO-SUCH-" + uuid.uuid4().hex, {}, ctx())[2].startswith("unknown task type")


def test_context_fields_and_the_cancelled_event(names):
    seen = {}
    name = names()

    @task(name)
    def look(payload, ctx):
        seen.update(job=ctx.job_id, attempt=ctx.attempt, attempt_id=ctx.attempt_id,
                    cancelled=ctx.cancelled.is_set(), waited=ctx.cancelled.wait(0.01))
        return {}

    c = TaskContext("j-9", 3, "a-9")
    c.cancelled.set()
    assert run_task(name, {}, c)[0] is True
    assert seen == {"job": "j-9", "attempt": 3, "attempt_id": "a-9", "cancelled": True, "waited": True}


# ---- the loader -----------------------------------------------------------------------

def test_load_modules_imports_and_returns_name_to_function(modules, names):
    a, b = names("A"), names("B")
    first = modules.write("from jobmesh.worker import task\n@task(%r)\ndef fa(payload):\n    return {'a': 1}\n" % a)
    second = modules.write("from jobmesh.worker import task\n@task(%r)\ndef fb(payload, ctx):\n    return {}\n" % b)
    loaded = load_modules([first, second])
    assert loaded[a].__name__ == "fa" and loaded[b].__name__ == "fb"
    assert sys.modules[first] is not None


@pytest.mark.parametrize("source, message", [
    (None, "no module named 'jm_test_"),
    ("import jm_no_such_dependency\n", "failed to import: ModuleNotFoundError: No module named 'jm_no_such_dependency'"),
    ("def broken(:\n", "failed to import: SyntaxError: "),
    ("raise RuntimeError('no config file')\n", "failed to import: RuntimeError: no config file"),
    ("from jobmesh.worker import task\n@task('bad name')\ndef f(p):\n    return {}\n", "task name 'bad name' is invalid"),
    ("from jobmesh.worker import task\n@task('SLEEP')\ndef f(p):\n    return {}\n", "built-in"),
])
def test_load_errors_are_one_line_config_errors(modules, source, message):
    name = modules.write(source) if source is not None else "jm_test_missing_%s" % uuid.uuid4().hex[:6]
    with pytest.raises(ConfigError) as info:
        load_modules([name])
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert text.startswith("--tasks: ")


def test_a_module_that_registers_no_task_is_a_config_error(modules, names):
    with pytest.raises(ConfigError, match=r"^--tasks: module 'os' defines no tasks: a task module registers at "):
        load_modules(["os"])
    empty = modules.write("X = 1\n")
    with pytest.raises(ConfigError, match="module %r defines no tasks" % empty):
        load_modules([empty])
    # A tasks module imported before (its @task lines ran then) still counts
    name = names("AGAIN")
    again = modules.write("from jobmesh.worker import task\n@task(%r)\ndef f(payload):\n    return {}\n" % name)
    assert name in load_modules([again]) and name in load_modules([again])


def test_one_name_in_two_modules_is_a_config_error_naming_both(modules, names):
    name = names("DUP")
    body = "from jobmesh.worker import task\n@task(%r)\ndef %s(payload):\n    return {}\n"
    first = modules.write(body % (name, "one"))
    second = modules.write(body % (name, "two"))
    with pytest.raises(ConfigError, match="defined twice: by %s.one and by %s.two" % (first, second)):
        load_modules([first, second])


def test_the_worker_package_imports_no_gevent():
    # The task child imports this chain in a clean interpreter; gevent there would defeat the point.
    code = ("import sys, jobmesh.worker, jobmesh.worker.child; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'gevent')))")
    proc = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


# ---- --tasks --------------------------------------------------------------------------

def test_parse_task_modules():
    assert parse_task_modules(None) == ()
    assert parse_task_modules("mytasks") == ("mytasks",)
    assert parse_task_modules(" a , pkg.b,a") == ("a", "pkg.b")
    for bad in ("", "a,,b", "my-tasks", "a.", "1abc", "a b"):
        with pytest.raises(ConfigError, match="--tasks must be MODULE"):
            parse_task_modules(bad)


def test_worker_and_up_take_the_tasks_flag():
    from jobmesh.cli import parse
    from jobmesh.config import worker_config

    assert worker_config(parse(["worker"])[1]).task_modules == ()
    assert worker_config(parse(["worker", "--tasks=mytasks,pkg.more"])[1]).task_modules == ("mytasks", "pkg.more")
    assert parse(["up", "--tasks=mytasks", "--workers=1"])[1]["--tasks"] == "mytasks"


def test_ctx_progress_checks_its_arguments_and_hands_each_report_to_the_sink(caplog):
    from fractions import Fraction

    reports: list = []
    c = TaskContext("j-1", 1, "j-1.1", sink=lambda *report: reports.append(report))
    c.progress(0)
    c.progress(Fraction(1, 4), "a quarter")  # any real number
    c.progress(1, "x" * 1500)  # a long message is cut to 1,000 characters
    assert reports == [("j-1.1", 0.0, None), ("j-1.1", 0.25, "a quarter"), ("j-1.1", 1.0, "x" * 1000)]
    # A fraction outside 0..1 is not sent, and logged once: the task goes on
    for fraction in (1.0000000000000002, -0.5, float("nan"), float("inf")):
        c.progress(fraction, "out of bounds")
    assert len(reports) == 3
    logged = [r.getMessage() for r in caplog.records if "progress not sent" in r.getMessage()]
    assert logged == ["progress not sent job=j-1 attempt=1: the progress fraction must be from 0 to 1, got "
                      "1.0000000000000002 (the attempt's later ones are not logged)"], logged
    # A value of the wrong type is a bug in the task: TypeError
    for fraction, message in ((True, None), ("0.5", None), (None, None), (0.5, 7), (0.5, b"bytes")):
        with pytest.raises(TypeError):
            c.progress(fraction, message)
    assert len(reports) == 3
    TaskContext("j-2", 1, "j-2.1").progress(0.5, "no sink: nothing to send it to")


# ---- options: the type's defaults for its jobs ----------------------------------------------


def test_task_options_become_the_types_task_defaults_in_milliseconds(names):
    full, bare = names("FULL"), names("BARE")
    task(full, timeout=2.5, max_attempts=4, retry_backoff=(0.25, 60))(lambda payload: {})
    task(bare)(lambda payload: {})
    part = names("PART")
    task(part, max_attempts=2)(lambda payload: {})
    # Each registered type with options is declared, the options it left out as null; one without has no entry
    assert declared_defaults([full, bare, part, "NOT_REGISTERED"]) == {
        full: {"timeoutMillis": 2500, "maxAttempts": 4, "retryBaseMillis": 250, "retryCapMillis": 60_000},
        part: {"timeoutMillis": None, "maxAttempts": 2, "retryBaseMillis": None, "retryCapMillis": None},
    }
    # The bounds themselves are allowed: a millisecond and 7 days, a backoff of nothing to ten years
    task(full, timeout=0.001, max_attempts=1_000_000, retry_backoff=(0, 315_360_000))(lambda payload: {})
    task(full, timeout=7 * 86400, retry_backoff=(1, 1))(lambda payload: {})


@pytest.mark.parametrize("options, words", [
    ({"timeout": 0}, "timeoutMillis must be an integer 1..604800000"),
    ({"timeout": 0.0004}, "timeoutMillis must be an integer 1..604800000"),
    ({"timeout": 7 * 86400 + 1}, "timeoutMillis must be an integer 1..604800000"),
    ({"timeout": "30"}, "timeout must be a number of seconds"),
    ({"timeout": float("nan")}, "timeout must be a number of seconds"),
    ({"timeout": float("inf")}, "timeout is out of range"),
    ({"max_attempts": 0}, "maxAttempts must be an integer 1..1000000"),
    ({"max_attempts": 2.0}, "maxAttempts must be an integer"),
    ({"max_attempts": True}, "maxAttempts must be an integer"),
    ({"retry_backoff": 5}, "retry_backoff must be (base_seconds, cap_seconds)"),
    ({"retry_backoff": (1, 2, 3)}, "retry_backoff must be (base_seconds, cap_seconds)"),
    ({"retry_backoff": (-1, 2)}, "retryBaseMillis must be an integer 0..315360000000"),
    ({"retry_backoff": (5, 1)}, "retryBaseMillis 5000 is above retryCapMillis 1000"),
    ({"retry_backoff": (1, 315_360_001)}, "retryCapMillis must be an integer 0..315360000000"),
])
def test_task_options_out_of_bounds_are_refused_when_the_module_loads(names, options, words):
    with pytest.raises(TaskDefinitionError, match="^@task") as refused:
        task(names(), **options)
    assert words in str(refused.value), refused.value


def test_a_module_with_bad_options_is_a_one_line_config_error(modules):
    name = modules.write("from jobmesh.worker import task\n\n@task('OPTS', max_attempts=0)\ndef f(payload):\n"
                         "    return {}\n")
    with pytest.raises(ConfigError, match="maxAttempts must be an integer 1..1000000") as refused:
        load_modules([name])
    assert "\n" not in str(refused.value)
