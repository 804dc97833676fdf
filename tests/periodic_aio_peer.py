"""A real aio-periodic 1.0.0 Worker or Client against a real coordinator's Periodic port.

Run only as a subprocess (asyncio + aio_periodic, never jobmesh nor gevent):

    python tests/periodic_aio_peer.py worker HOST:PORT FUNC MODE [SIZE]
        MODE: done (WORK_DONE b"done:" + workload), fail_once (WORK_FAIL the first time a
        name is seen), later_once (SCHED_LATER 1 s, step 1, the first time), hang (never answers)
        prints one JSON line per job it runs: func, name, workload, count, timeout, sched_at
    python tests/periodic_aio_peer.py client HOST:PORT OPS_JSON
        OPS: ["submit", func, name, workload, sched_at, timeout] | ["status"] |
             ["remove", func, name] | ["drop", func] | ["ping"]
        prints one JSON list: each operation's result
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aio_periodic import Client, Worker
from aio_periodic.transport import Transport


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run_worker(addr: str, func: str, mode: str, size: int) -> None:
    seen: set[str] = set()

    async def task(job):  # type: ignore[no-untyped-def]
        emit({"func": job.func_name, "name": job.name, "workload": job.workload.decode(),
              "count": job.payload.count, "timeout": job.timeout, "sched_at": job.sched_at})
        first = job.name not in seen
        seen.add(job.name)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "fail_once" and first:
            await job.fail()
            return
        if mode == "later_once" and first:
            await job.sched_later(1, 1)
            return
        await job.done(b"done:" + job.workload)

    worker = Worker()
    await worker.connect(Transport("tcp://" + addr))
    await worker.add_func(func, task)
    emit({"ready": True})
    await worker.work(size)


async def run_client(addr: str, ops: list) -> None:
    client = Client()
    await client.connect(Transport("tcp://" + addr))
    out = []
    for op in ops:
        if op[0] == "submit":
            _, func, name, workload, sched_at, timeout = op
            out.append(await client.submit_job(func, name, workload.encode(), sched_at=sched_at, timeout=timeout))
        elif op[0] == "status":
            out.append(await client.status())
        elif op[0] == "remove":
            out.append(await client.remove_job(op[1], op[2]))
        elif op[0] == "drop":
            out.append(await client.drop_func(op[1]))
        elif op[0] == "ping":
            out.append(await client.ping())
    emit(out)
    os._exit(0)  # aio-periodic reconnects forever after close(); nothing more to do


def main() -> None:
    role, addr = sys.argv[1], sys.argv[2]
    if role == "worker":
        asyncio.run(run_worker(addr, sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 1))
    else:
        asyncio.run(asyncio.wait_for(run_client(addr, json.loads(sys.argv[3])), 20))


if __name__ == "__main__":
    main()
