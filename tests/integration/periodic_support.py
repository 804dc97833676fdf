"""Shared by the Periodic port's integration tests: real aio-periodic 1.0.0 peers (each in
its own asyncio subprocess, tests/periodic_aio_peer.py), a raw Periodic connection made
with jobmesh's codec, and the JSON port's view of Periodic jobs.

The fixtures ``coord`` and ``periodic_peers`` are in conftest.py."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path


from jobmesh.periodic import codec as pc
from tests.helpers import Client

PEER = Path(__file__).resolve().parent.parent / "periodic_aio_peer.py"


class Peer:
    """An aio-periodic worker subprocess; ``next()`` returns the lines it printed, in order
    (one per job its task ran, see the peer's docstring)."""

    def __init__(self, addr, func: str, mode: str = "done", size: int = 1, lock: str | None = None,
                 broadcast: bool = False):
        args = [sys.executable, str(PEER), "worker", "%s:%d" % addr, func, mode, str(size)]
        if lock is not None:
            args.append("--lock=%s" % lock)
        if broadcast:
            args.append("--broadcast")
        self.func = func
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def wait_ready(self, timeout: float = 10.0) -> "Peer":
        line = self.next(timeout)
        assert line == {"ready": True}, line
        return self

    def next(self, timeout: float = 10.0) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the %s worker (pid %d) printed nothing within %.1fs"
                                 % (self.func, self.proc.pid, timeout)) from None

    def drain(self) -> list[dict]:
        """The lines printed so far and not yet read (no waiting)."""
        out = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out

    def none_within(self, seconds: float) -> bool:
        try:
            self.lines.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


class ClientOps:
    """aio-periodic Client operations (the peer's OPS) in a subprocess of their own, started at
    once; ``result()`` waits for the list of their results."""

    def __init__(self, addr, *ops):
        self.ops = ops
        self.proc = subprocess.Popen([sys.executable, str(PEER), "client", "%s:%d" % addr, json.dumps(ops)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self, timeout: float = 30.0) -> list:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("client ops %r did not finish within %.0fs" % (self.ops, timeout)) from None
        assert self.proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        if not self.proc.stdout.closed:  # not collected yet
            self.proc.communicate(timeout=5)


def client_ops(addr, *ops) -> list:
    """Run aio-periodic Client operations to the end; their results, in order."""
    return ClientOps(addr, *ops).result(30)


class PeerSet:
    """Made by the ``periodic_peers`` fixture: ``periodic_peers(addr, func, mode, size, lock=, broadcast=)`` starts
    a worker and waits until its func is declared; ``several`` starts n alike at once;
    ``client(addr, *ops)`` runs client operations in the background. All end at teardown."""

    def __init__(self) -> None:
        self._all: list[Peer | ClientOps] = []

    def __call__(self, addr, func: str, mode: str = "done", size: int = 1, **options) -> Peer:
        return self.several(1, addr, func, mode, size, **options)[0]

    def several(self, n: int, addr, func: str, mode: str = "done", size: int = 1, **options) -> list[Peer]:
        started = [Peer(addr, func, mode, size, **options) for _ in range(n)]
        self._all.extend(started)
        return [peer.wait_ready() for peer in started]

    def client(self, addr, *ops) -> ClientOps:
        ops_proc = ClientOps(addr, *ops)
        self._all.append(ops_proc)
        return ops_proc

    def close(self) -> None:
        for p in self._all:
            p.kill()


def periodic_jobs(coord) -> list[dict]:
    return [j for j in Client(coord.client_addr).list_jobs()["jobs"] if j["protocol"] == "periodic"]


def job_named(coord, func: str, name: str) -> dict:
    found = [j for j in periodic_jobs(coord) if j["taskType"] == func and j["name"] == name]
    assert found, (func, name)
    return found[0]


def closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True if the peer closes ``sock`` within ``timeout`` (bytes before the close are skipped)."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


class RawPeriodic:
    """A Periodic connection by hand (a stdlib socket and jobmesh's codec): the handshake
    (client = 1 or worker = 2) is sent and its connection id read at once."""

    def __init__(self, addr, conn_type: pc.ConnType = pc.ConnType.CLIENT, timeout: float = 5.0):
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.decoder = pc.PacketDecoder(pc.MAGIC_RES)
        self.msgid = 0
        self.sock.sendall(pc.encode_handshake(conn_type))
        self.conn_id = pc.decode_handshake_reply(self._body(timeout))

    def _body(self, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        while (body := self.decoder.next_packet()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError("the coordinator closed the Periodic connection")
            self.decoder.feed(data)
        return body

    def next_msgid(self) -> int:
        self.msgid += 1
        return self.msgid

    def send(self, msg: pc.Message) -> None:
        self.sock.sendall(pc.encode_request(msg))

    def reply(self, timeout: float = 5.0) -> pc.Reply:
        return pc.decode_reply(self._body(timeout))

    def request(self, msg: pc.Message, timeout: float = 5.0) -> pc.Reply:
        self.send(msg)
        return self.reply(timeout)

    def ping(self) -> bool:
        msgid = self.next_msgid()
        return self.request(pc.Ping(msgid)) == pc.Pong(msgid)

    def status(self) -> dict[str, pc.FuncStatus]:
        """STATUS, by func."""
        msgid = self.next_msgid()
        reply = self.request(pc.Status(msgid))
        assert isinstance(reply, pc.Data) and reply.msgid == msgid, reply
        return {row.func.decode(): row for row in pc.parse_status(reply.data)}

    def closed_within(self, timeout: float) -> bool:
        return closed(self.sock, timeout)

    def close(self) -> None:
        self.sock.close()
