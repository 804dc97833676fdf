"""A real aio-periodic 1.0.0 Worker or Client against a real coordinator's Periodic port.

Run only as a subprocess (asyncio + aio_periodic, never jobmesh nor gevent):

    python tests/periodic_aio_peer.py worker HOST:PORT FUNC MODE [SIZE] [--lock=NAME:MAX] [--broadcast]
        MODE: done (WORK_DONE b"done:" + workload), fail_once (WORK_FAIL the first time a
        name is seen), later_once (SCHED_LATER 1 s, step 1, the first time), hang (never answers),
        sleep=SECONDS (runs that long, then WORK_DONE b"done:" + workload), stream (WORK_DATA
        b"c1", b"c2", b"c3", then WORK_DONE b"end", each 0.2 s after the one before)
        SIZE: the pool size given to work() [default: 1]
        --lock=NAME:MAX: the func is added with locker=lambda job: (NAME, MAX) (ACQUIRE before
        the task runs; the lock is held until the job's outcome)
        --broadcast: the func is declared with worker.broadcast() instead of add_func()
        prints {"ready": true} once the func is declared, then one JSON line per job it runs:
        func, name, workload, count, timeout, sched_at, t (time.time() at the task's start);
        sleep=SECONDS also prints {"end": name, "t": time.time()} just before its WORK_DONE
    python tests/periodic_aio_peer.py client HOST:PORT OPS_JSON
        OPS: ["submit", func, name, workload, sched_at, timeout] | ["status"] |
             ["remove", func, name] | ["drop", func] | ["ping"] |
             ["run", func, name, workload, timeout] | ["run_stream", func, name, workload, timeout]
        run: client.run_job; run_stream: client.run_job(stream=cb). Their result is
        {"data": text} or {"error": "ExceptionType: message"}, with "seconds" (how long the
        call took) and, for run_stream, "chunks" (the texts cb received, in order)
        prints one JSON list: each operation's result

PERIODIC_MODE = Plain, RSA or AES in the environment connects through RSATransport in
that mode, with the key files PERIODIC_CLIENT_PRIVATE_KEY and PERIODIC_SERVER_PUBLIC_KEY
(as tests/periodic_aio_echo.py); without it, a plain Transport.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from aio_periodic import Client, Worker
from aio_periodic.transport import RSAMode, RSATransport, Transport


def transport(addr: str) -> Transport | RSATransport:
    tcp = Transport("tcp://" + addr)
    mode = os.environ.get("PERIODIC_MODE")
    if not mode:
        return tcp
    return RSATransport(tcp, os.environ["PERIODIC_CLIENT_PRIVATE_KEY"], os.environ["PERIODIC_SERVER_PUBLIC_KEY"],
                        mode=RSAMode[mode])


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run_worker(addr: str, func: str, mode: str, size: int, lock: str | None, broadcast: bool) -> None:
    seen: set[str] = set()

    async def task(job):  # type: ignore[no-untyped-def]
        emit({"func": job.func_name, "name": job.name, "workload": job.workload.decode(),
              "count": job.payload.count, "timeout": job.timeout, "sched_at": job.sched_at, "t": time.time()})
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
        if mode.startswith("sleep="):
            await asyncio.sleep(float(mode.split("=", 1)[1]))
            emit({"end": job.name, "t": time.time()})
        if mode == "stream":
            for chunk in (b"c1", b"c2", b"c3"):
                await asyncio.sleep(0.2)
                await job.data(chunk)
            await asyncio.sleep(0.2)
            await job.done(b"end")
            return
        await job.done(b"done:" + job.workload)

    locker = None
    if lock is not None:
        lock_name, lock_max = lock.rsplit(":", 1)
        locker = lambda job: (lock_name, int(lock_max))  # noqa: E731
    worker = Worker()
    await worker.connect(transport(addr))
    if broadcast:
        await worker.broadcast(func, task, locker=locker)
    else:
        await worker.add_func(func, task, locker=locker)
    emit({"ready": True})
    await worker.work(size)


async def run_job(client: Client, op: list) -> dict:
    kind, func, name, workload, timeout = op
    chunks: list[bytes] = []
    started = time.monotonic()
    try:
        data = await client.run_job(func, name, workload.encode(), timeout=timeout,
                                    stream=chunks.append if kind == "run_stream" else None)
        out: dict = {"data": data.decode("utf-8", "replace")}
    except asyncio.CancelledError as exc:
        if asyncio.current_task().cancelling():  # the whole run's deadline, not run_job's own doing
            raise
        out = {"error": "CancelledError: %s" % exc}
    except Exception as exc:  # Exception('no worker'), TimeoutError, ...
        out = {"error": "%s: %s" % (type(exc).__name__, exc)}
    out["seconds"] = round(time.monotonic() - started, 3)
    if kind == "run_stream":
        out["chunks"] = [c.decode("utf-8", "replace") for c in chunks]
    return out


async def run_client(addr: str, ops: list) -> None:
    client = Client()
    await client.connect(transport(addr))
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
        elif op[0] in ("run", "run_stream"):
            out.append(await run_job(client, op))
        else:
            raise SystemExit("unknown op %r" % (op,))
    emit(out)
    os._exit(0)  # aio-periodic reconnects forever after close(); nothing more to do


def main() -> None:
    role, addr = sys.argv[1], sys.argv[2]
    if role == "worker":
        rest = sys.argv[5:]
        size = int(rest.pop(0)) if rest and not rest[0].startswith("--") else 1
        opts = dict(arg[2:].split("=", 1) if "=" in arg else (arg[2:], "") for arg in rest)
        unknown = set(opts) - {"lock", "broadcast"}
        if unknown:
            raise SystemExit("unknown options %s" % sorted(unknown))
        asyncio.run(run_worker(addr, sys.argv[3], sys.argv[4], size, opts.get("lock"), "broadcast" in opts))
    else:
        asyncio.run(asyncio.wait_for(run_client(addr, json.loads(sys.argv[3])), 20))


if __name__ == "__main__":
    main()
