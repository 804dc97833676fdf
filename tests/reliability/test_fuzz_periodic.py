"""Fuzz the Periodic port of one real coordinator (FAILURE_MODEL.md, "Periodic peers").

Each example opens a fresh Periodic connection (client or worker handshake), sends a
sequence of things, closes its sending side and reads until the coordinator closes:
random bytes; well-framed bodies with a random command byte and payload; or well-formed
requests of every kind with random field values (any bytes as func, name and lock,
extreme integers, small funcs shared between examples so that jobs, workers, locks and
waits meet). Every example must end with the connection closed, having received only
well-formed Periodic frames (the connection id first); and on their own connections a
Periodic client and a JSON client must still be served.
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jobmesh.errors import PeriodicError
from jobmesh.periodic import codec as pc
from tests.support.peers import Client
from tests.support.processes import CoordinatorProc
from tests.integration.periodic_support import RawPeriodic
from tests.reliability.test_fuzz_ports import PROFILE

CLOSE_SECONDS = 10.0


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    proc = CoordinatorProc(tmp_path_factory.mktemp("pfuzz"), periodic_port=0, task_timeout_millis=2000)
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture(scope="module")
def bystanders(coord):
    json_client = Client(coord.client_addr)
    job_id = json_client.submit_ok("SLEEP", {"durationMillis": 1}, delayMillis=10 ** 10)
    periodic = RawPeriodic(coord.periodic_addr)
    yield json_client, job_id, periodic
    json_client.close()
    periodic.sock.close()


def still_served(coord, bystanders) -> None:
    json_client, job_id, periodic = bystanders
    assert coord.proc.poll() is None, "the coordinator exited:\n%s" % coord.stderr()[-3000:]
    assert json_client.status(job_id)["jobId"] == job_id
    assert periodic.ping()


def exchange(addr, conn_type: int, data: bytes) -> None:
    """Handshake, ``data``, close the sending side, read to the end: only legal frames."""
    sock = socket.create_connection(addr, timeout=CLOSE_SECONDS)
    try:
        sock.sendall(pc.encode_handshake(pc.ConnType(conn_type)))
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # closed on us already
        decoder = pc.PacketDecoder(pc.MAGIC_RES)
        bodies = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            decoder.feed(chunk)
            while (body := decoder.next_packet()) is not None:
                bodies.append(body)
        assert decoder.next_packet() is None
        assert bodies, "no connection id"
        pc.decode_handshake_reply(bodies[0])
        for body in bodies[1:]:
            pc.decode_reply(body)  # raises on anything malformed
    finally:
        sock.close()


# ---- strategies ------------------------------------------------------------------------------

# Mostly a few shared valid names (so jobs, workers, locks and waits meet); sometimes any bytes.
names = st.one_of(st.sampled_from([b"f", b"g", b"L", b""]), st.sampled_from([b"f", b"g"]),
                  st.text(max_size=6).map(str.encode), st.binary(max_size=12))
ints = {
    "i16": st.integers(-(1 << 15), (1 << 15) - 1),
    "i32": st.integers(-(1 << 31), (1 << 31) - 1),
    "i64": st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-5, 5)),
    "u32": st.integers(0, 0xFFFFFFFF),
}
handles = st.builds(pc.Handle, names, names)
jobs = st.builds(pc.Job, names, names, st.binary(max_size=64), ints["i64"], st.integers(-3, 3) | ints["i32"],
                 st.integers(-3, 5) | ints["i32"])
FIELD = {"handle": handles, "str8": names, "rest": st.binary(max_size=64), "job": jobs,
         "jobs": st.lists(jobs, max_size=3).map(tuple), **ints}


@st.composite
def requests(draw) -> bytes:
    """A well-formed request of any kind, with random field values, as a frame."""
    cls = draw(st.sampled_from(sorted(pc.REQUESTS.values(), key=lambda c: c.COMMAND)))
    msgid = draw(st.integers(0, 0xFFFFFFFF))
    msg = cls(msgid, *(draw(FIELD[kind]) for kind in cls.LAYOUT))
    try:
        return pc.encode_request(msg)
    except PeriodicError:
        assume(False)
        raise


@st.composite
def random_bodies(draw) -> bytes:
    """A correctly framed body (magic, size, CRC) of a random command and payload."""
    body = draw(st.binary(min_size=4, max_size=4)) + bytes([draw(st.integers(0, 40))]) + draw(st.binary(max_size=40))
    return pc.encode_frame(body, pc.MAGIC_REQ)


# ---- the tests ---------------------------------------------------------------------------------


@settings(PROFILE)
@given(conn_type=st.sampled_from([1, 2]), data=st.binary(max_size=200))
def test_random_bytes(coord, bystanders, conn_type, data):
    exchange(coord.periodic_addr, conn_type, data)
    still_served(coord, bystanders)


@settings(PROFILE)
@given(conn_type=st.sampled_from([1, 2]), frames=st.lists(random_bodies(), min_size=1, max_size=5))
def test_random_well_framed_bodies(coord, bystanders, conn_type, frames):
    exchange(coord.periodic_addr, conn_type, b"".join(frames))
    still_served(coord, bystanders)


@settings(PROFILE)
@given(conn_type=st.sampled_from([1, 2]), frames=st.lists(requests(), min_size=1, max_size=12))
def test_well_formed_requests_with_random_values(coord, bystanders, conn_type, frames):
    exchange(coord.periodic_addr, conn_type, b"".join(frames))
    still_served(coord, bystanders)
