"""TLS on the worker, client and metrics ports, against real coordinators, real worker
processes and the CLI, with certificates the tests make (tests/tls_support.py)."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import ssl
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from jobmesh.client import CoordinatorClient
from jobmesh.errors import ConfigError, CoordinatorUnavailable, RequestFailed
from jobmesh.protocol.framing import FrameReader, encode_frame
from tests.support.cli import run_cli
from tests.support.peers import wait_no_worker, wait_registered
from tests.support.processes import closed_address
from tests.support.waiting import wait_until
from tests.tls_support import make_certs

HANDSHAKE_MILLIS = 500


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_flags(certs) -> dict:
    return dict(tls_cert=certs.server, tls_key=certs.server_key, metrics_port=0,
                tls_handshake_timeout_millis=HANDSHAKE_MILLIS)


@pytest.fixture(scope="module")
def tls_coordinator(module_coordinators, certs):
    """The TLS coordinator the module's tests share: each test's worker has an id of its own,
    a test that counts workers first waits until the earlier tests' workers are gone, and a
    test that lists jobs looks for its own."""
    return module_coordinators(**tls_flags(certs))


@pytest.fixture(scope="module")
def loaded_coordinator(module_coordinators, certs):
    """A TLS coordinator of the tests that fill a socket with the replies about a thousand
    queued jobs; they share it (the same idempotency keys name the same jobs), and no worker
    ever joins it to run them."""
    return module_coordinators(**tls_flags(certs))


@pytest.fixture(scope="module")
def mtls_coordinator(module_coordinators, certs):
    """Clients and workers must present a certificate the test CA signed."""
    return module_coordinators(tls_cert=certs.server, tls_key=certs.server_key, tls_client_ca=certs.ca)


def tls_socket(addr, certs, cert=None, key=None, rcvbuf: int | None = None) -> ssl.SSLSocket:
    """A stdlib TLS connection to ``addr`` trusting the test CA."""
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(addr)
    return context.wrap_socket(sock, server_hostname=addr[0])


def closed_by_peer(sock: socket.socket, timeout: float = 20.0) -> bool:
    """True once the peer closes (EOF or reset); False if it still holds the connection after ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def unsent_by_peer(sock: socket.socket) -> int:
    """Bytes the peer's (IPv4, same host) end of this connection holds in its send queue."""
    here, there = sock.getsockname()[1], sock.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
            if (local, remote) == (there, here):
                return int(fields[4].split(":")[0], 16)
    return 0


def wait_until_full(sock: socket.socket) -> None:
    """Wait until the coordinator's side of this connection is full: its send queue holds a
    megabyte or more and no longer grows (its writes then wait in the coordinator)."""
    seen = [-1]

    def full() -> bool:
        queued, before = unsent_by_peer(sock), seen[0]
        seen[0] = queued
        return queued >= 1024 * 1024 and queued == before

    wait_until(full, timeout=30, interval=0.3, message="the coordinator's socket full")


def submit_frames(count: int) -> bytes:
    """``count`` SUBMIT_JOBs, each with a long idempotency key (so that listings are large)."""
    return b"".join(encode_frame({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {"durationMillis": 1},
                                  "maxAttempts": 1, "idempotencyKey": "%s-%d" % ("k" * 200, i)})
                    for i in range(count))


# ---- clients, workers and the CLI -----------------------------------------------------


def test_a_worker_process_and_the_library_run_a_job_over_tls(tls_coordinator, worker_procs, certs):
    # Given a TLS coordinator and a real worker that trusts the test CA (told a closed port
    # first: TLS works the same on each address of a list)
    worker_procs.start(SimpleNamespace(worker_target="%s,%s" % (closed_address(), tls_coordinator.worker_target)), "w-tls",
                       extra=("--tls-ca=%s" % certs.ca,))
    # When a library client (TLS too) submits a job and waits for it
    with CoordinatorClient([closed_address(), tls_coordinator.client_target], tls_ca=str(certs.ca)) as client:
        wait_registered(client, ["w-tls"], timeout=20)
        job_id = client.submit("SHA256", {"text": "over tls"})
        job = client.wait(job_id, timeout=30)
    # Then the worker ran it
    assert job["state"] == "COMPLETED"
    assert job["result"] == {"sha256": hashlib.sha256(b"over tls").hexdigest()}


def test_the_cli_over_tls(tls_coordinator, worker_procs, certs):
    worker_procs.start(tls_coordinator, "w-cli-tls", extra=("--tls-ca=%s" % certs.ca,))
    target = tls_coordinator.client_target
    done = run_cli("submit", "WORD_COUNT", '{"text": "a b c"}', "--wait", "--json", "--tls-ca=%s" % certs.ca,
                   coordinator=target, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == {"words": 3}
    # JOBMESH_TLS_CA instead of the flag
    listed = run_cli("list", "--json", coordinator=target, env={"JOBMESH_TLS_CA": str(certs.ca)})
    assert listed.returncode == 0, listed.stderr
    # (the only WORD_COUNT job on the coordinator the module's tests share)
    word_counts = [j["jobId"] for j in json.loads(listed.stdout) if j["taskType"] == "WORD_COUNT"]
    assert word_counts == [json.loads(done.stdout)["jobId"]]
    top = run_cli("top", "--iterations=1", "--tls-ca=%s" % certs.ca, coordinator="%s,%s" % (closed_address(), target))
    assert top.returncode == 0, top.stderr
    assert "w-cli-tls" in top.stdout


def test_a_plaintext_cli_on_a_tls_port_fails_cleanly(tls_coordinator):
    out = run_cli("list", coordinator=tls_coordinator.client_target)
    assert out.returncode == 3
    assert "unreachable" in out.stderr and "Traceback" not in out.stderr
    assert "the coordinator speaks TLS here: add --tls-ca" in out.stderr


def test_a_plaintext_worker_on_a_tls_port_is_told_so_and_exits_1(tls_coordinator, worker_procs):
    worker = worker_procs.start(tls_coordinator, "w-plaintext")
    assert worker.proc.wait(30) == 1
    assert "the coordinator speaks TLS here: add --tls-ca" in worker.log()


def test_a_tls_client_on_a_plaintext_port_is_told_so(coordinator, certs):
    with pytest.raises(CoordinatorUnavailable, match="does not speak TLS"):
        with CoordinatorClient(*coordinator.client_addr, tls_ca=str(certs.ca), connect_timeout=10) as client:
            client.workers()


def test_the_certificate_must_carry_the_host(coordinator_factory, certs):
    # A certificate signed by the trusted CA, but for another name, is refused by the client.
    coord = coordinator_factory(tls_cert=certs.other_name, tls_key=certs.other_name_key)
    with pytest.raises(CoordinatorUnavailable, match="IP address mismatch|doesn't match|mismatch"):
        with CoordinatorClient(*coord.client_addr, tls_ca=str(certs.ca)) as client:
            client.workers()


def test_a_coordinator_signed_by_another_ca_is_refused(tls_coordinator, certs):
    with pytest.raises(CoordinatorUnavailable, match="certificate"):
        with CoordinatorClient(*tls_coordinator.client_addr, tls_ca=str(certs.stranger_ca)) as client:
            client.workers()


def test_an_unreadable_ca_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--tls-ca"):
        CoordinatorClient("127.0.0.1", 1, tls_ca=str(tmp_path / "missing.pem"))
    out = run_cli("list", "--tls-ca=%s" % (tmp_path / "missing.pem"), coordinator="127.0.0.1:1")
    assert out.returncode == 2 and "--tls-ca" in out.stderr


def test_requests_after_an_error_reply_over_tls(tls_coordinator, certs):
    # After an ERROR the client looks whether the coordinator closed the connection; over
    # TLS it looks at the TCP stream under the TLS socket.
    with CoordinatorClient(*tls_coordinator.client_addr, tls_ca=str(certs.ca)) as client:
        wait_no_worker(client)
        for _ in range(3):
            with pytest.raises(RequestFailed):
                client.status("no-such-job")
            assert client.workers() == []


def test_the_library_takes_an_ssl_context(tls_coordinator, certs):
    context = ssl.create_default_context(cafile=str(certs.ca))
    with CoordinatorClient(*tls_coordinator.client_addr, tls=context) as client:
        wait_no_worker(client)
        assert client.workers() == []


# ---- client certificates --------------------------------------------------------------


def test_client_certificates_when_the_coordinator_asks(mtls_coordinator, worker_procs, certs, tmp_path):
    addr = mtls_coordinator.client_addr
    exposed = tmp_path / "client-key.pem"  # the client's key as a copy may leave it: others may read it
    exposed.write_bytes(certs.client_key.read_bytes())
    exposed.chmod(0o644)
    # Without a certificate, or with one from a CA the coordinator does not trust: refused.
    for cert, key in ((None, None), (certs.stranger, certs.stranger_key)):
        with pytest.raises(CoordinatorUnavailable):
            with CoordinatorClient(*addr, tls_ca=str(certs.ca), tls_cert=cert and str(cert),
                                   tls_key=key and str(key)) as client:
                client.workers()
    # With the test CA's client certificate, a worker and a client run a job.
    worker = worker_procs.start(mtls_coordinator, "w-mtls",
                                extra=("--tls-ca=%s" % certs.ca, "--tls-cert=%s" % certs.client,
                                       "--tls-key=%s" % exposed))
    with CoordinatorClient(*addr, tls_ca=str(certs.ca), tls_cert=str(certs.client),
                           tls_key=str(certs.client_key)) as client:
        wait_registered(client, ["w-mtls"], timeout=20)
        assert client.wait(client.submit("SHA256", {"text": "x"}), timeout=30)["state"] == "COMPLETED"
    for key in (exposed, certs.client_key):
        out = run_cli("workers", "--json", "--tls-ca=%s" % certs.ca, "--tls-cert=%s" % certs.client,
                      "--tls-key=%s" % key, coordinator=mtls_coordinator.client_target)
        assert out.returncode == 0, out.stderr
        assert [w["workerId"] for w in json.loads(out.stdout)] == ["w-mtls"]
        # a private key others may read is named, with the fix (as a token file is)
        assert ("the --tls-key file %s is readable by other users (mode 0644)" % exposed in out.stderr) \
            is (key == exposed), out.stderr
    assert "the --tls-key file %s is readable by other users (mode 0644)" % exposed in worker.log()


def test_a_worker_without_a_client_certificate_never_registers(mtls_coordinator, worker_procs, certs):
    with CoordinatorClient(*mtls_coordinator.client_addr, tls_ca=str(certs.ca), tls_cert=str(certs.client),
                           tls_key=str(certs.client_key)) as client:
        wait_no_worker(client)
        worker = worker_procs.start(mtls_coordinator, "w-nocert", extra=("--tls-ca=%s" % certs.ca,))
        wait_until(lambda: worker.count("cannot register") >= 2, timeout=30, message="the worker retrying")
        assert client.workers() == []


# ---- misbehaving peers ----------------------------------------------------------------


@pytest.mark.parametrize("port", ["worker", "client"])
def test_a_plaintext_peer_on_a_tls_port_is_closed(tls_coordinator, port):
    addr = tls_coordinator.worker_addr if port == "worker" else tls_coordinator.client_addr
    with socket.create_connection(addr, timeout=10) as sock:
        sock.sendall(encode_frame({"type": "LIST_WORKERS"}))
        assert closed_by_peer(sock)


def test_a_silent_peer_is_closed_after_the_handshake_timeout_while_others_are_served(tls_coordinator, certs):
    silent = [socket.create_connection(tls_coordinator.client_addr, timeout=10) for _ in range(3)]
    silent.append(socket.create_connection(tls_coordinator.worker_addr, timeout=10))
    silent.append(socket.create_connection(tls_coordinator.metrics_addr, timeout=10))
    try:
        # Others are served meanwhile ...
        with CoordinatorClient(*tls_coordinator.client_addr, tls_ca=str(certs.ca)) as client:
            job_id = client.submit("SLEEP", {"durationMillis": 1})
            assert client.status(job_id)["jobId"] == job_id
        # ... and each silent connection is closed once its handshake time is up.
        for sock in silent:
            assert closed_by_peer(sock)
        # (each close is logged with the peer's port as its handler ends, which may be just
        # after the peer saw it)
        lines = ["peer=127.0.0.1:%d: no TLS handshake within" % sock.getsockname()[1] for sock in silent]
        wait_until(lambda: all(line in tls_coordinator.stderr() for line in lines), message="each close logged")
    finally:
        for sock in silent:
            sock.close()


def test_random_first_bytes_on_tls_ports_are_closed_while_others_are_served(tls_coordinator, certs):
    # Seeded random first bytes, some shaped like the start of a TLS record: each such
    # connection is closed (at once, or at the handshake timeout); a TLS client is
    # served between them.
    rng = random.Random(17)
    ports = [tls_coordinator.worker_addr, tls_coordinator.client_addr, tls_coordinator.metrics_addr]
    with CoordinatorClient(*tls_coordinator.client_addr, tls_ca=str(certs.ca)) as client:
        wait_no_worker(client)
        for i in range(24):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
            if i % 3 == 0:
                junk = b"\x16\x03" + bytes([rng.randrange(5)]) + junk  # a handshake record's header, then junk
            with socket.create_connection(ports[i % 3], timeout=10) as sock:
                try:
                    sock.sendall(junk)
                except OSError:
                    pass  # closed while we were still sending
                assert closed_by_peer(sock)
            assert client.workers() == []


def test_a_peer_that_stops_inside_the_handshake_is_closed(tls_coordinator):
    # The first bytes of a TLS record, then nothing.
    with socket.create_connection(tls_coordinator.client_addr, timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00\x01")
        assert closed_by_peer(sock)


# ---- replies through the TLS socket ---------------------------------------------------


def test_large_and_pipelined_replies_over_tls(loaded_coordinator, certs):
    # A small receive buffer and a reader that is late: the coordinator's socket fills,
    # so replies wait in its output and go out through the flusher, in order.
    sock = tls_socket(loaded_coordinator.client_addr, certs, rcvbuf=32 * 1024)
    reader = FrameReader(sock.recv)
    try:
        count = 1000
        sock.sendall(submit_frames(count))
        ids = []
        for _ in range(count):
            reply = reader.read_frame()
            assert reply["type"] == "JOB_SUBMITTED", reply
            ids.append(reply["jobId"])
        # Many large replies, pipelined: each JOB_LIST holds every job, more in all than
        # the coordinator's socket and ours hold (4 MiB at most here, net.ipv4.tcp_wmem).
        lists = 20
        sock.sendall(b"".join(encode_frame({"type": "LIST_JOBS", "limit": 1000}) for _ in range(lists)))
        sock.sendall(b"".join(encode_frame({"type": "GET_JOB_STATUS", "jobId": job_id}) for job_id in ids))
        wait_until_full(sock)  # reading nothing until then
        total = 0
        for _ in range(lists):
            reply = reader.read_frame()
            assert reply["type"] == "JOB_LIST"
            assert len(reply["jobs"]) == count
            total += len(encode_frame(reply))
        assert total > 6 * 1024 * 1024
        for job_id in ids:  # the status replies follow, in request order
            reply = reader.read_frame()
            assert reply["type"] == "JOB_STATUS" and reply["job"]["jobId"] == job_id
    finally:
        sock.close()


def test_a_tls_client_that_does_not_read_holds_up_nobody(loaded_coordinator, certs):
    # Given a TLS client whose replies fill the coordinator's socket and who reads nothing
    greedy = tls_socket(loaded_coordinator.client_addr, certs, rcvbuf=32 * 1024)
    try:
        greedy.sendall(submit_frames(1000))
        greedy.sendall(b"".join(encode_frame({"type": "LIST_JOBS", "limit": 1000}) for _ in range(16)))
        wait_until_full(greedy)
        # When another TLS client asks, then it is answered: the core never waits for a socket.
        with CoordinatorClient(*loaded_coordinator.client_addr, tls_ca=str(certs.ca), timeout=20) as client:
            assert client.status(client.submit("SLEEP", {"durationMillis": 1}))["state"] in ("QUEUED", "RUNNING")
            assert client.stats() is not None
    finally:
        greedy.close()


# ---- the metrics port -----------------------------------------------------------------


def test_the_metrics_port_speaks_https(tls_coordinator, certs):
    host, port = tls_coordinator.metrics_addr
    context = ssl.create_default_context(cafile=str(certs.ca))
    with urllib.request.urlopen("https://%s:%d/healthz" % (host, port), context=context, timeout=20) as resp:
        assert resp.status == 200
    with urllib.request.urlopen("https://%s:%d/metrics" % (host, port), context=context, timeout=20) as resp:
        assert b"jobmesh_jobs_submitted_total" in resp.read()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen("http://%s:%d/healthz" % (host, port), timeout=20).read()


def test_a_tls_worker_or_client_on_the_metrics_port_is_told_the_right_port(tls_coordinator, worker_procs, certs):
    # The metrics port speaks TLS with the same certificate, so a TLS peer gets past the
    # handshake: what it sends next is looked at as a plaintext peer's first bytes are
    host, port = tls_coordinator.metrics_addr
    with CoordinatorClient(host, port, tls_ca=str(certs.ca), timeout=60) as client:
        with pytest.raises(RequestFailed) as info:
            client.stats()
    assert str(info.value).startswith("this is the metrics port (HTTP)")
    worker = worker_procs.start(SimpleNamespace(worker_target="%s:%d" % (host, port)), "w-lost-tls",
                                extra=("--tls-ca=%s" % certs.ca,))
    assert worker.proc.wait(30) == 1  # retrying cannot help: it stops at once
    assert "this is the metrics port (HTTP)" in worker.log() and "Traceback" not in worker.log()
    # and the port still serves HTTPS
    context = ssl.create_default_context(cafile=str(certs.ca))
    with urllib.request.urlopen("https://%s:%d/metrics" % (host, port), context=context, timeout=20) as resp:
        assert b"jobmesh_jobs_submitted_total" in resp.read()


# ---- jobmesh up ---------------------------------------------------------------------


@pytest.mark.parametrize("client_certs", [False, True])
def test_up_over_tls(start_up, certs, client_certs):
    flags = ["--workers=1", "--tls-cert=%s" % certs.server, "--tls-key=%s" % certs.server_key]
    client = ["--tls-ca=%s" % certs.ca]
    if client_certs:
        flags.append("--tls-client-ca=%s" % certs.ca)
        client += ["--tls-cert=%s" % certs.client, "--tls-key=%s" % certs.client_key]
    up = start_up(*flags)
    target = "%s:%d" % up.client_addr
    out = run_cli("submit", "SHA256", '{"text": "up"}', "--wait", "--json", *client, coordinator=target, timeout=60)
    assert out.returncode == 0, out.stderr + up.log()
    assert json.loads(out.stdout)["state"] == "COMPLETED"


def test_tls_and_tokens_together_a_worker_and_the_cli_run_jobs(coordinator_factory, worker_procs, certs, tmp_path):
    # Given a coordinator with TLS on every port and an auth file
    from jobmesh.auth import new_token

    auth_file = tmp_path / "auth.toml"
    for name, role in (("w", "worker"), ("ci", "client")):
        (tmp_path / (name + ".token")).write_text(new_token(str(auth_file), name, role))
    coord = coordinator_factory(tls_cert=certs.server, tls_key=certs.server_key, auth_file=auth_file, metrics_port=0)
    # When a real worker with the CA and its token, and the CLI with the CA and a client token, run a job
    worker_procs.start(coord, "w-both", extra=("--tls-ca=%s" % certs.ca, "--token-file=%s" % (tmp_path / "w.token")))
    ca = "--tls-ca=%s" % certs.ca
    done = run_cli("submit", "WORD_COUNT", '{"text": "a b"}', "--wait", "--json", ca,
                   "--token-file=%s" % (tmp_path / "ci.token"), coordinator=coord.client_target, timeout=60)
    # Then it completes, named by the client token
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["result"] == {"words": 2} and job["submittedBy"] == "ci"
    # And without a token the CLI gets one line, the metrics port only its health checks
    refused = run_cli("list", ca, coordinator=coord.client_target)
    assert refused.returncode != 0 and "authentication required" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    host, port = coord.metrics_addr
    context = ssl.create_default_context(cafile=str(certs.ca))
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen("https://%s:%d%s" % (host, port, path), context=context, timeout=20) as resp:
            assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen("https://%s:%d/metrics" % (host, port), context=context, timeout=20)
    assert denied.value.code == 401


def test_the_auth_timeout_counts_the_tls_handshake(coordinator_factory, certs, tmp_path):
    # Given tokens over TLS, a handshake allowed a minute but AUTH due a second after accept
    from jobmesh import auth
    path = str(tmp_path / "auth.toml")
    token = auth.new_token(path, "ci", "client")
    coord = coordinator_factory(tls_cert=certs.server, tls_key=certs.server_key, auth_file=path,
                                auth_timeout_millis=1000, tls_handshake_timeout_millis=60000)
    # a peer that never starts its handshake, and one that finishes it but never sends AUTH,
    silent = socket.create_connection(coord.client_addr, timeout=30)
    quiet = tls_socket(coord.client_addr, certs)
    quiet.settimeout(30)
    # are both closed at the auth timeout, not the handshake's
    assert silent.recv(1) == b""
    try:
        assert quiet.recv(1) == b""
    except (ssl.SSLError, ConnectionResetError):
        pass
    # (each is logged as its handler ends, which may be just after the peer saw the close)
    closed = "not authenticated within 1.0 s (--auth-timeout-millis)"
    wait_until(lambda: coord.stderr().count(closed) >= 2, timeout=30, message="both closes logged")
    assert coord.stderr().count(closed) == 2
    # while a client that authenticates at once is served
    with CoordinatorClient(*coord.client_addr, tls_ca=str(certs.ca), token=token) as client:
        assert client.workers() == []
    silent.close()
    quiet.close()
