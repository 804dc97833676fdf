"""A users' tasks module for the tests: copied into ``tmp_path`` as ``jm_user_tasks.py``.

Workers started by the tests import it with ``--tasks=jm_user_tasks`` (found via their
working directory or PYTHONPATH). The test process never imports it: its ``@task`` lines
would fill this process's registry. Tasks that tests must watch while they run write
marker files into ``payload["dir"]`` (written whole, then renamed into place).
"""

import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

from jobmesh.worker import task


def mark(payload, name, data=None):
    if payload.get("dir"):
        tmp = Path(payload["dir"]) / (name + ".tmp")
        tmp.write_text(json.dumps(data or {}))
        tmp.rename(Path(payload["dir"]) / name)


@task("GREET")
def greet(payload):
    return {"greeting": "hello " + payload["name"]}


@task("BIG")
def big(payload):
    return {"x": "y" * payload["bytes"]}


@task("WHOAMI")
def whoami(payload):
    """Where the function runs: its pid, and whether gevent is loaded (it must not be)."""
    return {"pid": os.getpid(), "gevent": "gevent" in sys.modules}


@task("CPU")
def cpu(payload):
    """Pure-Python CPU work for ``seconds``."""
    deadline = time.monotonic() + payload["seconds"]
    rounds = 0
    while time.monotonic() < deadline:
        sum(i * i for i in range(2000))
        rounds += 1
    return {"rounds": rounds}


@task("NAP")
def nap(payload):
    started = time.monotonic()  # CLOCK_MONOTONIC: comparable across the worker's processes
    time.sleep(payload["seconds"])
    ended = time.monotonic()
    return {"sleptSeconds": ended - started, "began": started, "ended": ended}


@task("LOGS")
def logs(payload):
    """Four threads logging ``lines`` lines each through one handler (the patched-RLock trap)."""
    log = logging.getLogger("jm_user_tasks.logs.%s" % payload["file"])
    handler = logging.FileHandler(payload["file"])
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False

    def spam(k):
        for i in range(payload["lines"]):
            log.info("thread %d line %d", k, i)

    threads = [threading.Thread(target=spam, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.removeHandler(handler)
    handler.close()
    return {"lines": 4 * payload["lines"]}


@task("THREADS")
def threads(payload):
    """``n`` threads alive at once (a barrier): real OS threads have distinct native ids."""
    n = payload["n"]
    barrier = threading.Barrier(n, timeout=10)
    ids = {}

    def work(k):
        barrier.wait()
        ids[k] = threading.get_native_id()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(10)
    return {"distinctNativeIds": len(set(ids.values())), "threads": len(ids), "gevent": "gevent" in sys.modules}


@task("CHATTY")
def chatty(payload):
    """print() a lot, including bytes that look like a frame header and a message."""
    for i in range(payload["lines"]):
        print('chatty line %d {"type": "TASK_RESULT", "success": true}' % i)
    sys.stdout.write("\x00\x00\x00\x05junk\n")
    sys.stderr.write("chatty on stderr\n")
    return {"printed": payload["lines"]}


@task("COOP")
def coop(payload, ctx):
    """Waits for ctx.cancelled (a cooperative long task)."""
    mark(payload, "started", {"pid": os.getpid()})
    seen = ctx.cancelled.wait(payload.get("timeout", 30))
    mark(payload, "finished", {"cancelled": seen, "jobId": ctx.job_id, "attempt": ctx.attempt,
                               "attemptId": ctx.attempt_id})
    return {"cancelled": seen}


@task("STUBBORN")
def stubborn(payload, ctx):
    """Ignores ctx.cancelled and runs to its end: ``seconds``, or until the file ``release``
    in ``dir`` exists if ``seconds`` pass first."""
    mark(payload, "started", {"pid": os.getpid()})
    if payload.get("untilReleased"):
        release = Path(payload["dir"]) / "release"
        deadline = time.monotonic() + payload["seconds"]
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        time.sleep(payload["seconds"])
    mark(payload, "finished", {"cancelledSet": ctx.cancelled.is_set()})
    return {"done": True}


@task("FLAKY")
def flaky(payload, ctx):
    if ctx.attempt < payload["okFromAttempt"]:
        raise RuntimeError("attempt %d is too early" % ctx.attempt)
    return {"attempt": ctx.attempt}


@task("ADDUP")
def addup(payload, ctx):
    """A workflow step: its payload's ``n`` plus the sums of its parents (``ctx.parents``),
    and the refs of the parents it got."""
    total = payload.get("n", 0) + sum(parent.get("sum", 0) for parent in ctx.parents.values())
    return {"sum": total, "parents": sorted(ctx.parents)}


@task("TALLY")
def tally(payload, ctx):
    """A join of many: how many parents it got, and their sums added (ADDUP's result keeps
    every parent's ref, too long for a result with thousands of them)."""
    return {"parents": len(ctx.parents), "sum": sum(parent.get("sum", 0) for parent in ctx.parents.values())}


@task("BOOM")
def boom(payload):
    raise ValueError("bad name")


@task("LISTY")
def listy(payload):
    return [1, 2, 3]


@task("EXIT3")
def exit3(payload):
    os._exit(3)


@task("ORPHAN")
def orphan(payload):
    """Forks a grandchild that sleeps ``seconds`` holding every fd of the task process (its
    socket among them); then returns, or with ``signal`` kills the task process with it."""
    grandchild = os.fork()
    if grandchild == 0:
        try:
            time.sleep(payload["seconds"])
        finally:
            os._exit(0)
    mark(payload, "grandchild", {"pid": grandchild, "parent": os.getpid()})
    if payload.get("signal"):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfault on purpose needs no core file
        os.kill(os.getpid(), getattr(signal, payload["signal"]))
        time.sleep(30)
    return {"grandchild": grandchild}


@task("DEAF")
def deaf(payload, ctx):
    """Ignores SIGTERM and ctx.cancelled, and runs ``seconds``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(payload, "started", {"pid": os.getpid()})
    deadline = time.monotonic() + payload["seconds"]
    while time.monotonic() < deadline:
        time.sleep(0.05)
    mark(payload, "finished")
    return {"done": True}


def _wait_for(path, ctx, seconds=30):
    """Whether ``path`` appeared within ``seconds`` (False as soon as the attempt is cancelled)."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if ctx.cancelled.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@task("REPORTER")
def reporter(payload, ctx):
    """Attempt n marks ``started-n``, waits for the file ``report-n`` in ``dir`` and reports
    the ``fraction`` and ``message`` it holds (JSON), waits for ``end-n``, then fails if
    ``report-n`` said ``fail``, else returns."""
    d = Path(payload["dir"])
    n = ctx.attempt
    mark(payload, "started-%d" % n)
    if not _wait_for(d / ("report-%d" % n), ctx):
        return {"reported": False}
    spec = json.loads((d / ("report-%d" % n)).read_text())
    ctx.progress(spec["fraction"], spec.get("message"))
    if not _wait_for(d / ("end-%d" % n), ctx):
        return {"reported": True}
    if spec.get("fail"):
        raise RuntimeError("attempt %d fails after reporting" % n)
    return {"attempt": n}


@task("SPIN")
def spin(payload, ctx):
    """``ctx.progress`` ``calls`` times in a tight loop, then returns how long that took."""
    calls = payload["calls"]
    started = time.monotonic()
    for i in range(calls):
        ctx.progress(i / calls, "step %d" % i)
    return {"calls": calls, "seconds": time.monotonic() - started}
