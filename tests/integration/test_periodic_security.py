"""The Periodic port's own security against a real coordinator: Periodic's RSA handshake
(--periodic-key, --periodic-authorized-keys) with the real aio-periodic 1.0.0 RSATransport
in every mode, and with raw frames for what aio-periodic would never send; periodicd
1.2.9's authenticated registration (types 3 and 4) with --auth-file, by raw frames
(aio-periodic 1.0.0 does not send it)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobmesh.client import CoordinatorClient
from jobmesh.periodic import codec as pc
from tests.support.waiting import wait_until
from tests.integration.periodic_support import EchoPeer, RawPeriodic, RsaPeer, client_ops, make_key_pair

pytest.importorskip("aio_periodic")
pytest.importorskip("cryptography")

MODES = {"Plain": 0, "RSA": 1, "AES": 2}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Keys as periodicd's CI makes them: the server's, two authorized peers' (one public
    key PKCS#1, one SubjectPublicKeyInfo, in a directory of *.pem) and a stranger's."""
    d = tmp_path_factory.mktemp("pki")
    server_private, server_public = make_key_pair(d, "server")
    client_private, client_public = make_key_pair(d, "client", "pkcs1")
    worker_private, worker_public = make_key_pair(d, "worker", "spki")
    stranger_private, _ = make_key_pair(d, "stranger")
    authorized = d / "authorized"
    authorized.mkdir()
    shutil.copy(client_public, authorized / "client.pem")
    shutil.copy(worker_public, authorized / "worker.pem")
    return SimpleNamespace(server_private=server_private, server_public=server_public, client=client_private,
                           worker=worker_private, stranger=stranger_private, authorized=authorized)


@pytest.fixture(scope="module")
def keyed(module_coordinators, pki):
    """A coordinator whose Periodic port starts every connection with the RSA handshake; the
    module's tests share it, each with funcs of its own."""
    return module_coordinators(periodic_port=0, periodic_key=pki.server_private,
                               periodic_authorized_keys=pki.authorized)


@pytest.fixture
def echo_peers():
    started: list[EchoPeer] = []

    def start(role, addr, env):
        peer = EchoPeer(role, addr, env)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.kill()


def env_for(mode: str, pki, private) -> dict[str, str]:
    return {"PERIODIC_MODE": mode, "PERIODIC_CLIENT_PRIVATE_KEY": str(private),
            "PERIODIC_SERVER_PUBLIC_KEY": str(pki.server_public)}


def key_refused(addr, peer: RsaPeer) -> bool:
    """Whether the coordinator closes the connection, without a byte, at the peer's first block."""
    sock = socket.create_connection(addr, timeout=10)
    try:
        sock.sendall(peer.hello())
        return sock.recv(4096) == b""
    finally:
        sock.close()


def funcs(status: dict) -> dict[str, tuple[int, int]]:
    return {name: (row["worker_count"], row["job_count"]) for name, row in status.items()}


@pytest.mark.parametrize("mode", ["Normal", "Plain", "RSA", "AES"])
def test_aio_periodic_ci_sequence_in_every_mode(coordinator_factory, pki, echo_peers, mode):
    # Given a coordinator (with the RSA handshake unless Normal) and aio-periodic's echo
    # worker, with the key whose public half is SubjectPublicKeyInfo
    if mode == "Normal":
        coord = coordinator_factory(periodic_port=0)
    else:
        coord = coordinator_factory(periodic_port=0, periodic_key=pki.server_private,
                                    periodic_authorized_keys=pki.authorized)
    worker = echo_peers("worker", coord.periodic_addr, env_for(mode, pki, pki.worker))
    assert worker.next() == {"ready": True}
    # When aio-periodic's echo client runs its steps, with the PKCS#1 key
    client = echo_peers("client", coord.periodic_addr, env_for(mode, pki, pki.client))
    out = client.next(60)
    assert client.exit_code() == 0
    # Then every step answers as periodicd's do
    assert out[:7] == [True, True, "test_echo", True, True, "test_echo3", True]
    assert funcs(out[7]) == {"echo": (1, 0), "echo2": (0, 1), "echo_later": (1, 0), "test_lock": (1, 0)}
    assert out[8] is True
    assert funcs(out[9]) == {"echo": (1, 0), "echo_later": (1, 0), "test_lock": (1, 0)}
    # echo_later's SCHED_LATER ends a RUN_JOB as "failed" (periodicd's answer); echo2 has no worker
    assert out[10:] == ["failed", {"error": "Exception: no worker"}, 100]
    # And the 100 test_lock jobs run at most two at a time (the lock "test" of 2)
    running = most = ended = 0
    while ended < 4:
        line = worker.next()
        running += 1 if "start" in line else -1
        ended += "end" in line
        most = max(most, running)
    assert most == 2


@pytest.mark.parametrize("mode", ["Plain", "RSA", "AES"])
def test_large_frames_and_streams_in_every_mode(keyed, pki, periodic_peers, mode):
    # A 96 KB workload crosses many RSA blocks (or one AES message) each way, and a
    # stream's paced frames go through the mode too.
    big, chunks = "big-" + mode, "chunks-" + mode
    worker = periodic_peers(keyed.periodic_addr, big, env=env_for(mode, pki, pki.worker))
    streamer = periodic_peers(keyed.periodic_addr, chunks, "stream", env=env_for(mode, pki, pki.worker))
    workload = "0123456789abcdef" * 6_000  # under the 128 KiB of one command-line argument
    out = client_ops(keyed.periodic_addr, ["run", big, "b1", workload, 30], ["run_stream", chunks, "s1", "x", 30],
                     env=env_for(mode, pki, pki.client))
    assert out[0]["data"] == "done:" + workload
    assert (out[1]["data"], out[1]["chunks"]) == ("end", ["c1", "c2", "c3"])
    assert worker.next()["name"] == "b1" and streamer.next()["name"] == "s1"


def test_a_peer_whose_key_is_not_authorized_is_closed(keyed, pki, echo_peers):
    # Given a stranger's key: its first block names a fingerprint the server does not know
    # Then the connection is closed without a byte
    assert key_refused(keyed.periodic_addr, RsaPeer(pki.stranger, pki.server_public, 2))
    # And aio-periodic's RSATransport with that key cannot connect
    refused = echo_peers("client", keyed.periodic_addr, env_for("AES", pki, pki.stranger))
    assert refused.exit_code() != 0
    # While an authorized peer is served, in each mode
    for mode in MODES.values():
        good = RawPeriodic(keyed.periodic_addr, secure=RsaPeer(pki.client, pki.server_public, mode))
        assert good.ping()
        good.close()
    assert "not authorized" in keyed.stderr()


def test_a_peer_without_the_handshake_is_closed_at_once(keyed, pki):
    # A plain aio-periodic Transport writes its registration and waits for the answer
    for frame in (pc.encode_handshake(pc.ConnType.CLIENT), pc.encode_handshake(pc.ConnType.WORKER, b"w", b"t")):
        sock = socket.create_connection(keyed.periodic_addr, timeout=10)
        sock.sendall(frame)
        assert sock.recv(4096) == b""  # well before the handshake's time limit (120 s)
        sock.close()


def test_the_modes_really_seal_the_frames(keyed, pki):
    # The bytes on the wire in RSA and AES mode are not the frames: the server's answers
    # only make sense after opening them with the peer's key or the session key.
    for mode in (1, 2):
        peer = RsaPeer(pki.client, pki.server_public, mode)
        sock = socket.create_connection(keyed.periodic_addr, timeout=10)
        peer.handshake(sock)
        sock.sendall(peer.seal(pc.encode_handshake(pc.ConnType.CLIENT) + pc.encode_request(pc.Ping(5))))
        wire = b""
        decoder = pc.PacketDecoder(pc.MAGIC_RES)
        bodies: list[bytes] = []
        while len(bodies) < 2:
            data = sock.recv(65536)
            assert data, "closed"
            wire += data
            decoder.feed(peer.open(data))
            while (body := decoder.next_packet()) is not None:
                bodies.append(body)
        assert pc.MAGIC_RES not in wire
        assert pc.decode_reply(bodies[1]) == pc.Pong(5)
        sock.close()


@pytest.mark.parametrize("argv, message", [
    (["--periodic-key=K"], "--periodic-key and --periodic-authorized-keys go together"),
    (["--periodic-key=%(server)s", "--periodic-authorized-keys=%(missing)s"],
     "--periodic-authorized-keys %(missing)s: cannot read it"),
    (["--periodic-key=%(public)s", "--periodic-authorized-keys=%(dir)s"],
     "--periodic-key %(public)s: not an unencrypted PEM private key"),
    (["--periodic-key=%(server)s", "--periodic-authorized-keys=%(server)s"],
     "--periodic-authorized-keys %(server)s: no RSA public key in it"),
])
def test_bad_key_flags_are_one_line_errors(pki, tmp_path, argv, message):
    names = {"server": pki.server_private, "public": pki.server_public, "dir": pki.authorized,
             "missing": tmp_path / "nope.pem"}
    args = [a % names for a in argv]
    proc = subprocess.run([sys.executable, "-m", "jobmesh", "coordinator", "--worker-port=0", "--client-port=0",
                           "--periodic-port=0", "--db=%s" % (tmp_path / "db"), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message % names in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "listening" not in proc.stdout


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, pki):
    """One keyed coordinator for every fuzzing example (started once: hypothesis runs the
    test body many times within one function-scoped fixture's life)."""
    from tests.support.processes import CoordinatorProc

    proc = CoordinatorProc(tmp_path_factory.mktemp("fuzz"), periodic_port=0, periodic_key=pki.server_private,
                           periodic_authorized_keys=pki.authorized, idle_timeout_millis=2000)
    proc.start()
    yield proc
    proc.cleanup()


def first_bytes(pki):
    """Random bytes; a valid first block then random bytes; a frame-looking start."""
    hello = RsaPeer(pki.client, pki.server_public, 2).hello()
    return st.one_of(
        st.binary(min_size=1, max_size=700),
        st.binary(max_size=600).map(lambda tail: hello + tail),
        st.binary(max_size=40).map(lambda tail: pc.MAGIC_REQ + tail),
        st.integers(1, 255).map(lambda n: hello[:n]),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzing_the_handshakes_first_bytes(fuzzed, pki, data):
    # Given one connection that sends arbitrary first bytes and hangs up, or stays
    sent = data.draw(first_bytes(pki))
    bad = socket.create_connection(fuzzed.periodic_addr, timeout=10)
    try:
        bad.sendall(sent)
    except OSError:
        pass  # closed already
    # Then an authorized peer, in a mode of its choosing, is served meanwhile
    mode = data.draw(st.sampled_from([0, 1, 2]))
    good = RawPeriodic(fuzzed.periodic_addr, secure=RsaPeer(pki.client, pki.server_public, mode), timeout=10)
    assert good.ping()
    good.close()
    bad.close()
    assert fuzzed.proc.poll() is None


# ---- periodicd 1.2.9's authenticated registration (types 3 and 4) with --auth-file -------------


def make_tokens(directory) -> SimpleNamespace:
    """An auth file with a token of each role (and a client limited to the funcs team.*)."""
    from jobmesh.auth import new_token

    path = directory / "auth.toml"
    made = {role: new_token(str(path), "p-" + role, role) for role in ("worker", "reader", "client", "admin")}
    made["team"] = new_token(str(path), "p-team", "client", ("team.*",))
    made["team-worker"] = new_token(str(path), "p-team-worker", "worker", ("team.*",))
    return SimpleNamespace(path=path, **{k.replace("-", "_"): v.encode() for k, v in made.items()})


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def tokened(module_coordinators, tokens):
    """A coordinator with tokens on its Periodic port (``tokens``' auth file); the module's
    tests share it, each with funcs of its own (its failed registrations, a few per test,
    stay under the count that slows an address down)."""
    return module_coordinators(periodic_port=0, auth_file=tokens.path)


def refused(addr, frame: bytes, secure: RsaPeer | None = None) -> bool:
    """Whether the coordinator closes the connection after ``frame`` without a byte."""
    sock = socket.create_connection(addr, timeout=10)
    try:
        if secure is not None:
            secure.handshake(sock)
            frame = secure.seal(frame)
        sock.sendall(frame)
        return sock.recv(4096) == b""
    finally:
        sock.close()


def auth(addr, kind, name: str, token: bytes, secure: RsaPeer | None = None) -> RawPeriodic:
    return RawPeriodic(addr, kind, name=name.encode(), token=token, secure=secure)


def test_authenticated_registration_with_raw_frames(tokened, tokens):
    coord = tokened
    addr = coord.periodic_addr
    # Given a worker with a worker token (type 4) and a client with a client token (type 3)
    worker = auth(addr, pc.ConnType.WORKER, "p-worker", tokens.worker)
    assert worker.request(pc.CanDo(worker.next_msgid(), b"echo")) == pc.Success(worker.msgid)
    client = auth(addr, pc.ConnType.CLIENT, "p-client", tokens.client)
    assert client.status()["echo"].workers == 1
    # When the client submits, the worker grabs and finishes the job
    job = pc.Job(b"echo", b"j1", b"hi", 0, 0, 10)
    assert client.request(pc.SubmitJob(client.next_msgid(), job)) == pc.Success(client.msgid)
    assert worker.request(pc.GrabJob(worker.next_msgid())) == pc.Success(worker.msgid)  # a grab token
    assign = worker.reply(10)
    assert isinstance(assign, pc.JobAssign) and assign.job.name == b"j1"
    assert worker.request(pc.WorkDone(worker.next_msgid(), pc.Handle(b"echo", b"j1"), b"done")) \
        == pc.Success(worker.msgid)
    # Then the job is gone from the queue; an admin token registers as a client too
    admin = auth(addr, pc.ConnType.CLIENT, "p-admin", tokens.admin)
    wait_until(lambda: admin.status()["echo"].jobs == 0, timeout=10)
    # And the JSON ports show who submitted it: the client token's name
    with CoordinatorClient(*coord.client_addr, token=tokens.reader.decode()) as reader:
        [job] = [j for j in reader.list_jobs(limit=100)[0] if j.get("name") == "j1"]
        assert job["state"] == "COMPLETED" and job["submittedBy"] == "p-client", job
    # A worker token may not act as a client, nor a client token as a worker
    assert client.request(pc.GrabJob(client.next_msgid())) == pc.NoWorker(client.msgid)
    for conn in (worker, client, admin):
        assert conn.ping()
        conn.close()


def test_a_reader_token_may_only_ping_and_status(tokened, tokens):
    reader = auth(tokened.periodic_addr, pc.ConnType.CLIENT, "p-reader", tokens.reader)
    assert reader.ping()
    before = reader.status()
    assert "read" not in before
    job = pc.Job(b"read", b"j1", b"", 0, 0, 0)
    for msg in (pc.SubmitJob(reader.next_msgid(), job), pc.RunJob(reader.next_msgid(), job),
                pc.DropFunc(reader.next_msgid(), b"read"), pc.RemoveJob(reader.next_msgid(), pc.Handle(b"read", b"j1")),
                pc.ConfigGet(reader.next_msgid(), b"timeout"), pc.Dump(reader.next_msgid())):
        assert reader.request(msg) == pc.NoWorker(msg.msgid), msg
    assert reader.ping() and reader.status() == before  # nothing reached the core; still open
    reader.close()


def test_wrong_tokens_and_roles_are_closed_without_a_reply(tokened, tokens):
    coord = tokened
    addr = coord.periodic_addr
    hs = pc.encode_handshake
    assert refused(addr, hs(pc.ConnType.CLIENT, b"p-client", b"not-the-token"))
    assert refused(addr, hs(pc.ConnType.CLIENT, b"p-admin", tokens.client))  # right token, wrong name
    assert refused(addr, hs(pc.ConnType.CLIENT, b"p-worker", tokens.worker))  # a worker token as a client
    assert refused(addr, hs(pc.ConnType.WORKER, b"p-client", tokens.client))  # only a worker token for type 4
    assert refused(addr, hs(pc.ConnType.WORKER, b"p-admin", tokens.admin))
    assert refused(addr, hs(pc.ConnType.WORKER, b"p-reader", tokens.reader))
    # With tokens on, a plain registration needs the RSA handshake
    assert refused(addr, hs(pc.ConnType.CLIENT))
    assert refused(addr, hs(pc.ConnType.WORKER))
    # And the right token still registers
    assert auth(addr, pc.ConnType.WORKER, "p-worker", tokens.worker).ping()
    assert "wrong token name or token" in coord.stderr() and tokens.client.decode() not in coord.stderr()


def test_task_types_limit_a_tokens_funcs(tokened, tokens):
    addr = tokened.periodic_addr
    worker = auth(addr, pc.ConnType.WORKER, "p-team-worker", tokens.team_worker)
    assert worker.request(pc.CanDo(worker.next_msgid(), b"other")) == pc.NoWorker(worker.msgid)
    assert worker.request(pc.CanDo(worker.next_msgid(), b"team.echo")) == pc.Success(worker.msgid)
    client = auth(addr, pc.ConnType.CLIENT, "p-team", tokens.team)
    assert "team.echo" in client.status()
    assert "other" not in client.status()
    ours, theirs = pc.Job(b"team.echo", b"a", b"", 0, 0, 0), pc.Job(b"other", b"a", b"", 0, 0, 0)
    assert client.request(pc.SubmitJob(client.next_msgid(), ours)) == pc.Success(client.msgid)
    for msg in (pc.SubmitJob(client.next_msgid(), theirs), pc.RunJob(client.next_msgid(), theirs),
                pc.DropFunc(client.next_msgid(), b"other"), pc.RemoveJob(client.next_msgid(), pc.Handle(b"other", b"a")),
                pc.Load(client.next_msgid(), (theirs,)),
                pc.Load(client.next_msgid(), (pc.Job(b"team.echo", b"b", b"", 0, 0, 0), theirs))):
        assert client.request(msg) == pc.NoWorker(msg.msgid), msg
    # a LOAD of its own funcs' jobs is taken; one naming another func loaded nothing
    ours_too = pc.Job(b"team.echo", b"c", b"", 0, 0, 0)
    assert client.request(pc.Load(client.next_msgid(), (ours_too,))) == pc.Success(client.msgid)
    admin = auth(addr, pc.ConnType.CLIENT, "p-admin", tokens.admin)
    dump = admin.request(pc.Dump(admin.next_msgid()))
    names = {(job.func, job.name) for job in pc.decode_jobs(dump.data)}
    assert {(b"team.echo", b"a"), (b"team.echo", b"c")} <= names and (b"team.echo", b"b") not in names, names
    assert not any(func == b"other" for func, _ in names), names


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, pki):
    """One coordinator with tokens and the RSA handshake both on (``coord``), and a worker
    and a client token of its auth file (``worker``, ``client``, as bytes)."""
    from jobmesh.auth import new_token
    from tests.support.processes import CoordinatorProc

    d = tmp_path_factory.mktemp("guarded")
    path = d / "auth.toml"
    made = {role: new_token(str(path), "g-" + role, role).encode() for role in ("worker", "client")}
    proc = CoordinatorProc(d, periodic_port=0, auth_file=path, periodic_key=pki.server_private,
                           periodic_authorized_keys=pki.authorized)
    proc.start()
    yield SimpleNamespace(coord=proc, **made)
    proc.cleanup()


def closed_without_a_reply(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:  # closed with our pipelined frames unread
        return True


def outsiders_handshake(sock: socket.socket, pki) -> None:
    """Periodic's RSA handshake as an outsider completes it holding no private key: only the
    coordinator's public key and an authorized peer's, both public by nature. It names the
    peer's fingerprint, cannot open the answer (sealed for the peer) and ignores it, and
    chooses Plain."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding

    server = serialization.load_pem_public_key(pki.server_public.read_bytes())
    peer = serialization.load_pem_public_key((pki.authorized / "client.pem").read_bytes())
    oaep = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
    sock.sendall(server.encrypt(RsaPeer.fingerprint(peer), oaep))
    answer = b""
    while len(answer) < peer.key_size // 8:
        data = sock.recv(4096)
        assert data, "closed during the handshake"
        answer += data
    sock.sendall(server.encrypt(bytes([MODES["Plain"]]), oaep))


def test_the_rsa_handshake_alone_admits_no_one(guarded, pki):
    addr = guarded.coord.periodic_addr
    job = pc.Job(b"stolen", b"j1", b"x", 0, 0, 0)
    for kind in (pc.ConnType.CLIENT, pc.ConnType.WORKER):
        # Given an outsider through the RSA handshake with only public keys
        sock = socket.create_connection(addr, timeout=10)
        try:
            outsiders_handshake(sock, pki)
            # When it registers without a token (type 1 or 2) and submits and dumps at once
            sock.sendall(pc.encode_handshake(kind) + pc.encode_request(pc.SubmitJob(1, job))
                         + pc.encode_request(pc.Dump(2)))
            # Then it is closed without a reply
            assert closed_without_a_reply(sock), kind
        finally:
            sock.close()
    # And nothing it sent was applied
    client = auth(addr, pc.ConnType.CLIENT, "g-client", guarded.client, RsaPeer(pki.client, pki.server_public, 0))
    assert "stolen" not in client.status()
    assert "a registration without one (type 1 or 2) is refused" in guarded.coord.stderr()


def test_tokens_after_the_rsa_handshake(guarded, pki, echo_peers):
    addr = guarded.coord.periodic_addr
    # A peer that passed the RSA handshake registers with its token (3 or 4), in any mode
    for mode in MODES.values():
        assert auth(addr, pc.ConnType.WORKER, "g-worker", guarded.worker, RsaPeer(pki.worker, pki.server_public, mode)).ping()
        assert auth(addr, pc.ConnType.CLIENT, "g-client", guarded.client, RsaPeer(pki.client, pki.server_public, mode)).ping()
    # Without one (1 or 2) it is closed in every mode, the authorized key's true holder too;
    # so is a wrong token
    for mode, kind in ((0, pc.ConnType.CLIENT), (1, pc.ConnType.WORKER), (2, pc.ConnType.CLIENT)):
        assert refused(addr, pc.encode_handshake(kind), RsaPeer(pki.client, pki.server_public, mode))
    assert refused(addr, pc.encode_handshake(pc.ConnType.CLIENT, b"g-client", b"wrong"),
                   RsaPeer(pki.client, pki.server_public, 2))
    # aio-periodic's echo worker and client run as in its CI, registering with their tokens
    def env(private, name: str, token: bytes) -> dict[str, str]:
        return {**env_for("AES", pki, private), "PERIODIC_TOKEN_NAME": name, "PERIODIC_TOKEN": token.decode()}

    worker = echo_peers("worker", addr, env(pki.worker, "g-worker", guarded.worker))
    assert worker.next() == {"ready": True}
    client = echo_peers("client", addr, env(pki.client, "g-client", guarded.client))
    out = client.next(60)
    assert out[:7] == [True, True, "test_echo", True, True, "test_echo3", True]
    assert out[10:] == ["failed", {"error": "Exception: no worker"}, 100]


def test_sighup_closes_the_connections_of_a_removed_token(coordinator_factory, tmp_path):
    from jobmesh.auth import remove_token

    tokens = make_tokens(tmp_path)  # of its own, and a coordinator of its own: it removes a token
    coord = coordinator_factory(periodic_port=0, auth_file=tokens.path)
    addr = coord.periodic_addr
    kept = auth(addr, pc.ConnType.CLIENT, "p-client", tokens.client)
    gone = auth(addr, pc.ConnType.WORKER, "p-worker", tokens.worker)
    remove_token(str(tokens.path), "p-worker")
    coord.proc.send_signal(signal.SIGHUP)
    assert gone.closed_within(10)
    assert kept.ping()
    assert refused(addr, pc.encode_handshake(pc.ConnType.WORKER, b"p-worker", tokens.worker))


def test_sighup_reads_the_authorized_keys_again(coordinator_factory, pki, tmp_path):
    from cryptography.hazmat.primitives import serialization

    # Given a coordinator accepting the client's and the worker's keys from a directory
    keys = tmp_path / "authorized"
    shutil.copytree(pki.authorized, keys)
    coord = coordinator_factory(periodic_port=0, periodic_key=pki.server_private, periodic_authorized_keys=keys)
    addr = coord.periodic_addr
    client = RawPeriodic(addr, secure=RsaPeer(pki.client, pki.server_public, 2))
    worker = RawPeriodic(addr, pc.ConnType.WORKER, secure=RsaPeer(pki.worker, pki.server_public, 0))
    stranger = RsaPeer(pki.stranger, pki.server_public, 2)
    assert key_refused(addr, stranger)
    # When the client's key is taken out, the stranger's put in, and SIGHUP sent
    (keys / "client.pem").unlink()
    stranger_public = serialization.load_pem_private_key(pki.stranger.read_bytes(), password=None).public_key()
    (keys / "stranger.pem").write_bytes(stranger_public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.PKCS1))
    coord.proc.send_signal(signal.SIGHUP)
    # Then the client's connection is closed, the worker's kept; a new handshake uses the new keys
    assert client.closed_within(10)
    assert worker.ping()
    assert key_refused(addr, RsaPeer(pki.client, pki.server_public, 1))
    assert RawPeriodic(addr, secure=stranger).ping()
    # And a directory that no longer loads is logged, the keys in force kept
    for pem in keys.glob("*.pem"):
        pem.unlink()
    coord.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "kept the Periodic authorized keys in force" in coord.stderr(), timeout=10)
    assert worker.ping() and RawPeriodic(addr, secure=stranger).ping()
