"""User task types: the ``task`` decorator, its registry, the module loader, and one call.

::

    # mytasks.py
    from jobmesh.worker import task

    @task("GREET")
    def greet(payload):                 # or greet(payload, ctx)
        return {"greeting": "hello " + payload["name"]}

    @task("RESIZE", timeout=30, max_attempts=5, retry_backoff=(2, 60))
    def resize(payload): ...

    resize.s(image="a.png")             # a step of a workflow (jobmesh.canvas)

The options are the type's defaults for its jobs (``declared_defaults``): the worker
sends them in WORKER_REGISTER ``taskDefaults`` and the coordinator keeps them, applying
them to the jobs of the type whose submit did not say otherwise.

This module is stdlib-only (plus ``jobmesh.errors``, ``jobmesh.protocol.payloads`` and
``jobmesh.canvas``, which import nothing else): the task child process (``jobmesh.worker.child``) imports it
in a clean, unpatched interpreter, and importing gevent there would defeat the point
(docs/ARCHITECTURE.md, "User tasks: unpatched child processes").

The registry is process-wide, like the modules that fill it: ``load_modules`` imports
modules, whose ``@task`` lines register their functions, and returns the whole
registry. Registering a second function under a taken name raises
``TaskDefinitionError``; so do invalid names, built-in names and functions that take
neither ``(payload)`` nor ``(payload, ctx)``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import logging
import numbers
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, ParamSpec, Protocol, TypeVar, cast

from jobmesh.canvas import Step, signature
from jobmesh.errors import ConfigError, JobmeshError
from jobmesh.protocol.payloads import (
    MAX_PROGRESS_MESSAGE_CHARS,
    TASK_NAME_RULE,
    TASK_TYPES,
    is_task_type_name,
    progress_problem,
    task_defaults_problem,
)

log = logging.getLogger(__name__)

# Longer error texts are cut: a traceback-sized message has no place in a job snapshot.
MAX_ERROR_CHARS = 2000

TaskFunction = Callable[..., Any]
P = ParamSpec("P")
R = TypeVar("R", covariant=True)


class Task(Protocol, Generic[P, R]):
    """What ``@task`` makes of a function, as a type checker sees it: the function itself
    (called as before) that also has ``.s(...)``, a workflow step of its type."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def s(self, payload: dict[str, Any] | None = None, **fields: Any) -> Step: ...
# Where ``ctx.progress`` reports go: (attempt id, fraction, message); the task process
# coalesces them (``jobmesh.worker.child``).
ProgressSink = Callable[[str, float, "str | None"], None]


class TaskDefinitionError(JobmeshError, ValueError):
    """A ``@task`` that cannot be registered: bad or built-in name, taken name, wrong signature."""


class TaskFailure(JobmeshError):
    """Raised by a task function to fail its attempt with exactly this error text (cut to
    ``MAX_ERROR_CHARS``), which is all the function's part: nothing more is logged."""


@dataclass
class TaskContext:
    """What a two-parameter task function gets besides its payload.

    ``cancelled`` is set when the attempt is cancelled or its lease revoked; a long
    function should poll ``ctx.cancelled.is_set()`` or wait on it and return early.
    ``progress(fraction, message=None)`` says how far it is. ``parents``: for a workflow's
    job, its direct dependencies' results by their refs (``{}`` for any other job).
    """

    job_id: str
    attempt: int
    attempt_id: str
    cancelled: threading.Event = field(default_factory=threading.Event)
    sink: ProgressSink | None = field(default=None, repr=False, compare=False)
    parents: dict[str, Any] = field(default_factory=dict)
    _dropped: bool = field(default=False, repr=False, compare=False)  # a report out of bounds was logged

    def progress(self, fraction: float, message: str | None = None) -> None:
        """Report how far the attempt is: ``fraction`` from 0 to 1, and a ``message`` (cut
        to 1,000 characters). The job's snapshot shows the latest report while it runs.

        Cheap enough for a tight loop: reports are coalesced, the latest one sent at most
        a few times a second; from any thread of the task. A fraction outside 0..1 (or
        NaN) is not sent, as the coordinator would drop it; the first such report of an
        attempt is logged, and the task goes on. ``TypeError`` for a fraction that is not
        a number or a message that is neither a string nor None."""
        if isinstance(fraction, numbers.Real) and not isinstance(fraction, bool):
            fraction = float(fraction)  # numpy's numbers too
        if isinstance(message, str) and len(message) > MAX_PROGRESS_MESSAGE_CHARS:
            message = message[:MAX_PROGRESS_MESSAGE_CHARS]
        problem = progress_problem(fraction, message)
        if problem is None:
            if self.sink is not None:
                self.sink(self.attempt_id, fraction, message)
        elif not isinstance(fraction, float) or not (message is None or isinstance(message, str)):
            raise TypeError(problem)
        elif not self._dropped:
            self._dropped = True
            log.warning("progress not sent job=%s attempt=%d: %s (the attempt's later ones are not logged)",
                        self.job_id, self.attempt, problem)


_registry: dict[str, TaskFunction] = {}
_wants_context: dict[str, bool] = {}
_defaults: dict[str, dict[str, int | None]] = {}  # name -> its taskDefaults entry


def task(name: str, timeout: float | None = None, max_attempts: int | None = None,
         retry_backoff: tuple[float, float] | None = None) -> Callable[[Callable[P, R]], Task[P, R]]:
    """Register the decorated function as the body of task type ``name``; returns it unchanged.

    The options are the defaults of the type's jobs: ``timeout`` each attempt's deadline in
    seconds (a millisecond to 7 days), ``max_attempts`` the attempt budget, and
    ``retry_backoff`` ``(base, cap)`` in seconds: the wait before attempt n+1 is
    base * 2^(n-1), at most cap. None leaves the coordinator's setting.

    The function gains ``.s(payload=None, **fields)``, a workflow step of the type
    (``jobmesh.canvas.signature``): ``chord(group(resize.s(image=i) for i in images), album.s())``."""
    if not is_task_type_name(name):
        raise TaskDefinitionError("task name %r is invalid: task-type names are %s" % (name, TASK_NAME_RULE))
    if name in TASK_TYPES:
        raise TaskDefinitionError("task name %r is a built-in task type (%s)" % (name, ", ".join(TASK_TYPES)))
    defaults = _task_defaults(name, timeout, max_attempts, retry_backoff)

    def register(fn: Callable[P, R]) -> Task[P, R]:
        wants_context = _check_signature(name, fn)
        old = _registry.get(name)
        if old is not None and old is not fn and _origin(old) != _origin(fn):
            raise TaskDefinitionError("task %r is defined twice: by %s and by %s" % (name, _origin(old), _origin(fn)))
        # The same function defined again (a module reloaded) simply replaces itself.
        _registry[name] = fn
        _wants_context[name] = wants_context
        _defaults[name] = defaults
        try:
            setattr(fn, "s", functools.partial(signature, name))
        except (AttributeError, TypeError):  # a callable that takes no attributes: no .s, still a task
            pass
        return cast("Task[P, R]", fn)

    return register


def _millis(name: str, option: str, seconds: Any) -> int | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds != seconds:
        raise TaskDefinitionError("@task(%r): %s must be a number of seconds, got %r" % (name, option, seconds))
    try:
        return int(round(seconds * 1000))
    except OverflowError:
        raise TaskDefinitionError("@task(%r): %s is out of range: %r" % (name, option, seconds)) from None


def _task_defaults(name: str, timeout: Any, max_attempts: Any, retry_backoff: Any) -> dict[str, int | None]:
    """The ``taskDefaults`` entry of ``@task``'s options; ``TaskDefinitionError`` if one is
    out of the coordinator's bounds."""
    base = cap = None
    if retry_backoff is not None:
        if not isinstance(retry_backoff, (tuple, list)) or len(retry_backoff) != 2:
            raise TaskDefinitionError("@task(%r): retry_backoff must be (base_seconds, cap_seconds), got %r"
                                      % (name, retry_backoff))
        base, cap = (_millis(name, "retry_backoff", value) for value in retry_backoff)
    defaults = {"timeoutMillis": _millis(name, "timeout", timeout), "maxAttempts": max_attempts,
                "retryBaseMillis": base, "retryCapMillis": cap}
    problem = task_defaults_problem(name, defaults)
    if problem is not None:
        raise TaskDefinitionError("@task(%r) options: %s (timeout=%r, max_attempts=%r, retry_backoff=%r)"
                                  % (name, problem, timeout, max_attempts, retry_backoff))
    return defaults


def declared_defaults(names: Iterable[str]) -> dict[str, dict[str, int | None]]:
    """WORKER_REGISTER ``taskDefaults`` of these registered task types: each one whose
    ``@task`` has options, those it left out as null (the coordinator keeps the latest
    entry of a type as a whole). A type without options has no entry: what the
    coordinator keeps for it stays, and the registration is the one it always was."""
    return {name: dict(_defaults[name]) for name in sorted(names)
            if any(value is not None for value in _defaults.get(name, {}).values())}


def _origin(fn: TaskFunction) -> str:
    return "%s.%s" % (getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", repr(fn)))


def _check_signature(name: str, fn: TaskFunction) -> bool:
    """Whether ``fn`` takes the context too; TaskDefinitionError if it takes neither form."""
    if not callable(fn):
        raise TaskDefinitionError("@task(%r) must decorate a function, not %s" % (name, type(fn).__name__))
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TaskDefinitionError("@task(%r): %s is async; task functions are plain functions" % (name, _origin(fn)))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False  # a builtin without a signature: call it with the payload only
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if required_kw or len(required) > 2 or (not positional and not varargs):
        raise TaskDefinitionError("@task(%r): %s must take (payload) or (payload, ctx)" % (name, _origin(fn)))
    return varargs or len(positional) >= 2


def registered() -> dict[str, TaskFunction]:
    """A copy of the registry: task-type name -> function."""
    return dict(_registry)


def unregister(names: Iterable[str]) -> None:
    """Forget these names (tests use it to leave the process-wide registry as they found it)."""
    for name in names:
        _registry.pop(name, None)
        _wants_context.pop(name, None)
        _defaults.pop(name, None)


def load_modules(modules: Iterable[str]) -> dict[str, TaskFunction]:
    """Import each module (from the current directory or PYTHONPATH) and return the registry.

    Raises ``ConfigError`` with a one-line message if a module cannot be imported, its
    ``@task`` lines are invalid or it registers no task at all (``--tasks=os``), so
    ``jobmesh worker`` can exit 2 without a traceback.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    for module in modules:
        before = set(_registry)
        try:
            importlib.import_module(module)
        except TaskDefinitionError as exc:
            raise ConfigError("--tasks: module %r: %s" % (module, exc)) from None
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                raise ConfigError("--tasks: no module named %r (looked in the current directory "
                                  "and PYTHONPATH)" % module) from None
            raise ConfigError("--tasks: module %r failed to import: %s" % (module, _one_line(exc))) from None
        except BaseException as exc:  # a SystemExit or syntax error in user code is still one line
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ConfigError("--tasks: module %r failed to import: %s" % (module, _one_line(exc))) from None
        if set(_registry) == before and not _defines_tasks(module):
            raise ConfigError("--tasks: module %r defines no tasks: a task module registers at least one function "
                              "with @task(\"NAME\") (from jobmesh.worker import task)" % module)
    return registered()


def _defines_tasks(module: str) -> bool:
    """Whether a function of ``module`` (or of a module below it) is registered, for a
    module imported before, whose ``@task`` lines ran then."""
    return any(fn_module == module or fn_module.startswith(module + ".")
               for fn_module in (getattr(fn, "__module__", None) or "" for fn in _registry.values()))


def _one_line(exc: BaseException) -> str:
    text = describe(exc)
    if isinstance(exc, SyntaxError) and exc.filename:
        text = "%s (%s, line %s)" % (text, exc.filename, exc.lineno)
    return " ".join(text.split())


def describe(exc: BaseException) -> str:
    """``"ValueError: bad name"``: the exception's class and message, as a failed attempt reports it."""
    message = str(exc.msg if isinstance(exc, SyntaxError) else exc)
    text = "%s: %s" % (type(exc).__name__, message) if message else type(exc).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def run_task(name: str, payload: dict[str, Any], ctx: TaskContext) -> tuple[bool, Any, str | None]:
    """Call task ``name``'s function; ``(success, result, error)`` for TASK_RESULT.

    Never raises for anything the function does: an exception (even ``SystemExit``)
    becomes a failure naming it; so does a result that is not a JSON object.
    """
    fn = _registry.get(name)
    if fn is None:
        return False, None, "unknown task type %r: no function registered for it" % name
    try:
        result = fn(payload, ctx) if _wants_context.get(name) else fn(payload)
    except KeyboardInterrupt:
        raise
    except TaskFailure as exc:
        return False, None, str(exc)[:MAX_ERROR_CHARS]
    except BaseException as exc:
        # The traceback goes to the process's stderr, where the user's own output goes too.
        log.warning("task %s raised job=%s attempt=%d", name, ctx.job_id, ctx.attempt, exc_info=True)
        return False, None, describe(exc)
    if not isinstance(result, dict):
        return False, None, "task %r returned %s, not a dict (a JSON object)" % (name, type(result).__name__)
    try:
        # Strict JSON: no NaN/Infinity, no objects the encoder does not know.
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        return False, None, "task %r returned a result that is not JSON: %s" % (name, describe(exc))
    return True, result, None
