"""Shared by the Periodic port's integration tests: real aio-periodic 1.0.0 peers (each in
its own asyncio subprocess, tests/periodic_aio_peer.py), a raw Periodic connection made
with jobmesh's codec, and the JSON port's view of Periodic jobs.

The fixtures ``coord`` and ``periodic_peers`` are in conftest.py."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path


from jobmesh.periodic import codec as pc
from tests.support.peers import Client

PEER = Path(__file__).resolve().parent.parent / "periodic_aio_peer.py"


class Peer:
    """An aio-periodic worker subprocess; ``next()`` returns the lines it printed, in order
    (one per job its task ran, see the peer's docstring)."""

    def __init__(self, addr, func: str, mode: str = "done", size: int = 1, lock: str | None = None,
                 broadcast: bool = False, env: dict[str, str] | None = None):
        args = [sys.executable, str(PEER), "worker", "%s:%d" % addr, func, mode, str(size)]
        if lock is not None:
            args.append("--lock=%s" % lock)
        if broadcast:
            args.append("--broadcast")
        self.func = func
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
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

    def __init__(self, addr, *ops, env: dict[str, str] | None = None):
        self.ops = ops
        self.proc = subprocess.Popen([sys.executable, str(PEER), "client", "%s:%d" % addr, json.dumps(ops)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})

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


def client_ops(addr, *ops, env: dict[str, str] | None = None) -> list:
    """Run aio-periodic Client operations to the end; their results, in order (``env``:
    PERIODIC_MODE and the key files, for the RSA handshake)."""
    return ClientOps(addr, *ops, env=env).result(30)


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
    (client = 1 or worker = 2; 3 or 4 given a ``token`` and its ``name``) is sent and its
    connection id read at once. With ``secure`` (an ``RsaPeer``), Periodic's RSA
    handshake comes first and every byte goes through its mode."""

    def __init__(self, addr, conn_type: pc.ConnType = pc.ConnType.CLIENT, timeout: float = 5.0,
                 name: bytes | None = None, token: bytes | None = None, secure: "RsaPeer | None" = None):
        self.sock = socket.create_connection(addr, timeout=timeout)
        self.decoder = pc.PacketDecoder(pc.MAGIC_RES)
        self.msgid = 0
        self.secure = secure
        if secure is not None:
            secure.handshake(self.sock)
        self.send_bytes(pc.encode_handshake(conn_type, name, token))
        self.conn_id = pc.decode_handshake_reply(self._body(timeout))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(self.secure.seal(data) if self.secure is not None else data)

    def _body(self, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        while (body := self.decoder.next_packet()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError("the coordinator closed the Periodic connection")
            self.decoder.feed(self.secure.open(data) if self.secure is not None else data)
        return body

    def next_msgid(self) -> int:
        self.msgid += 1
        return self.msgid

    def send(self, msg: pc.Message) -> None:
        self.send_bytes(pc.encode_request(msg))

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


# ---- RSA keys and the RSA handshake's peer side -------------------------------------------------


def make_key_pair(directory: Path, name: str, public: str = "pkcs1") -> tuple[Path, Path]:
    """A 2048-bit RSA key pair as periodicd's CI makes them: the private key PKCS#1
    (``BEGIN RSA PRIVATE KEY``), the public key PKCS#1 (``BEGIN RSA PUBLIC KEY``, with
    ``public="pkcs1"``) or SubjectPublicKeyInfo (``BEGIN PUBLIC KEY``, ``"spki"``).
    Made with the openssl command if there is one, else with cryptography."""
    private, pub = directory / (name + "_private.pem"), directory / (name + "_public.pem")
    if shutil.which("openssl"):
        raw = directory / (name + "_pkcs8.pem")
        subprocess.run(["openssl", "genrsa", "-out", str(raw), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(raw), "-traditional", "-out", str(private)],
                       check=True, capture_output=True)
        out = "-RSAPublicKey_out" if public == "pkcs1" else "-pubout"
        subprocess.run(["openssl", "rsa", "-in", str(private), out, "-out", str(pub)], check=True, capture_output=True)
        raw.unlink()
    else:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(65537, 2048)
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                              serialization.NoEncryption()))
        fmt = serialization.PublicFormat.PKCS1 if public == "pkcs1" else serialization.PublicFormat.SubjectPublicKeyInfo
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, fmt))
    marker = b"RSA PUBLIC KEY" if public == "pkcs1" else b"BEGIN PUBLIC KEY"
    assert marker in pub.read_bytes() and b"BEGIN RSA PRIVATE KEY" in private.read_bytes()
    return private, pub


class RsaPeer:
    """The peer's side of Periodic's RSA handshake and of its modes, written from the
    protocol (docs/PERIODIC.md) with cryptography, for raw-frame tests: ``mode`` is
    0 Plain, 1 RSA or 2 AES."""

    def __init__(self, private_path: Path, server_public_path: Path, mode: int):
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding

        self.private = serialization.load_pem_private_key(Path(private_path).read_bytes(), password=None)
        self.server = serialization.load_pem_public_key(Path(server_public_path).read_bytes())
        self.mode = mode
        self.key = os.urandom(32)
        self.oaep = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
        self.buf = b""

    @staticmethod
    def fingerprint(key) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return hashlib.sha256(key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)).digest()

    def hello(self) -> bytes:
        """The peer's first block: its fingerprint for the server's key."""
        return self.server.encrypt(self.fingerprint(self.private.public_key()), self.oaep)

    def handshake(self, sock: socket.socket) -> None:
        sock.sendall(self.hello())
        block = self.private.key_size // 8
        reply = b""
        while len(reply) < block:
            data = sock.recv(block - len(reply))
            if not data:
                raise AssertionError("the coordinator closed the connection during the RSA handshake")
            reply += data
        assert self.private.decrypt(reply, self.oaep) == self.fingerprint(self.server)
        sock.sendall(self.server.encrypt(bytes([self.mode]), self.oaep))
        if self.mode == 2:
            sock.sendall(self.server.encrypt(self.key, self.oaep))

    def _aes(self, iv: bytes):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        return Cipher(algorithms.AES(self.key), modes.CTR(iv))

    def seal(self, data: bytes) -> bytes:
        if self.mode == 1:
            step = self.server.key_size // 8 - 66
            return b"".join(self.server.encrypt(data[i : i + step], self.oaep) for i in range(0, len(data), step))
        if self.mode == 2:
            iv = os.urandom(16)
            enc = self._aes(iv).encryptor()
            body = iv + enc.update(data) + enc.finalize()
            return len(body).to_bytes(8, "big") + body
        return data

    def open(self, data: bytes) -> bytes:
        if self.mode == 0:
            return data
        self.buf += data
        out = []
        if self.mode == 1:
            block = self.private.key_size // 8
            while len(self.buf) >= block:
                out.append(self.private.decrypt(self.buf[:block], self.oaep))
                self.buf = self.buf[block:]
        else:
            while len(self.buf) >= 8 and len(self.buf) >= 8 + int.from_bytes(self.buf[:8], "big"):
                end = 8 + int.from_bytes(self.buf[:8], "big")
                dec = self._aes(self.buf[8:24]).decryptor()
                out.append(dec.update(self.buf[24:end]) + dec.finalize())
                self.buf = self.buf[end:]
        return b"".join(out)


# ---- aio-periodic's CI sequence (tests/periodic_aio_echo.py) ----------------------------------

ECHO = Path(__file__).resolve().parent.parent / "periodic_aio_echo.py"


class EchoPeer:
    """tests/periodic_aio_echo.py as a subprocess (``role`` worker or client), the
    transport chosen by ``env`` (PERIODIC_MODE and the key files); ``next()`` returns the
    JSON lines it prints, in order."""

    def __init__(self, role: str, addr, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, str(ECHO), role, "%s:%d" % addr], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float = 30.0):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError("the echo %s printed nothing within %.0fs; its stderr:\n%s"
                                 % (self.proc.args[2], timeout, self.proc.stderr.read()[-3000:])) from None

    def exit_code(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
