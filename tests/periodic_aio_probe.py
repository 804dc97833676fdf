"""Drive the real aio-periodic 1.0.0 Client and Worker against frames jobmesh's codec made.

Run only as a subprocess (``python tests/periodic_aio_probe.py < replies.json``): it uses
asyncio and imports aio_periodic, never jobmesh. stdin holds the server's frames as hex:

    {"connid": hex, "replies": {command byte: {msgid: hex}}, "assigns": [{msgid: hex}, ...]}

A fake transport hands every frame the peer writes to a responder that answers by the
command byte (offset 16) and msgid (offsets 12-16) of the frame; each GRAB_JOB gets the
next JOB_ASSIGN. stdout gets one JSON object: the frames each peer wrote (hex), the Client
API results, and what the Worker's tasks saw of the jobs aio-periodic decoded.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aio_periodic import Client, Worker
from aio_periodic.rsp import SchedLaterResponse
from aio_periodic.transport import BaseTransport

GRAB_JOB = 1


class Peer(BaseTransport):
    """Reader and writer of one fake connection; answers each written frame from the tables."""

    def __init__(self, server: dict) -> None:
        self.server = server
        self.assigns = list(server["assigns"])
        self.written: list[str] = []
        self.reader = asyncio.StreamReader()
        self.reader.feed_data(bytes.fromhex(server["connid"]))
        self.out_of_assigns = asyncio.Event()

    async def get(self):  # type: ignore[no-untyped-def]
        return self.reader, self

    def write(self, frame: bytes) -> None:
        self.written.append(frame.hex())
        if len(frame) < 17:
            return  # the handshake
        command, msgid = frame[16], str(int.from_bytes(frame[12:16], "big"))
        if command == GRAB_JOB:
            if self.assigns:
                self.answer(self.assigns.pop(0)[msgid])
            else:
                self.out_of_assigns.set()
        elif msgid in self.server["replies"].get(str(command), {}):
            self.answer(self.server["replies"][str(command)][msgid])

    def answer(self, hexed: str) -> None:
        asyncio.get_running_loop().call_soon(self.reader.feed_data, bytes.fromhex(hexed))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


async def run_client(server: dict) -> dict:
    peer = Peer(server)
    client = Client()
    await client.connect(peer)
    results = {
        "ping": await client.ping(),
        "submit": await client.submit_job("echo", "j1", b"hi", sched_at=1700000000, timeout=10),
        "submit_counted": await client.submit_job("echo", "j2", "text", count=3),
        "status": await client.status(),
        "run_job": (await client.run_job("echo", "j3", b"hi", timeout=10)).hex(),
        "remove": await client.remove_job("echo", "j1"),
        "drop": await client.drop_func("echo"),
    }
    try:
        await client.run_job("nobody", "j4")
        results["no_worker"] = "returned"
    except Exception as exc:  # aio-periodic raises a bare Exception('no worker')
        results["no_worker"] = str(exc)
    results["connid"] = client.connid.hex() if client.connid else None
    written = list(peer.written)  # close() makes aio-periodic reconnect and send its handshake again
    client.close()
    return {"written": written, "results": results}


async def run_worker(server: dict) -> dict:
    peer = Peer(server)
    worker = Worker()
    seen: list[dict] = []

    def remember(job) -> None:  # type: ignore[no-untyped-def]
        seen.append({"func": job.func_name, "name": job.name, "workload": job.workload.hex(),
                     "sched_at": job.sched_at, "timeout": job.timeout, "count": job.payload.count,
                     "handle": job.job_handle.hex()})

    async def echo(job):  # type: ignore[no-untyped-def]
        remember(job)
        await job.data(b"chunk")
        seen[-1]["acquired"] = await job.acquire("lk", 2)
        seen[-1]["released"] = await job.release("lk")
        return b"HI"

    async def later(job):  # type: ignore[no-untyped-def]
        remember(job)
        return SchedLaterResponse(30, 2)

    async def broken(job):  # type: ignore[no-untyped-def]
        remember(job)
        raise RuntimeError("task failed on purpose")

    worker.func("echo")(echo)
    worker.func("later")(later)
    worker.func("broken")(broken)
    await worker.connect(peer)
    work = asyncio.create_task(worker.work(1))
    await asyncio.wait_for(peer.out_of_assigns.wait(), 20)
    work.cancel()
    written = list(peer.written)
    worker.close()
    return {"written": written, "seen": seen, "connid": worker.connid.hex() if worker.connid else None}


async def main() -> None:
    servers = json.load(sys.stdin)
    out = {"client": await run_client(servers["client"]), "worker": await run_worker(servers["worker"])}
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
