"""Workflows: jobs submitted together with dependencies between them (docs/PROTOCOL.md, "Workflows").

``Workflows`` is the core's part for SUBMIT_WORKFLOW, WORKFLOW_STATUS, WORKFLOW_CANCEL and
WAIT_WORKFLOW, and for what happens between a workflow's jobs. A workflow's jobs are
ordinary jobs (created through ``ClientRequests``, moved only by the table) that carry
their workflow's id, their ``ref`` and the refs they depend on. A job with dependencies
is WAITING until each of them has COMPLETED.

It keeps, per live workflow (``Flow``), each job's state by its place in the workflow,
the children of each job, how many parents each WAITING job still waits for, and the
results of completed parents while a child of theirs still waits. As the table's move
listener (only while some workflow is live: jobs outside workflows cost nothing then) it
follows its jobs' states; a job that ends with waiting children is noted, and at the end
of the batch (``release``, before the scheduling pass and before the commit) each child
of a COMPLETED parent counts one parent fewer and, at none, moves to QUEUED (or
SCHEDULED) with its parents' results (``Job.parents``); each child of a FAILED or
CANCELLED parent is CANCELLED, and so on down. So a release is written in the same
commit as the result that caused it: a crash loses or repeats neither. Recovery builds
the same index from the store (``recover``), and applies what a batch would have.

A finished workflow stays in memory for a while (``FINISHED_JOBS_KEPT`` of its jobs in
all), then is read back from the store when asked for (``Store.load_workflow``, through
the table's deferred reads).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any, Iterable

import ujson

from jobmesh.coordinator.core.limits import Limits
from jobmesh.coordinator.core.requests import LIST_MAX_BYTES, MAX_PAYLOAD_BYTES, ClientRequests, Prepared, rejected
from jobmesh.coordinator.core.table import JobTable
from jobmesh.coordinator.core.waiters import MAX_WAIT_MILLIS, Slot, Waiter, Waiters
from jobmesh.errors import ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import TERMINAL, JobState
from jobmesh.protocol.messages import quote
from jobmesh.store.job import Job

if TYPE_CHECKING:
    from jobmesh.coordinator.core.peers import ReplyConnection

log = logging.getLogger(__name__)

MAX_JOBS = 10_000  # jobs in one workflow
MAX_NAME_CHARS = 256
REF = re.compile(r"[A-Za-z0-9_.:-]{1,128}\Z")
REF_RULE = "1-128 characters of letters, digits and _ . : -"
CYCLE_SHOWN = 8  # refs of a cycle an ERROR names
FINISHED_JOBS_KEPT = 100_000  # jobs of finished workflows kept in memory, in all
NOT_IN_WORKFLOWS = ("resultTtlMillis",)  # a workflow's jobs are purged together


class Flow:
    """A workflow as the core holds it: its jobs by their place (submission order)."""

    __slots__ = ("workflow_id", "name", "created_at", "submitted_by", "refs", "job_ids", "depends", "states", "at",
                 "open", "children", "pending", "results", "waiting_children", "version")

    def __init__(self, workflow_id: str, name: str | None, created_at: int, submitted_by: str | None,
                 refs: list[str], job_ids: list[str], depends: list[list[int]], states: list[JobState]) -> None:
        self.workflow_id = workflow_id
        self.name = name
        self.created_at = created_at
        self.submitted_by = submitted_by
        self.refs = refs
        self.job_ids = job_ids
        self.depends = depends  # each job's parents, by place
        self.states = states
        self.at = {ref: i for i, ref in enumerate(refs)}
        self.open = sum(1 for state in states if state not in TERMINAL)
        # While live: each job's children; WAITING job -> parents not completed yet;
        # completed parent -> its result (``recover`` fills those in), and -> its children
        # still WAITING.
        self.children: list[list[int]] = [[] for _ in refs]
        self.pending: dict[int, int] = {}
        self.results: dict[int, Any] = {}
        self.waiting_children: dict[int, int] = {}
        waiting_children = self.waiting_children
        for child, parents in enumerate(depends):
            for parent in parents:
                self.children[parent].append(child)
            if states[child] is JobState.WAITING:
                self.pending[child] = sum(1 for parent in parents if states[parent] is not JobState.COMPLETED)
                for parent in parents:
                    waiting_children[parent] = waiting_children.get(parent, 0) + 1
        self.version = 0  # counts its jobs' moves: a page built at the same version is the same

    def state(self) -> str:
        """RUNNING until every job is terminal, then COMPLETED, FAILED (any failed) or CANCELLED."""
        if self.open:
            return "RUNNING"
        states = set(self.states)
        if states == {JobState.COMPLETED}:
            return "COMPLETED"
        return "FAILED" if JobState.FAILED in states else "CANCELLED"

    def body(self) -> str:
        """What the store keeps of it besides its jobs."""
        return ujson.dumps({"name": self.name, "createdAtMillis": self.created_at, "submittedBy": self.submitted_by,
                            "jobs": len(self.refs)}, ensure_ascii=False, escape_forward_slashes=False)

    def page(self, start: int) -> m.Workflow:
        """The WORKFLOW reply with its jobs from place ``start``, as many as fit a frame."""
        jobs: list[dict[str, Any]] = []
        size = 0
        next_cursor = None
        refs, ids, states, depends = self.refs, self.job_ids, self.states, self.depends
        for i in range(start, len(refs)):
            item = {"ref": refs[i], "jobId": ids[i], "state": states[i].value,
                    "dependsOn": [refs[p] for p in depends[i]]}
            size += len(ujson.dumps(item)) + 1
            if size > LIST_MAX_BYTES and jobs:
                next_cursor = str(i)
                break
            jobs.append(item)
        return m.Workflow(self.workflow_id, self.name, self.state(), jobs, next_cursor)

    def settle(self) -> None:
        """Finished: drop what only a live workflow needs."""
        self.children = []
        self.pending = {}
        self.results = {}
        self.waiting_children = {}


def flow_of(workflow_id: str, body: str, jobs: list[Job]) -> Flow:
    """A workflow from its stored body and its jobs (in sequence order)."""
    fields = ujson.loads(body)
    refs = [job.ref or "" for job in jobs]
    at = {ref: i for i, ref in enumerate(refs)}
    depends = [[at[ref] for ref in job.depends_on or () if ref in at] for job in jobs]
    return Flow(workflow_id, fields.get("name"), fields.get("createdAtMillis", 0), fields.get("submittedBy"), refs,
                [job.job_id for job in jobs], depends, [job.state for job in jobs])


class FlowWaiter(Waiter):
    """A pending WAIT_WORKFLOW (``job_id`` holds the workflow's id)."""

    __slots__ = ()


class Workflows:
    def __init__(self, table: JobTable, requests: ClientRequests, limits: Limits) -> None:
        self.table = table
        self.requests = requests
        self.limits = limits
        self.live: dict[str, Flow] = {}
        self.finished: OrderedDict[str, Flow] = OrderedDict()
        self._finished_jobs = 0
        self._first_jobs: dict[str, str] = {}  # the first job of each finished workflow in memory -> its id
        self.ended = {"COMPLETED": 0, "FAILED": 0, "CANCELLED": 0}  # workflows that ended since the process started
        self.waiters = Waiters()  # pending WAIT_WORKFLOWs
        self._ends: list[tuple[Flow, int]] = []  # jobs that ended with children, for ``release``
        self._new: list[tuple[str, str]] = []  # workflow rows to insert with the batch
        self._listening = False
        self._last_page: tuple[Flow, int, int, m.Workflow] | None = None  # (flow, version, start, page)
        table.listen_forgets(self._purged)

    # ---- the table's listener (while some workflow is live) ------------------------------

    def moved(self, job: Job, source: JobState, target: JobState, now: int) -> None:
        workflow_id = job.workflow_id
        if workflow_id is None:
            return
        flow = self.live.get(workflow_id)
        if flow is None:
            return
        i = flow.at[job.ref or ""]
        flow.states[i] = target
        flow.version += 1
        if source is JobState.WAITING:  # released, cancelled or failed: it needs its parents no more
            flow.pending.pop(i, None)
            for parent in flow.depends[i]:
                left = flow.waiting_children.get(parent, 0) - 1
                if left > 0:
                    flow.waiting_children[parent] = left
                else:
                    flow.waiting_children.pop(parent, None)
                    flow.results.pop(parent, None)
        if target not in TERMINAL:
            return
        job.parents = None  # handed over with its attempts; a finished job need not keep up to 1 MiB of them
        if flow.children[i]:
            if target is JobState.COMPLETED and i in flow.waiting_children:
                flow.results[i] = job.result
            self._ends.append((flow, i))
        flow.open -= 1
        if not flow.open:
            self._finish(flow)

    def _finish(self, flow: Flow) -> None:
        del self.live[flow.workflow_id]
        state = flow.state()
        self.ended[state] += 1
        log.info("workflow ended workflow=%s state=%s jobs=%d", flow.workflow_id, state, len(flow.refs))
        flow.settle()
        self._keep(flow)
        if self.waiters:
            self.waiters.wake_job(flow.workflow_id)

    def _keep(self, flow: Flow) -> None:
        """A finished workflow in memory, while there is room."""
        if flow.workflow_id in self.finished:
            return
        self.finished[flow.workflow_id] = flow
        self._finished_jobs += len(flow.refs)
        self._first_jobs[flow.job_ids[0]] = flow.workflow_id
        while self._finished_jobs > FINISHED_JOBS_KEPT and len(self.finished) > 1:
            _, old = self.finished.popitem(last=False)
            self._drop(old)

    def _drop(self, flow: Flow) -> None:
        self._finished_jobs -= len(flow.refs)
        self._first_jobs.pop(flow.job_ids[0], None)

    def _purged(self, found: list[tuple[str, str | None]]) -> None:
        """Finished jobs purged ((job id, key) pairs): a workflow goes with its jobs (its first one tells)."""
        if self._first_jobs:
            for job_id, _key in found:
                workflow_id = self._first_jobs.get(job_id)
                if workflow_id is not None:
                    self._drop(self.finished.pop(workflow_id))

    def _page(self, flow: Flow, start: int) -> m.Workflow:
        """``flow.page(start)``, built once while the workflow does not change: a page may
        hold 10,000 jobs, and readers of a running workflow ask for the same one again and again."""
        last = self._last_page
        if last is not None and last[0] is flow and last[1] == flow.version and last[2] == start:
            return last[3]
        page = flow.page(start)
        self._last_page = (flow, flow.version, start, page)
        return page

    def _listen(self) -> None:
        if not self._listening:
            self.table.listen_moves(self)
            self._listening = True

    # ---- the end of a batch: releases and cancellations -------------------------------------

    def release(self, now: int) -> None:
        """The children of the jobs that ended in this batch: each child of a COMPLETED
        parent counts one parent fewer and, at none, is released (QUEUED, or SCHEDULED until
        its run-at time) with its parents' results; each child of a FAILED or CANCELLED
        parent is CANCELLED, and its children after it. Then, with no live workflow, the
        table tells this part nothing more."""
        ends = self._ends
        while ends:
            flow, i = ends.pop()
            state = flow.states[i]
            for child in flow.children[i] if flow.children else ():
                if flow.states[child] is not JobState.WAITING:
                    continue
                if state is JobState.COMPLETED:
                    left = flow.pending.get(child, 1) - 1
                    if left > 0:
                        flow.pending[child] = left
                    else:
                        self._release(flow, child, now)
                else:
                    job = self.table.jobs[flow.job_ids[child]]
                    detail = "dependency %s (job %s) %s" % (flow.refs[i], flow.job_ids[i], state.value)
                    job.error = detail
                    self.requests.cancel(job, now, detail)
        if self._listening and not self.live:
            self.table.unlisten(self)
            self._listening = False

    def _release(self, flow: Flow, i: int, now: int) -> None:
        job = self.table.jobs[flow.job_ids[i]]
        parents = {flow.refs[p]: flow.results.get(p) for p in flow.depends[i]}
        encoded = ujson.dumps(parents, ensure_ascii=False, escape_forward_slashes=False)
        room = MAX_PAYLOAD_BYTES - len((job.payload_json or ujson.dumps(job.payload, ensure_ascii=False)).encode())
        size = len(encoded.encode())
        if size > room:
            job.error = ("its dependencies' results are %d bytes encoded, more than fit in a task assignment with "
                         "its payload (%d bytes; 1 MiB in all)" % (size, room))
            log.info("workflow job failed workflow=%s job=%s: %s", flow.workflow_id, job.job_id, job.error)
            self.table.transition(job, JobState.FAILED, now)
            return
        job.parents = parents
        wall = now + self.table.drift
        if job.run_at is not None and job.run_at > wall:
            self.table.transition(job, JobState.SCHEDULED, now, due_at=job.run_at - self.table.drift,
                                  event="RELEASED")
        else:
            self.table.transition(job, JobState.QUEUED, now)

    # ---- SUBMIT_WORKFLOW ------------------------------------------------------------------

    def submit(self, now: int, req: m.SubmitWorkflow) -> m.Message:
        """Check the whole workflow, then create every job in this batch (one commit), or
        nothing: an ERROR names the first problem (and the ref of the job it is in)."""
        items = req.jobs
        if not 1 <= len(items) <= MAX_JOBS:
            return m.Error("a workflow has 1..%d jobs, got %d" % (MAX_JOBS, len(items)))
        name = req.name
        if name is not None and not 1 <= len(name) <= MAX_NAME_CHARS:
            return m.Error("a workflow's name is 1..%d characters" % MAX_NAME_CHARS)
        refs: list[str] = []
        at: dict[str, int] = {}
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                return m.Error("jobs[%d] must be an object, got %s" % (n, quote(item)))
            ref = item.get("ref")
            if not isinstance(ref, str) or not REF.match(ref):
                return m.Error("jobs[%d]: ref must be %s, got %s" % (n, REF_RULE, quote(ref)))
            if ref in at:
                return m.Error("ref %s appears twice; each job's ref is unique in its workflow" % quote(ref))
            at[ref] = n
            refs.append(ref)
        depends: list[list[int]] = []
        for ref, item in zip(refs, items):
            named = item.get("dependsOn")
            problem = _depends_problem(ref, named, at)
            if problem is not None:
                return m.Error(problem)
            depends.append([at[parent] for parent in named or ()])
        cycle = _cycle(refs, depends)
        if cycle is not None:
            return m.Error("the dependencies form a cycle: %s" % cycle)
        prepared: list[Prepared] = []
        for ref, item in zip(refs, items):
            new = self._prepare(now, ref, item, req.submitted_by)
            if isinstance(new, m.Error):
                return new
            prepared.append(new)
        problem_or_reply = self._keys(refs, prepared)
        if problem_or_reply is not None:
            return problem_or_reply
        table = self.table
        if table.active_count + len(items) > table.config.max_active_jobs:
            return rejected(table, "coordinator cannot take a workflow of %d jobs within its active-job limit; "
                                   "retry later" % len(items))
        if any(new.keys[1] is not None for new in prepared):
            self.limits.listen()  # their ends free their unique keys
        workflow_id = table.new_id()
        job_ids: list[str] = []
        for ref, new, parents in zip(refs, prepared, depends):
            reply = self.requests.create(now, new, (workflow_id, ref, [refs[p] for p in parents]))
            assert isinstance(reply, m.JobSubmitted), "admission was checked for the whole workflow"
            job_ids.append(reply.job_id)
        states = [JobState.WAITING if parents else table.jobs[job_id].state for job_id, parents in zip(job_ids, depends)]
        flow = Flow(workflow_id, name, now + table.drift, req.submitted_by, refs, job_ids, depends, states)
        self.live[workflow_id] = flow
        self._new.append((workflow_id, flow.body()))
        self._listen()
        log.info("workflow submitted workflow=%s jobs=%d name=%s", workflow_id, len(refs), quote(name))
        return m.WorkflowSubmitted(workflow_id, dict(zip(refs, job_ids)))

    def _prepare(self, now: int, ref: str, item: dict[str, Any], submitted_by: str | None) -> Prepared | m.Error:
        """One job of a workflow checked as a SUBMIT_JOB would be; an ERROR names its ref."""
        for field in NOT_IN_WORKFLOWS:
            if item.get(field) is not None:
                return m.Error("job %s: %s is not taken in a workflow (its jobs are kept and purged together)"
                               % (quote(ref), field))
        try:
            req = m.SubmitJob.from_wire(item)
        except ProtocolError as exc:  # "SUBMIT_JOB is missing field 'payload'": the job is what misses it
            problem = str(exc).removeprefix(m.SubmitJob.TYPE + " ")
            return m.Error("job %s%s %s" % (quote(ref), "" if problem.startswith("is ") else ":", problem))
        assert isinstance(req, m.SubmitJob)
        if submitted_by is not None:
            req = dataclasses.replace(req, submitted_by=submitted_by)
        new = self.requests.prepare(now, req)
        if isinstance(new, m.Error):
            return m.Error("job %s: %s" % (quote(ref), new.message))
        return new

    def _keys(self, refs: list[str], prepared: list[Prepared]) -> m.Message | None:
        """The idempotency and unique keys of a workflow's jobs: None if nothing holds
        them; WORKFLOW_SUBMITTED of an earlier workflow whose jobs hold every key given
        (a resend); else an ERROR naming the job whose key is taken."""
        keyed: dict[str, str] = {}
        unique: dict[tuple[str, str], str] = {}
        for ref, new in zip(refs, prepared):
            if new.key is not None:
                if new.key in keyed:
                    return m.Error("jobs %s and %s carry the same idempotencyKey %s"
                                   % (quote(keyed[new.key]), quote(ref), quote(new.key)))
                keyed[new.key] = ref
            unique_key = new.keys[1]
            if unique_key is not None:
                if (new.task_type, unique_key) in unique:
                    return m.Error("jobs %s and %s of type %s carry the same uniqueKey %s" % (
                        quote(unique[(new.task_type, unique_key)]), quote(ref), new.task_type, quote(unique_key)))
                unique[(new.task_type, unique_key)] = ref
        bound = self._bound(list(keyed)) if keyed else {}
        if bound:  # after the checks of the request itself: a resend is answered, anything else refused
            flows = {job.workflow_id for job in bound.values()}
            if len(bound) == len(keyed) and len(flows) == 1 and None not in flows:
                (workflow_id,) = flows
                assert workflow_id is not None
                flow = self._flow(workflow_id)
                if flow is not None:
                    return m.WorkflowSubmitted(workflow_id, dict(zip(flow.refs, flow.job_ids)))
            key, job = next(iter(bound.items()))
            return m.Error("job %s: idempotencyKey %s is already bound to job %s%s" % (
                quote(keyed[key]), quote(key), job.job_id,
                "" if job.workflow_id is None else " of workflow %s" % job.workflow_id))
        for (task_type, unique_key), ref in unique.items():
            live = self.limits.unique.get((task_type, unique_key))
            if live is not None:
                return m.Error("job %s: uniqueKey %s is held by live job %s of type %s"
                               % (quote(ref), quote(unique_key), live, task_type))
        return None

    def _bound(self, keys: list[str]) -> dict[str, Job]:
        """The jobs bound to these idempotency keys: memory's, then one store read for the rest."""
        table = self.table
        bound: dict[str, Job] = {}
        missing: list[str] = []
        for key in keys:
            job_id = table.keys.get(key)
            job = None if job_id is None else table.jobs.get(job_id) or table.finished.get(job_id)
            if job is not None:
                bound[key] = job
            else:
                missing.append(key)
        if missing:
            store = table.store
            found = table.awaited(("workflow keys",) + tuple(missing),
                                  lambda: store.later(partial(_find_keys, store, missing)))
            for key, job in zip(missing, found):
                if job is not None:
                    bound[key] = table.current(job)
        return bound

    # ---- WORKFLOW_STATUS, WORKFLOW_CANCEL, WAIT_WORKFLOW -------------------------------------

    def _flow(self, workflow_id: str) -> Flow | None:
        """A workflow: live, finished in memory, or read back from the store (ReadPending
        while that read is in flight); None if there is no such workflow."""
        flow = self.live.get(workflow_id) or self.finished.get(workflow_id)
        if flow is not None:
            return flow
        store = self.table.store
        stored = self.table.awaited(("workflow", workflow_id), lambda: store.later(partial(store.load_workflow,
                                                                                           workflow_id)))
        if stored is None:
            return None
        flow = flow_of(workflow_id, stored[0], [self.table.current(job) for job in stored[1]])
        if flow.open:  # not live here, so not a workflow this coordinator runs: as stored
            return flow
        flow.settle()
        self._keep(flow)
        return flow

    def status(self, now: int, req: m.WorkflowStatus) -> m.Message:
        start = 0
        if req.cursor is not None:
            try:
                start = int(req.cursor)
                if not 0 <= start <= MAX_JOBS:
                    raise ValueError
            except ValueError:
                return m.Error("invalid cursor %s" % quote(req.cursor))
        flow = self._flow(req.workflow_id)
        if flow is None:
            return _unknown(req.workflow_id)
        return self._page(flow, start)

    def cancel(self, now: int, req: m.WorkflowCancel) -> m.Message:
        """Cancel every job of the workflow that has not ended (running ones get TASK_CANCEL)."""
        flow = self._flow(req.workflow_id)
        if flow is None:
            return _unknown(req.workflow_id)
        if flow.workflow_id in self.live:
            jobs = self.table.jobs
            for job_id in list(flow.job_ids):
                job = jobs.get(job_id)
                if job is not None and job.state not in TERMINAL:
                    self.requests.cancel(job, now, "workflow %s cancelled" % flow.workflow_id)
            log.info("cancelled workflow=%s", flow.workflow_id)
        return self._page(flow, 0)

    def wait(self, now: int, conn: ReplyConnection, req: m.WaitWorkflow, slot: Slot | None = None) -> m.Message | Slot:
        """WAIT_WORKFLOW: the WORKFLOW reply now if it has ended (or the timeout is 0), else
        a Slot filled once it ends or ``timeoutMillis`` has passed (as WAIT_JOB's)."""
        timeout = req.timeout_millis
        if not 0 <= timeout <= MAX_WAIT_MILLIS:
            return m.Error("timeoutMillis must be 0..%d, got %s" % (MAX_WAIT_MILLIS, quote(timeout)))
        flow = self._flow(req.workflow_id)
        if flow is None:
            return _unknown(req.workflow_id)
        if not flow.open or timeout == 0 or flow.workflow_id not in self.live:
            return self._page(flow, 0)
        slot = slot or Slot()
        self.waiters.add(FlowWaiter(conn, slot, flow.workflow_id, now + timeout))
        return slot

    def take_answers(self) -> list[tuple[Waiter, m.Message]]:
        """The waits answered since the last call, each with the workflow as it stands now."""
        answers: list[tuple[Waiter, m.Message]] = []
        for waiter in self.waiters.take():
            flow = self.live.get(waiter.job_id) or self.finished.get(waiter.job_id)
            answers.append((waiter, self._page(flow, 0) if flow is not None else _unknown(waiter.job_id)))
        return answers

    def adopt_waiters(self, waiters: Iterable[Waiter]) -> None:
        """Waits carried over from a core that was thrown away (a reload): each waits here,
        keeping its deadline; one whose workflow ended, or that this state does not hold,
        is answered at the next ``take_answers``."""
        for waiter in waiters:
            self.waiters.add(waiter)
            if waiter.job_id not in self.live:
                self.waiters.wake_job(waiter.job_id)

    # ---- the batch's rows, recovery, figures ----------------------------------------------------

    def take_dirty(self) -> list[tuple[str, str]]:
        """The workflow rows to insert with this batch's commit."""
        new, self._new = self._new, []
        return new

    def recover(self, now: int, workflow_ids: Iterable[str]) -> int:
        """After the active jobs are in the table: each workflow that has some, read back
        whole from the store, its index built again; then what the batch that was cut
        short would have done (a WAITING job all of whose parents completed is released,
        one with a failed or cancelled parent cancelled). Returns how many are live."""
        store, table = self.table.store, self.table
        recovered: list[Flow] = []
        for workflow_id in sorted(workflow_ids):
            stored = store.load_workflow(workflow_id)
            if stored is None:
                log.error("workflow %s of active jobs has no stored row; its jobs go on without it", workflow_id)
                continue
            jobs = [table.current(job) for job in stored[1]]
            flow = flow_of(workflow_id, stored[0], jobs)
            if not flow.open:
                continue
            for parent in flow.waiting_children:
                if flow.states[parent] is JobState.COMPLETED:
                    flow.results[parent] = jobs[parent].result
            self.live[workflow_id] = flow
            recovered.append(flow)
        if not recovered:
            return 0
        self._listen()
        for flow in recovered:
            for i, state in enumerate(flow.states):
                if state is not JobState.WAITING:
                    continue
                ended = [p for p in flow.depends[i] if flow.states[p] in (JobState.FAILED, JobState.CANCELLED)]
                if ended:
                    self._ends.append((flow, ended[0]))  # its children are cancelled
                elif not flow.pending[i]:
                    self._release(flow, i, now)
        self.release(now)
        return len(self.live)

    def figures(self) -> dict[str, int]:
        """Workflows by state: the live ones, and those that ended since the process started."""
        return dict(self.ended, RUNNING=len(self.live))

    def carry_totals(self, old: Workflows) -> None:
        """A reload: the ended counts count since the process started."""
        for state, n in old.ended.items():
            self.ended[state] += n


def _depends_problem(ref: str, named: Any, at: dict[str, int]) -> str | None:
    """Why a job's ``dependsOn`` cannot be taken; None if it can."""
    if named is None:
        return None
    if not isinstance(named, list):
        return "job %s: dependsOn must be a list of refs, got %s" % (quote(ref), quote(named))
    seen: set[str] = set()
    for parent in named:
        if not isinstance(parent, str) or parent not in at:
            return "job %s depends on unknown ref %s" % (quote(ref), quote(parent))
        if parent == ref:
            return "job %s depends on itself" % quote(ref)
        if parent in seen:
            return "job %s names dependency %s twice" % (quote(ref), quote(parent))
        seen.add(parent)
    return None


def _cycle(refs: list[str], depends: list[list[int]]) -> str | None:
    """A cycle of the dependencies, as ``'a' depends on 'b', which depends on 'a'`` (Kahn's
    algorithm, then a walk among the jobs it left: O(jobs + edges)); None if acyclic."""
    children: list[list[int]] = [[] for _ in refs]
    indegree = [len(parents) for parents in depends]
    for child, parents in enumerate(depends):
        for parent in parents:
            children[parent].append(child)
    ready = [i for i, n in enumerate(indegree) if n == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for child in children[i]:
            indegree[child] -= 1
            if indegree[child] == 0:
                ready.append(child)
    if done == len(refs):
        return None
    # Each job left waits for a parent that is left too: walk up those until a job repeats.
    at = next(i for i, n in enumerate(indegree) if n > 0)
    walked: dict[int, int] = {}  # job -> its place on the walk
    while at not in walked:
        walked[at] = len(walked)
        at = next(p for p in depends[at] if indegree[p] > 0)
    loop = list(walked)[walked[at]:] + [at]
    shown = [quote(refs[i]) for i in loop[:CYCLE_SHOWN]]
    more = "" if len(loop) <= CYCLE_SHOWN else ", ... (%d jobs in all)" % (len(loop) - 1)
    return "%s depends on %s%s" % (shown[0], ", which depends on ".join(shown[1:]), more)


def _find_keys(store: Any, keys: list[str]) -> list[Job | None]:
    return [store.find_by_key(key) for key in keys]


def _unknown(workflow_id: str) -> m.Error:
    return m.Error("unknown workflow %s" % quote(workflow_id))
