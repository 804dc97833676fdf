"""The Periodic part of the core under random sequences of requests and events, with every
invariant checked after each step: per-func figures (ids, processing, locked, workers)
equal a scan of the jobs; every pending job can be found in its dispatch queue or on the
due heap; the counts; the lock table holds only live jobs, leaves no place free while jobs
wait, and a waiting job holds no lock; broadcast fan-out and sessions' running sets match
the jobs; RUN_JOB / RECV_DATA waiters are balanced (``_pwait_live``, per connection, heap).
The second test adds restarts from a real SQLite file, drain and pause toggles and
wall-clock steps. Seeded: every run tries the same sequences."""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter

import pytest

from jobmesh.periodic import codec as pc
from jobmesh.protocol import messages as m
from jobmesh.protocol.jobs import JobState
from jobmesh.store.sqlite import SQLiteStore
from tests.unit.test_core_periodic import T0, Conn, H

FUNCS = ["f", "g"]
NAMES = ["a", "b", "c"]
LOCKS = ["L1", "L2"]
PENDING = {JobState.QUEUED, JobState.SCHEDULED, JobState.RETRY_WAIT}
SEEDS, STEPS = 60, 300


class Inv(AssertionError):
    pass


def check(h: H, now: int) -> None:
    c = h.core
    live = {jid: j for jid, j in c.table.jobs.items() if j.periodic is not None}
    # per func figures
    for func, pf in c.periodic.funcs.items():
        mine = {jid for jid, j in live.items() if j.task_type == func}
        if pf.ids != mine:
            raise Inv("pf.ids(%s)=%s scan=%s" % (func, sorted(pf.ids), sorted(mine)))
        run = sum(1 for jid in mine if live[jid].state is JobState.RUNNING)
        if pf.processing != run:
            raise Inv("pf.processing(%s)=%d scan=%d" % (func, pf.processing, run))
        locked = sum(1 for jid in mine if jid in c.periodic.locking.locks.waiting)
        if pf.locked != locked:
            raise Inv("pf.locked(%s)=%d scan=%d" % (func, pf.locked, locked))
        decl = [s for s in c.periodic.workers.values() if func in s.funcs]
        if sorted(id(s) for s in pf.workers) != sorted(id(s) for s in decl) or len(set(map(id, pf.workers))) != len(pf.workers):
            raise Inv("pf.workers(%s) mismatch" % func)
    for jid, j in live.items():
        if j.task_type not in c.periodic.funcs:
            raise Inv("live job %s of func %s not in pfuncs" % (jid, j.task_type))
        if c.periodic.index.named.get((j.task_type, j.name or "")) != jid:
            raise Inv("named lacks live job %s" % jid)
    for key, jid in c.periodic.index.named.items():
        if jid not in live:
            raise Inv("named %s -> dead job %s" % (key, jid))
    # every pending job findable
    for jid, j in live.items():
        pf = c.periodic.funcs[j.task_type]
        sched = j.periodic["sched"]
        if j.state is JobState.QUEUED and jid not in c.periodic.locking.locks.waiting:
            if not any(e[2] == jid and c.periodic.index.entry_current(jid, e[0], JobState.QUEUED) for e in pf.queue):
                raise Inv("QUEUED job %s (%s/%s) not in its func's dispatch queue and not LOCK_WAIT: stuck"
                          % (jid, j.task_type, j.name))
        if j.state in PENDING and jid not in c.periodic.locking.locks.waiting:
            if not any(i == jid and t == sched for t, i in pf.pending):
                raise Inv("pending job %s has no pending entry" % jid)
        if j.state in (JobState.SCHEDULED, JobState.RETRY_WAIT):
            if not any(i == jid and t == j.wake_at for t, i in c.timers.due_heap):
                raise Inv("waiting job %s not on due heap" % jid)
        if j.state is JobState.RUNNING:
            s = c.periodic.workers.get(j.worker_id)
            if s is None or jid not in c.table.running(s):
                raise Inv("RUNNING job %s holder %s not live/not running it" % (jid, j.worker_id))
    # counts
    cnt = Counter((j.state, j.task_type) for j in live.values())
    got = Counter({(k[0], k[1]): n for k, n in c.table.counts.items() if k[3]})
    if +cnt != +got:
        raise Inv("counts %s vs scan %s" % (dict(got), dict(cnt)))
    # locks
    pl = c.periodic.locking.locks
    for jid in list(pl.held) + list(pl.waiting):
        if jid not in live:
            raise Inv("lock table holds dead job %s" % jid)
    for jid, name in pl.waiting.items():
        if live[jid].state is not JobState.QUEUED:
            raise Inv("waiting job %s is %s" % (jid, live[jid].state))
        if name not in pl.locks or jid not in pl.locks[name].fifo:
            raise Inv("waiting %s not in fifo of %s" % (jid, name))
    for name, lk in pl.locks.items():
        if not lk.holders and not lk.fifo:
            raise Inv("empty lock %s kept" % name)
        if len(lk.holders) > lk.max_holders:
            raise Inv("lock %s over max" % name)
        if lk.fifo and len(lk.holders) < lk.max_holders:
            raise Inv("lock %s has a free place (%d/%d) while %s wait" % (name, len(lk.holders), lk.max_holders, list(lk.fifo)))
        for jid in lk.holders:
            if name not in pl.held.get(jid, ()):
                raise Inv("holder map")
        for jid in lk.fifo:
            if pl.waiting.get(jid) != name:
                raise Inv("fifo map")
    for jid, names in pl.held.items():
        for n in names:
            if jid not in pl.locks[n].holders:
                raise Inv("held map")
        if jid in pl.waiting:
            raise Inv("waiting job %s holds %s: a refused job gives up its locks" % (jid, sorted(names)))
    # fanout
    for jid, ws in c.periodic.sessions.fanout.items():
        if jid not in live or live[jid].state is not JobState.RUNNING:
            raise Inv("pfanout for non-running job %s" % jid)
        for w in ws:
            s = c.periodic.workers.get(w)
            if s is None or jid not in c.table.running(s):
                raise Inv("fanout worker %s of %s gone/not running" % (w, jid))
    for s in c.periodic.workers.values():
        for jid in c.table.running(s):
            j = live.get(jid)
            if j is None or j.state is not JobState.RUNNING or (j.worker_id != s.worker_id and s.worker_id not in c.periodic.sessions.fanout.get(jid, ())):
                raise Inv("session %s running stale job %s" % (s.worker_id, jid))
    # waiters
    n = 0
    conns = Counter()
    for key, ws in c.periodic.waits.by_key.items():
        if not ws:
            raise Inv("empty pwaits list %s" % (key,))
        for w in ws:
            if w.done:
                raise Inv("done waiter listed")
            n += 1
            conns[w.conn] += 1
            if not w.stream and key not in c.periodic.index.named:
                raise Inv("RUN_JOB waiter %s with no live job" % (key,))
    if n != c.periodic.waits.live:
        raise Inv("_pwait_live=%d scan=%d" % (c.periodic.waits.live, n))
    if +conns != +Counter(c.periodic.waits.per_conn):
        raise Inv("_pwait_conns %s vs %s" % (dict(c.periodic.waits.per_conn), dict(conns)))
    heap_live = {id(e[2]) for e in c.periodic.waits.heap if not e[2].done}
    for ws in c.periodic.waits.by_key.values():
        for w in ws:
            if id(w) not in heap_live:
                raise Inv("waiter not on heap")


class Driver:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.h = H()
        self.now = T0
        self.wn = 0
        self.workers: list[Conn] = []
        self.tokens: dict[Conn, int] = {}
        self.clients = [Conn("c1"), Conn("c2")]
        self.log: list[str] = []

    def new_worker(self) -> Conn:
        self.wn += 1
        w = Conn("w%d" % self.wn)
        self.workers.append(w)
        return w

    def step(self) -> str:
        r = self.rng
        h, now = self.h, self.now
        f, n = r.choice(FUNCS), r.choice(NAMES)
        hd = pc.Handle(f.encode(), n.encode())
        op = r.choice(["submit", "submit", "submit_later", "run", "recv", "cando", "cando", "bcast", "cantdo",
                       "grab", "grab", "grab", "done", "fail", "later", "later0", "acq", "acq", "rel", "remove",
                       "drop", "unassign", "close", "tick", "tick", "cancel", "data", "status", "load"])
        w = r.choice(self.workers) if self.workers else None
        cl = r.choice(self.clients + ([w] if w else []))
        desc = op
        if op == "submit":
            desc = "submit %s/%s" % (f, n)
            h.submit(now, f, n, conn=cl)
        elif op == "submit_later":
            d = r.choice([1, 2, 5])
            desc = "submit %s/%s sched+%ds" % (f, n, d)
            h.submit(now, f, n, sched_at=(now + d * 1000) // 1000 + 1, conn=cl)
        elif op == "run":
            t = r.choice([0, 1, 3])
            desc = "run_job %s/%s timeout=%d from %s" % (f, n, t, cl)
            h.send(now, cl, pc.RunJob(next(h.msgid), pc.Job(f.encode(), n.encode(), b"w", 0, 0, t)))
        elif op == "recv":
            desc = "recv_data %s/%s from %s" % (f, n, cl)
            h.send(now, cl, pc.RecvData(next(h.msgid), pc.Job(f.encode(), n.encode(), b"", 0, 0, r.choice([0, 2]))))
        elif op in ("cando", "bcast", "cantdo"):
            if w is None or r.random() < 0.2:
                w = self.new_worker()
            cls = {"cando": pc.CanDo, "bcast": pc.Broadcast, "cantdo": pc.CantDo}[op]
            desc = "%s %s %s" % (op, w, f)
            h.send(now, w, cls(next(h.msgid), f.encode()))
        elif op == "grab":
            if w is None:
                return "noop"
            tok = r.randint(1, 3)
            desc = "grab %s tok=%d" % (w, tok)
            h.send(now, w, pc.GrabJob(tok))
        elif op in ("done", "fail", "later", "later0", "acq", "rel", "data"):
            if w is None:
                return "noop"
            # prefer the handle of a job running on w
            s = h.core.periodic.sessions.conns.get(w)
            if s is not None and h.core.table.running(s) and r.random() < 0.8:
                jid = r.choice(sorted(h.core.table.running(s)))
                j = h.core.table.jobs[jid]
                hd = pc.Handle(j.task_type.encode(), (j.name or "").encode())
            desc = "%s %s %s/%s" % (op, w, hd.func.decode(), hd.name.decode())
            if op == "done":
                h.send(now, w, pc.WorkDone(next(h.msgid), hd, b"ok"))
            elif op == "fail":
                h.send(now, w, pc.WorkFail(next(h.msgid), hd))
            elif op == "later":
                h.send(now, w, pc.SchedLater(next(h.msgid), hd, r.choice([1, 2]), 1))
            elif op == "later0":
                h.send(now, w, pc.SchedLater(next(h.msgid), hd, 0, 1))
            elif op == "acq":
                lk, mx = r.choice(LOCKS), r.choice([1, 1, 2])
                desc += " %s max=%d" % (lk, mx)
                h.send(now, w, pc.Acquire(next(h.msgid), lk.encode(), mx, hd))
            elif op == "rel":
                lk = r.choice(LOCKS)
                desc += " %s" % lk
                h.send(now, w, pc.Release(next(h.msgid), lk.encode(), hd))
            else:
                h.send(now, w, pc.WorkData(next(h.msgid), hd, b"chunk"))
        elif op == "remove":
            desc = "remove %s/%s" % (f, n)
            h.send(now, cl, pc.RemoveJob(next(h.msgid), hd))
        elif op == "drop":
            desc = "drop_func %s" % f
            h.send(now, cl, pc.DropFunc(next(h.msgid), f.encode()))
        elif op == "unassign":
            if w is None:
                return "noop"
            tok = r.randint(1, 3)
            desc = "job_unassigned %s tok=%d" % (w, tok)
            h.send(now, w, pc.JobUnassigned(tok))
        elif op == "close":
            if w is None:
                return "noop"
            desc = "close %s" % w
            self.workers.remove(w)
            h.core.periodic.on_closed(now, w)
            h.finish(now)
        elif op == "tick":
            d = r.choice([100, 500, 1000, 1000, 2000, 5000, 31000])
            self.now += d
            desc = "sweep +%dms" % d
            h.core.sweep(self.now)
            h.finish(self.now)
        elif op == "cancel":
            jid = h.core.periodic.index.named.get((f, n))
            if jid is None:
                return "noop"
            desc = "json cancel %s/%s" % (f, n)
            h.core.requests.cancel_job(now, jid)
            h.finish(now)
        elif op == "status":
            desc = "status"
            h.send(now, cl, pc.Status(next(h.msgid)))
        elif op == "load":
            desc = "load %s/%s" % (f, n)
            h.send(now, cl, pc.Load(next(h.msgid), (pc.Job(f.encode(), n.encode(), b"L", 0, 0, 0),)))
        if r.random() < 0.3:
            self.now += r.choice([1, 10, 100])
        return desc


class RestartingDriver(Driver):
    """Also restarts the core from its SQLite file, toggles drain and pause, steps the wall
    clock, and ACQUIREs / RELEASEs on any live job (not only one running on the worker)."""

    def __init__(self, rng: random.Random, db: str) -> None:
        super().__init__(rng)
        self.db = db
        self.ids = itertools.count(1)
        self.h = self._core()

    def _core(self) -> H:
        return H(SQLiteStore(self.db), ids=self.ids)

    def step(self) -> str:
        r, h = self.rng, self.h
        x = r.random()
        waiting = h.core.periodic.locking.locks.waiting
        if waiting and self.workers and r.random() < 0.2:  # a job waiting for a lock lets go of it
            job_id = r.choice(sorted(waiting))
            j = h.core.table.jobs[job_id]
            lk = waiting[job_id]
            h.send(self.now, r.choice(self.workers),
                   pc.Release(next(h.msgid), lk.encode(), pc.Handle(j.task_type.encode(), (j.name or "").encode())))
            return "release(waiting) %s/%s %s" % (j.task_type, j.name, lk)
        if x < 0.02:
            h.store.close()
            self.h = self._core()
            self.h.core.recover(self.now)
            self.h.finish(self.now)
            self.workers = []
            return "restart"
        if x < 0.04:
            h.core.draining = not h.core.draining
            h.finish(self.now)
            return "draining=%s" % h.core.draining
        if x < 0.06:
            h.core.refusal = None if h.core.refusal else m.Error("storage unavailable: disk full")
            h.finish(self.now)
            return "paused=%s" % bool(h.core.refusal)
        if x < 0.08:
            step = r.choice([-5000, 5000, 60000])
            h.core.observe_wall(self.now, self.now + h.core.table.drift + step)
            h.finish(self.now)
            return "wall step %+d" % step
        running = [j for j in h.core.table.jobs.values() if j.periodic is not None and j.state is JobState.RUNNING]
        if x < 0.22 and running:  # contention: a running job asks its worker's way for L1 (one holder)
            j = r.choice(running)
            h.send(self.now, h.core.periodic.workers[j.worker_id].conn, pc.Acquire(
                next(h.msgid), b"L1", 1, pc.Handle(j.task_type.encode(), (j.name or "").encode())))
            return "acquire(contended) %s/%s" % (j.task_type, j.name)
        live = [j for j in h.core.table.jobs.values() if j.periodic is not None]
        if x < 0.25 and self.workers and live:
            w = r.choice(self.workers)
            j = r.choice(live)
            hd = pc.Handle(j.task_type.encode(), (j.name or "").encode())
            lk = r.choice(LOCKS)
            if r.random() < 0.6:
                h.send(self.now, w, pc.Acquire(next(h.msgid), lk.encode(), r.choice([1, 1, 2]), hd))
                return "acquire(any) %s %s/%s %s" % (w, j.task_type, j.name, lk)
            h.send(self.now, w, pc.Release(next(h.msgid), lk.encode(), hd))
            return "release(any) %s %s/%s %s" % (w, j.task_type, j.name, lk)
        return super().step()


def drive(driver: Driver, steps: int) -> None:
    for _ in range(steps):
        driver.log.append(driver.step())
        try:
            check(driver.h, driver.now)
        except Inv as exc:
            raise AssertionError("%s\nlast steps: %s" % (exc, " | ".join(driver.log[-12:]))) from None


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_random_sequences_keep_every_invariant(seed):
    drive(Driver(random.Random(seed)), STEPS)


@pytest.mark.parametrize("seed", range(SEEDS // 2))
def test_random_sequences_with_restarts_drains_and_clock_steps(seed, tmp_path):
    driver = RestartingDriver(random.Random(1000 + seed), str(tmp_path / "jobmesh.db"))
    try:
        drive(driver, STEPS)
    finally:
        driver.h.store.close()
