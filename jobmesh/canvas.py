"""Workflows as shapes: ``step``, ``chain``, ``group`` and ``chord``, compiled into the jobs
of one SUBMIT_WORKFLOW (docs/OPERATIONS.md, "Workflows").

::

    from jobmesh.canvas import chain, chord, group, step

    etl = chain(step("FETCH", {"url": url}), step("TRANSFORM"), step("LOAD", {"table": "t"}))
    album = chord(group(resize.s(image=i) for i in images), build_album.s())
    workflow_id, job_ids = client.submit_workflow(album, name="album")

A ``Step`` is one job: a task type, its payload and the options of ``client.submit``
(``priority``, ``max_attempts``, ``idempotency_key``, ``delay`` ...), and optionally the
``ref`` it has in the workflow. ``resize.s(image=i)`` is ``step("RESIZE", {"image": i})``
for a function decorated with ``@task("RESIZE")``.

How the shapes depend on each other: the members of a ``group`` run side by side, each
after whatever came before the group; each stage of a ``chain`` starts after every job
that ends the stage before it (the leaves of a group, the last job of a chain); a
``chord(group, callback)`` is the chain of the two. So a chain of groups makes every
member of a group depend on every leaf of the group before it, a group of chains runs
the chains side by side, and shapes nest as deep as one likes. An empty group lets the
next stage start after what came before it. ``a | b`` is ``chain(a, b)``.

A job with dependencies gets their results as ``ctx.parents``, by ref. Refs are the
user's (``ref=``) or made from the task type and a count, ``RESIZE.0``, ``RESIZE.1``...
in the order the steps appear: the same shape always gets the same refs.

``compile_jobs`` is pure: it returns each job's ref, step and dependencies; the client
(jobmesh/client/api.py) turns them into the wire's job objects with the same code as a
plain submit. A shape of more than ``MAX_WORKFLOW_JOBS`` jobs, a ref used twice and a
ref that breaks the naming rule are ``CanvasError`` before anything is sent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Union, cast

from jobmesh.errors import JobmeshError
from jobmesh.protocol.payloads import TASK_NAME_RULE, is_task_type_name

MAX_WORKFLOW_JOBS = 10_000  # jobs in one workflow, at most (the coordinator's bound too)
REF_RULE = TASK_NAME_RULE  # refs follow the task-type names' rule
MAX_REF_CHARS = 128
# The options of ``client.submit`` a step may carry (its keyword arguments but submit_retries, and
# result_ttl_millis: a workflow's jobs are kept and purged together).
STEP_OPTIONS = ("max_attempts", "priority", "idempotency_key", "delay", "run_at", "timeout_millis",
                "concurrency_key", "unique_key")
NOT_IN_WORKFLOWS = {"result_ttl_millis": "a workflow's jobs are kept and purged together"}


class CanvasError(JobmeshError, ValueError):
    """A shape that cannot be a workflow: too many jobs, a ref used twice or not a valid
    name, a member that is not a shape. Raised before anything is sent."""


class _Shape:
    """What the shapes have in common: ``a | b`` is ``chain(a, b)``."""

    def __or__(self, other: Node) -> Chain:
        return chain(cast(Node, self), other)


@dataclass(frozen=True)
class Step(_Shape):
    """One job of a workflow. Made by ``step(...)`` or a task function's ``.s(...)``."""

    task_type: str
    payload: dict[str, Any]
    ref: str | None = None
    options: tuple[tuple[str, Any], ...] = ()  # client.submit's keyword arguments, by name

    def set(self, **options: Any) -> Step:
        """A copy with ``ref`` and options (``client.submit``'s keywords) replaced."""
        ref = options.pop("ref", self.ref)
        _check_options(options)
        return dataclasses.replace(self, ref=ref, options=tuple(dict(self.options, **options).items()))

    def submit_options(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class Chain(_Shape):
    """Stages one after another: each starts once every job ending the one before has completed."""

    stages: tuple[Node, ...]


@dataclass(frozen=True)
class Group(_Shape):
    """Members side by side, each after whatever came before the group."""

    members: tuple[Node, ...]


Node = Union[Step, Chain, Group]
_NODES = (Step, Chain, Group)


def step(task_type: str, payload: dict[str, Any] | None = None, *, ref: str | None = None,
         max_attempts: int = 0, priority: Any = None, idempotency_key: str | None = None, delay: Any = None,
         run_at: Any = None, timeout_millis: int | None = None, concurrency_key: str | None = None,
         unique_key: str | None = None) -> Step:
    """One job: ``task_type`` with ``payload`` (default ``{}``), and ``client.submit``'s options
    (checked when the workflow is sent, as a submit checks them). ``ref``: its name in
    the workflow (default: ``TYPE.N``)."""
    options = {"max_attempts": max_attempts, "priority": priority, "idempotency_key": idempotency_key,
               "delay": delay, "run_at": run_at, "timeout_millis": timeout_millis,
               "concurrency_key": concurrency_key, "unique_key": unique_key}
    given = tuple((name, value) for name, value in options.items() if value is not None and value != 0)
    return Step(task_type, {} if payload is None else payload, ref, given)


def signature(task_type: str, payload: dict[str, Any] | None = None, **fields: Any) -> Step:
    """A task function's ``.s(payload=None, **fields)``: a step whose payload is ``payload``
    and the keyword ``fields`` (``resize.s(image="a.png")``). Options go through ``.set``."""
    if payload is not None and not isinstance(payload, dict):
        raise CanvasError("%s.s(): the payload is a dict (or keyword fields), got %s"
                          % (task_type, type(payload).__name__))
    return Step(task_type, dict(payload or {}, **fields))


def chain(*stages: Node | Iterable[Node]) -> Chain:
    """``chain(a, b, c)``: b after a, c after b. Also ``chain(generator)``."""
    return Chain(_members("chain", stages))


def group(*members: Node | Iterable[Node]) -> Group:
    """``group(a, b, ...)`` or ``group(x.s(i) for i in items)``: side by side."""
    return Group(_members("group", members))


def chord(header: Node | Iterable[Node], callback: Node) -> Chain:
    """``chord(group(...), callback)``: the callback after every member of the group, with
    their results in ``ctx.parents``. A header given as a list or generator is a group."""
    if not isinstance(header, _NODES):
        header = group(header)
    if not isinstance(callback, _NODES):
        raise CanvasError("chord's callback is a step or a shape, got %s" % type(callback).__name__)
    return Chain((header, callback))


def _members(what: str, given: tuple[Any, ...]) -> tuple[Node, ...]:
    """The shapes given, or those of the one iterable given (a list, a generator)."""
    if len(given) == 1 and not isinstance(given[0], _NODES) and not isinstance(given[0], (str, bytes, dict)):
        try:
            given = tuple(given[0])
        except TypeError:
            pass
    for member in given:
        if not isinstance(member, _NODES):
            raise CanvasError("a %s holds steps and shapes (step(...), task.s(...), chain, group, chord), got %s"
                              % (what, type(member).__name__))
    return given


def _check_options(options: dict[str, Any]) -> None:
    for name, why in NOT_IN_WORKFLOWS.items():
        if name in options:
            raise CanvasError("a step takes no %s: %s" % (name, why))
    unknown = sorted(set(options) - set(STEP_OPTIONS))
    if unknown:
        raise CanvasError("unknown step option%s %s; a step takes ref and %s"
                          % ("s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(STEP_OPTIONS)))


@dataclass(frozen=True)
class CompiledJob:
    """One job of a compiled shape: its ref, its step, and the refs it depends on."""

    ref: str
    step: Step
    depends_on: tuple[str, ...]


def compile_jobs(shape: Node) -> list[CompiledJob]:
    """The jobs of ``shape`` in the order its steps appear, each with its ref and dependencies.

    ``CanvasError`` for more than ``MAX_WORKFLOW_JOBS`` jobs (or none), a ref given twice,
    or one that breaks the rule (``REF_RULE``)."""
    if not isinstance(shape, _NODES):
        raise CanvasError("a workflow is a step or a shape (chain, group, chord), got %s" % type(shape).__name__)
    placed: list[tuple[Step, tuple[int, ...]]] = []  # each step, and the indexes of the steps it follows
    _place(shape, (), placed)
    check_size(len(placed))
    refs = _refs([s for s, _ in placed])
    return [CompiledJob(refs[i], s, tuple(refs[j] for j in after)) for i, (s, after) in enumerate(placed)]


def check_size(count: int) -> None:
    """``CanvasError`` unless a workflow of ``count`` jobs may be sent."""
    if count == 0:
        raise CanvasError("a workflow needs at least one job")
    if count > MAX_WORKFLOW_JOBS:
        raise CanvasError("a workflow holds at most %d jobs; this one has %d" % (MAX_WORKFLOW_JOBS, count))


def _place(shape: Node, after: tuple[int, ...], placed: list[tuple[Step, tuple[int, ...]]]) -> tuple[int, ...]:
    """Append the steps of ``shape``, each following ``after``; returns the steps ending it.
    Iterative over a chain's stages and a group's members, so wide shapes cost no depth;
    only nesting recurses."""
    if len(placed) > MAX_WORKFLOW_JOBS:
        return after  # already too many: compile_jobs says so without walking the rest
    if isinstance(shape, Step):
        placed.append((shape, after))
        return (len(placed) - 1,)
    if isinstance(shape, Chain):
        for stage in shape.stages:
            after = _place(stage, after, placed)
        return after
    ends: list[int] = []
    for member in shape.members:
        ends.extend(_place(member, after, placed))
    return tuple(ends) if shape.members else after


def _refs(steps: list[Step]) -> list[str]:
    """Each step's ref: its own, or ``TYPE.N`` (N counting that type's steps without one,
    skipping refs taken)."""
    taken: set[str] = set()
    for s in steps:
        if s.ref is None:
            continue
        if not is_task_type_name(s.ref):
            raise CanvasError("ref %r is invalid: refs are %s" % (s.ref, REF_RULE))
        if s.ref in taken:
            raise CanvasError("ref %r is given to two steps; refs are unique in a workflow" % s.ref)
        taken.add(s.ref)
    counts: dict[str, int] = {}
    refs = []
    for s in steps:
        ref = s.ref
        while ref is None or (s.ref is None and ref in taken):
            n = counts.get(s.task_type, 0)
            counts[s.task_type] = n + 1
            suffix = ".%d" % n
            ref = str(s.task_type)[: MAX_REF_CHARS - len(suffix)] + suffix
            if not is_task_type_name(ref):
                raise CanvasError("task type %r is invalid: task types are %s" % (s.task_type, REF_RULE))
        if s.ref is None:
            taken.add(ref)
        refs.append(ref)
    return refs
