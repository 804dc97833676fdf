"""aio-periodic 1.0.0's own CI sequence (its examples/echo_worker.py and echo_client.py, run
against periodicd in each mode of its matrix), against a coordinator's Periodic port.

Run only as a subprocess (asyncio + aio_periodic, never jobmesh nor gevent):

    python tests/periodic_aio_echo.py worker HOST:PORT
        funcs echo (WORK_DONE with the job's name), echo_later (SCHED_LATER 1 s, step 1,
        until the job's count passes 3, then WORK_DONE with its name) and test_lock (under
        the lock "test" of 2: waits 1 s, then WORK_DONE with its name); prints {"ready": true}
        once all three are declared, then {"start": name, "t": ...} and {"end": name, "t": ...}
        around each test_lock body
    python tests/periodic_aio_echo.py client HOST:PORT
        the CI's client steps in order; prints one JSON list of their results (bytes as
        text; an exception as {"error": "Type: message"})

The environment chooses the transport, as in aio-periodic's CI: PERIODIC_MODE = Normal
(no handshake, the default), Plain, RSA or AES (RSATransport with that mode), with the
key files PERIODIC_CLIENT_PRIVATE_KEY and PERIODIC_SERVER_PUBLIC_KEY. With PERIODIC_TOKEN_NAME
and PERIODIC_TOKEN it registers with that token (type 3 for the client, 4 for the worker:
the registration bytes aio-periodic's later ``Client(client_name=, client_token=)`` sends;
1.0.0 takes them as its connection type unchanged).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from aio_periodic import Client, Job, Worker
from aio_periodic.job import Job as RunningJob
from aio_periodic.transport import RSAMode, RSATransport, Transport


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def transport(addr: str) -> Any:
    tcp = Transport("tcp://" + addr)
    mode = os.environ.get("PERIODIC_MODE") or "Normal"
    if mode == "Normal":
        return tcp
    return RSATransport(tcp, os.environ["PERIODIC_CLIENT_PRIVATE_KEY"], os.environ["PERIODIC_SERVER_PUBLIC_KEY"],
                        mode=RSAMode[mode])


def registration(peer: Any) -> Any:
    """``peer`` (a Client or Worker), registering with the token in the environment, if any."""
    name = os.environ.get("PERIODIC_TOKEN_NAME")
    if name:
        token = os.environ["PERIODIC_TOKEN"].encode()
        kind = b"\x04" if isinstance(peer, Worker) else b"\x03"
        peer._clientType = kind + b"".join(len(part).to_bytes(8, "big") + part for part in (name.encode(), token))
    return peer


async def run_worker(addr: str) -> None:
    async def echo(job: RunningJob) -> None:
        await job.done(job.name)

    async def echo_later(job: RunningJob) -> None:
        if job.payload.count > 3:
            await job.done(job.name)
        else:
            await job.sched_later(1, 1)

    async def test_lock(job: RunningJob) -> None:
        async def locked() -> None:
            emit({"start": job.name, "t": time.time()})
            await asyncio.sleep(1)
            emit({"end": job.name, "t": time.time()})
            await job.done(job.name)

        await job.with_lock("test", 2, locked)

    worker = registration(Worker())
    await worker.connect(transport(addr))
    await worker.add_func("echo", echo)
    await worker.add_func("echo_later", echo_later)
    await worker.add_func("test_lock", test_lock)
    emit({"ready": True})
    await worker.work(10)


def text(value: Any) -> Any:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


async def run_client(addr: str) -> None:
    client = registration(Client())
    await client.connect(transport(addr))
    now = int(time.time())
    job = Job(func="echo", name="test_echo")
    job2 = Job(func="echo", name="test_echo2", sched_at=now + 10000, timeout=10)
    job3 = Job(func="echo", name="test_echo3", sched_at=now + 1)
    job4 = Job(func="echo2", name="test_echo3", sched_at=now + 1)
    job5 = Job(func="echo_later", name="test_echo_later")
    out: list[Any] = []
    out.append(await client.ping())
    out.append(await client.submit_job(job=job))
    out.append(text(await client.run_job(job=job)))
    out.append(await client.submit_job(job=job2))
    out.append(await client.remove_job("echo", "test_echo2"))
    out.append(text(await client.run_job(job=job3)))
    out.append(await client.submit_job(job=job4))
    out.append(await client.status())
    out.append(await client.drop_func("echo2"))
    out.append(await client.status())
    out.append(text(await client.run_job(job=job5)))
    try:
        out.append(text(await client.run_job(job=job4)))
    except Exception as exc:  # no worker for echo2
        out.append({"error": "%s: %s" % (type(exc).__name__, exc)})
    submitted = 0
    for i in range(100):
        submitted += bool(await client.submit_job(job=Job(func="test_lock", name="test_lock_%d" % i)))
    out.append(submitted)
    emit(out)
    os._exit(0)  # aio-periodic reconnects forever after close(); nothing more to do


def main() -> None:
    role, addr = sys.argv[1], sys.argv[2]
    if role == "worker":
        asyncio.run(run_worker(addr))
    else:
        asyncio.run(asyncio.wait_for(run_client(addr), 60))


if __name__ == "__main__":
    main()
