"""The coordinator's guard (coordinator/guard.py): failures by address, the slow-down, reloads."""

from __future__ import annotations

import pytest

from jobmesh import auth
from jobmesh.coordinator.ports import guard as g
from jobmesh.coordinator.ports.guard import Guard


class Conn:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


class Sock:
    def __init__(self):
        self.down = False

    def shutdown(self, how):
        self.down = True


@pytest.fixture
def tokens(tmp_path):
    path = str(tmp_path / "auth.toml")
    made = {name: auth.new_token(path, name, role) for name, role in (("ci", "client"), ("w1", "worker"))}
    return path, made


def test_a_peer_that_keeps_failing_is_slowed_and_a_success_forgives_only_its_own_token(tokens):
    path, made = tokens
    guard = Guard.load(path)
    for n in range(1, g.FREE_FAILURES + 1):
        assert guard.authenticate("guess-%d" % n, "10.0.0.1") is None
        assert guard.failure_delay("10.0.0.1") == 0.0
    delays = []
    for n in range(12):
        assert guard.authenticate("guess", "10.0.0.1") is None
        delays.append(guard.failure_delay("10.0.0.1"))
    assert delays[0] == g.FIRST_DELAY and delays == sorted(delays) and delays[-1] == g.MAX_DELAY
    assert guard.failure_delay("10.0.0.2") == 0.0  # other addresses are not slowed
    assert guard.failures == g.FREE_FAILURES + 12
    # A success with another token clears nothing
    assert guard.authenticate(made["ci"], "10.0.0.1").name == "ci"
    assert guard.failure_delay("10.0.0.1") == g.MAX_DELAY
    # while the success of a token that failed before (it was added since) forgives its own failures
    late = auth.new_token(path, "late", "client")
    for _ in range(g.FREE_FAILURES + 5):
        assert guard.authenticate(late, "10.0.0.3") is None
    assert guard.authenticate("guess", "10.0.0.3") is None
    assert guard.failure_delay("10.0.0.3") > 0
    assert guard.reload() and guard.authenticate(late, "10.0.0.3").name == "late"
    assert guard.failure_delay("10.0.0.3") == 0.0


def test_connections_waiting_to_authenticate_are_bounded_per_address(tokens):
    guard = Guard.load(tokens[0])
    guard.pending_limit = 2
    socks = [Sock() for _ in range(4)]
    first, second = guard.admit(socks[0], "10.0.0.1", "client"), guard.admit(socks[1], "10.0.0.1", "worker")
    other = guard.admit(socks[2], "2001:db8::1", "client")  # another address (an IPv6 /64 is one)
    second.done()  # authenticated: no longer counted
    left = [guard.admit(socks[3], "10.0.0.1", "client")]
    assert not any(sock.down for sock in socks)
    left.append(guard.admit(Sock(), "10.0.0.1", "client"))  # a third waiting: the oldest makes room
    assert socks[0].down and first.timer is None and not socks[3].down
    left.append(guard.admit(Sock(), "2001:db8::2", "client"))
    left.append(guard.admit(Sock(), "2001:db8::3", "client"))
    assert socks[2].down and other.timer is None
    # A ticket's timer raises in the greenlet that admitted it (here the test's own): settle them all
    for ticket in left:
        ticket.done()
    assert all(ticket.timer is None for ticket in left)
    assert g.address_key("::ffff:10.0.0.1") == "10.0.0.1" and g.address_key("2001:db8::1") == "2001:db8::/64"


def test_addresses_remembered_are_bounded(tokens, monkeypatch):
    monkeypatch.setattr(g, "MAX_PEERS", 3)
    guard = Guard.load(tokens[0])
    for host in ("a", "b", "c", "d"):
        for _ in range(g.FREE_FAILURES + 1):
            guard.failed(host)
    assert guard.failure_delay("a") == 0.0 and guard.failure_delay("d") > 0


def test_failures_are_counted_per_address_as_pending_connections_are(tokens):
    """A guesser that changes its address within an IPv6 /64 (or speaks IPv4 as an
    IPv4-mapped IPv6 address) is still one peer: its failures add up and slow it."""
    guard = Guard.load(tokens[0])
    for n in range(g.FREE_FAILURES + 1):
        assert guard.authenticate("guess", "2001:db8::%x" % (n + 1)) is None
    assert guard.failure_delay("2001:db8::ffff") > 0
    assert guard.failure_delay("2001:db8:0:1::1") == 0.0  # another /64 is another peer
    for _ in range(g.FREE_FAILURES + 1):
        guard.failed("::ffff:10.0.0.9")
    assert guard.failure_delay("10.0.0.9") > 0


def test_reload_closes_the_connections_of_removed_tokens_only(tokens):
    path, made = tokens
    guard = Guard.load(path)
    ci_conn, w1_conn = Conn(), Conn()
    guard.attach(ci_conn, guard.authenticate(made["ci"], "h"))
    guard.attach(w1_conn, guard.authenticate(made["w1"], "h"))
    auth.remove_token(path, "ci")
    assert guard.reload()
    assert ci_conn.aborted and not w1_conn.aborted
    assert guard.authenticate(made["ci"], "h") is None and guard.authenticate(made["w1"], "h").name == "w1"
    # A file that no longer parses is not taken
    with open(path, "a") as f:
        f.write("[[token]]\nname = 1\n")
    assert not guard.reload()
    assert guard.authenticate(made["w1"], "h").name == "w1" and not w1_conn.aborted
