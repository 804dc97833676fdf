"""Coordinator addresses: the one parser (jobmesh/addresses.py) that workers, clients, the
CLI, up and the library share, and trying a list of addresses in turn."""

from __future__ import annotations

import pytest

from jobmesh.addresses import Address, AllFailed, first_reachable, parse_address, parse_addresses
from jobmesh.errors import BadAddress, ConfigError


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7071", Address("127.0.0.1", 7071)),
    ("localhost:1", Address("localhost", 1)),
    (" coord-b.example:65535 ", Address("coord-b.example", 65535)),
    ("[::1]:7070", Address("::1", 7070)),
    ("[fe80::1%eth0]:7070", Address("fe80::1%eth0", 7070)),
])
def test_one_address(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text, said", [
    ("localhost", "has no port"),
    (":7070", "has no host"),
    ("host:port", "is not HOST:PORT with a port 1..65535"),
    ("host:0", "is not HOST:PORT with a port 1..65535"),
    ("host:65536", "is not HOST:PORT with a port 1..65535"),
    ("host:-1", "is not HOST:PORT with a port 1..65535"),
    ("host:", "is not HOST:PORT with a port 1..65535"),
    ("::1:7070", "an IPv6 address goes in brackets, as [::1]:7070"),
    ("[::1]", "has no port"),
    ("[::1]7070", "is not [IPV6]:PORT"),
    ("[not-v6]:7070", "is not [IPV6]:PORT"),
    ("[::1:7070", "is not [IPV6]:PORT"),
    ("  ", "has an empty address"),
])
def test_a_bad_address_is_one_line_naming_the_flag_and_the_entry(text, said):
    with pytest.raises(BadAddress) as info:
        parse_address(text, "--coordinator")
    message = str(info.value)
    assert message.startswith("--coordinator") and said in message and "\n" not in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_a_list_keeps_its_order_and_drops_repeats():
    assert parse_addresses("b:2, a:1,[::1]:3,b:2") == (Address("b", 2), Address("a", 1), Address("::1", 3))
    assert parse_addresses(["a:1", Address("b", 2)]) == (Address("a", 1), Address("b", 2))


@pytest.mark.parametrize("value, said", [
    ("a:1,,b:2", "has an empty entry"),
    ("a:1,", "has an empty entry"),
    ("", "has an empty"),
    ([], "names no address"),
    (["a:1", 7], "is not a HOST:PORT string"),
    ("a:1,b:x", "'b:x' is not HOST:PORT"),
])
def test_a_bad_list_names_the_entry(value, said):
    with pytest.raises(BadAddress, match=None) as info:
        parse_addresses(value)
    assert said in str(info.value)


def test_a_default_port_serves_entries_without_one():
    assert parse_addresses("a,b:9", default_port=7071) == (Address("a", 7071), Address("b", 9))
    assert parse_address("::1", default_port=7071) == Address("::1", 7071)  # a bare IPv6 host, as the library took it
    assert parse_address("[::1]", default_port=7071) == Address("::1", 7071)


def test_an_address_prints_as_it_is_written():
    assert [str(a) for a in parse_addresses("h:1,[::1]:2")] == ["h:1", "[::1]:2"]


def test_first_reachable_goes_round_the_list_from_start():
    addresses = parse_addresses("a:1,b:2,c:3")
    tried = []

    def attempt(address):
        tried.append(address.host)
        if address.host != "a":
            raise ConnectionRefusedError(111, "Connection refused")
        return "sock-a"

    assert first_reachable(addresses, 1, attempt) == (0, "sock-a")
    assert tried == ["b", "c", "a"]


def test_first_reachable_names_every_address_when_all_fail():
    def attempt(address):
        if address.port == 1:
            raise ConnectionRefusedError(111, "Connection refused")
        raise TimeoutError("timed out")

    with pytest.raises(AllFailed) as info:
        first_reachable(parse_addresses("a:1,b:2"), 0, attempt)
    assert str(info.value) == "a:1: Connection refused; b:2: timed out"


def test_first_reachable_lets_other_errors_through_at_once():
    tried = []

    def attempt(address):
        tried.append(address)
        raise KeyError("not a connection failure")

    with pytest.raises(KeyError):
        first_reachable(parse_addresses("a:1,b:2"), 0, attempt)
    assert len(tried) == 1


def test_up_reads_the_listening_line_with_the_same_parser():
    from jobmesh.up import listening_ports, worker_target

    assert listening_ports("worker=[::]:7070 client=[::]:7071 metrics=0.0.0.0:9090") == {
        "worker": ("::", 7070), "client": ("::", 7071), "metrics": ("0.0.0.0", 9090)}
    assert worker_target("::", 7070) == "[::1]:7070" and worker_target("0.0.0.0", 7070) == "127.0.0.1:7070"
