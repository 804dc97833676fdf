"""aio-periodic load for ``bench/periodic.py``: a submitting client or a worker.

The real aio-periodic 1.0.0 library in a plain asyncio process. It must never share a
process with gevent's monkey patching or with jobmesh, so ``bench/periodic.py`` starts
it as a subprocess (``python -m bench.periodic_peer ...``) and this module imports
neither.

Both roles print one JSON object per line on stdout:

- ``client``: ``{"ready": ...}`` once connected; it then waits for SIGUSR1, so that every
  client process starts at the same moment, runs ``--inflight`` coroutines that loop
  ``submit_job`` on its one ``Client`` (unique names ``TAGN``) until ``--jobs`` are
  accepted or ``--duration`` has passed, prints its report and exits. ``--warmup`` jobs
  go first, before the ready line: aio-periodic's workers hand out one more grab token
  per job assigned (or per second when idle), so they reach their full concurrency
  only after some jobs have run.
- ``worker``: ``{"ready": ...}`` once its func is declared, then a progress line every
  0.1 s while jobs complete (``done``, and the monotonic time of the last
  WORK_DONE acknowledged). Tasks answer at once with ``job.done``.

Times are ``time.monotonic()``, which is one clock for every process on Linux, so the
driver can compare them across processes. aio-periodic reconnects forever after
``close()``, so both roles leave with ``os._exit``; ``--lifetime`` bounds every process
even if the driver is gone.

Usage:
  periodic_peer.py client ADDR --func=F --tag=T [--inflight=I] [--jobs=N | --duration=S] [--warmup=N]
                   [--lifetime=S]
  periodic_peer.py worker ADDR --func=F [--size=K] [--lifetime=S]

Options:
  --func=F       the Periodic func
  --tag=T        prefix of the job names, unique per client process
  --inflight=I   submits in flight on the connection [default: 8]
  --jobs=N       jobs to have accepted, then stop
  --duration=S   seconds to submit for, then stop [default: 5]
  --warmup=N     before the ready line, submit N jobs (names TAGwN), not counted [default: 0]
  --size=K       the worker's concurrency (grab agents) [default: 32]
  --lifetime=S   exit after this many seconds whatever happens [default: 300]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

from docopt import docopt

from aio_periodic import Client, Worker
from aio_periodic.transport import Transport

WORKLOAD = b'{"ms": 0}'  # the size of the JSON port's SLEEP 0 payload
PROGRESS_S = 0.1


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def cpu_s() -> float:
    return time.process_time()


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 / p99 / max of latencies in seconds, in ms (every sample kept: a client
    makes at most a few hundred thousand submits per run)."""
    if not samples:
        return {}
    s = sorted(samples)

    def pick(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 3)

    return {"p50": pick(0.50), "p99": pick(0.99), "max": pick(1.0), "count": len(s)}


class Submitter:
    """``inflight`` coroutines sharing one ``Client``; counts and times what they get back."""

    def __init__(self, client: Client, func: str, tag: str, jobs: int | None, duration: float | None) -> None:
        self.client = client
        self.func = func
        self.tag = tag
        self.jobs = jobs
        self.duration = duration
        self.next_index = 0
        self.accepted = 0
        self.refused = 0  # submit_job returned False: DATA "rejected ..." at the active-job limit
        self.errors: dict[str, int] = {}
        self.latencies: list[float] = []
        self.first_send: float | None = None
        self.last_reply: float | None = None
        self.stop_at = 0.0

    def take(self) -> int | None:
        """The next job index, or None when the run is over (by count or by time)."""
        if self.jobs is not None and self.next_index >= self.jobs:
            return None
        if self.duration is not None and time.monotonic() >= self.stop_at:
            return None
        self.next_index += 1
        return self.next_index - 1

    async def loop(self) -> None:
        rng = random.Random(self.tag)
        while (index := self.take()) is not None:
            name = "%s%d" % (self.tag, index)
            while True:  # a refused submit is retried with the same name after a short pause
                t0 = time.monotonic()
                if self.first_send is None:
                    self.first_send = t0
                try:
                    ok = await self.client.submit_job(self.func, name, WORKLOAD)
                except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection: count it, go on
                    self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                    break
                t1 = time.monotonic()
                if ok:
                    self.accepted += 1
                    self.latencies.append(t1 - t0)
                    self.last_reply = t1
                    break
                self.refused += 1  # DATA "rejected ...": the coordinator is at its active-job limit
                await asyncio.sleep(rng.uniform(0.005, 0.05))
                if self.duration is not None and time.monotonic() >= self.stop_at:
                    break

    async def run(self, inflight: int) -> dict[str, Any]:
        cpu0 = cpu_s()
        self.stop_at = time.monotonic() + (self.duration or 0)
        await asyncio.gather(*(self.loop() for _ in range(inflight)))
        return {"accepted": self.accepted, "refused": self.refused, "errors": self.errors,
                "first_send": self.first_send, "last_reply": self.last_reply, "cpu_s": round(cpu_s() - cpu0, 4),
                "latency_ms": percentiles_ms(self.latencies)}


async def run_client(addr: str, func: str, tag: str, inflight: int, jobs: int | None,
                     duration: float | None, warmup: int) -> None:
    go = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
    client = Client()
    await client.connect(Transport("tcp://" + addr))
    if not await client.ping():
        raise RuntimeError("no PONG from %s" % addr)
    warmed = 0
    if warmup:
        warmed = (await Submitter(client, func, tag + "w", warmup, None).run(inflight))["accepted"]
    emit({"ready": True, "pid": os.getpid(), "warmup": warmed})
    await go.wait()
    emit(await Submitter(client, func, tag, jobs, duration).run(inflight))


async def run_worker(addr: str, func: str, size: int) -> None:
    state: dict[str, Any] = {"done": 0, "failed": 0, "last": None}

    async def task(job: Any) -> None:
        ok = await job.done(b"")
        now = time.monotonic()
        if ok:
            state["done"] += 1
            state["last"] = now
        else:
            state["failed"] += 1

    worker = Worker()
    await worker.connect(Transport("tcp://" + addr))
    await worker.add_func(func, task)
    emit({"ready": True, "pid": os.getpid()})
    work = asyncio.create_task(worker.work(size))
    shown = -1
    while not work.done():
        await asyncio.sleep(PROGRESS_S)
        if state["done"] + state["failed"] != shown:
            shown = state["done"] + state["failed"]
            emit(state)
    work.result()  # work() never returns; if it raised, say why


async def bounded(coro: Any, lifetime: float, on_timeout: int) -> None:
    """Run ``coro`` for at most ``lifetime`` seconds, then leave the process at once:
    aio-periodic reconnects forever after ``close()``, and its tasks would outlive
    asyncio.run's cancellation."""
    code = 0
    try:
        await asyncio.wait_for(coro, lifetime)
    except asyncio.TimeoutError:
        code = on_timeout
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write("periodic_peer: %s: %s\n" % (type(exc).__name__, exc))
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    args = docopt(__doc__, argv=argv)
    lifetime = float(args["--lifetime"])
    if args["client"]:
        jobs = int(args["--jobs"]) if args["--jobs"] else None
        duration = None if jobs is not None else float(args["--duration"])
        coro = run_client(args["ADDR"], args["--func"], args["--tag"], int(args["--inflight"]), jobs, duration,
                          int(args["--warmup"]))
        on_timeout = 4  # a client should have finished long before
    else:
        coro = run_worker(args["ADDR"], args["--func"], int(args["--size"]))
        on_timeout = 0  # a worker's life always ends this way unless it is stopped first
    asyncio.run(bounded(coro, lifetime, on_timeout))


if __name__ == "__main__":
    main()
