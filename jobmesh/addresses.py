"""Coordinator addresses: ``HOST:PORT[,HOST:PORT...]`` read in one place, and the
connection to the first address of a list that answers.

Workers, client commands, ``up`` and the library all parse addresses here. A host is
a name, an IPv4 address, or an IPv6 address in brackets (``[::1]:7070``). Errors are
``BadAddress`` (a ``ConfigError`` for the CLI, a ``ValueError`` for library callers),
one line naming the flag and the entry at fault.

Several addresses name coordinators sharing one database, of which one leads and the
others stand by (docs/SCALING.md). A standby opens no job ports, so a refused
connection is its normal answer: ``first_reachable`` moves on to the next address at
once, and a silent one after the short connect timeout, and only when every address
has failed is there an error, naming each address and why it failed.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from jobmesh.errors import BadAddress

CONNECT_TIMEOUT = 1.0  # seconds a TCP connect to one address may take before the next is tried
FORMS = "HOST:PORT[,HOST:PORT...] (an IPv6 host in brackets: [::1]:7070)"
T = TypeVar("T")


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return ("[%s]:%d" if ":" in self.host else "%s:%d") % (self.host, self.port)


def parse_address(text: str, flag: str = "--coordinator", default_port: int | None = None) -> Address:
    """One ``HOST:PORT``; with ``default_port``, a bare HOST (or IPv6 address) takes it."""
    raw = text.strip()
    if not raw:
        raise BadAddress("%s has an empty address; give %s" % (flag, FORMS))
    if raw.startswith("["):
        host, closed, rest = raw[1:].partition("]")
        if not closed or not _is_ipv6(host) or (rest and not rest.startswith(":")):
            raise BadAddress("%s: %r is not [IPV6]:PORT" % (flag, raw))
        port = rest[1:] if rest else None
    elif raw.count(":") > 1:
        if default_port is None or not _is_ipv6(raw):
            raise BadAddress("%s: %r: an IPv6 address goes in brackets, as [::1]:7070" % (flag, raw))
        host, port = raw, None
    else:
        host, colon, port_text = raw.partition(":")
        port = port_text if colon else None
        if not host:
            raise BadAddress("%s: %r has no host; give %s" % (flag, raw, FORMS))
    if port is None:
        if default_port is None:
            raise BadAddress("%s: %r has no port; give %s" % (flag, raw, FORMS))
        return Address(host, default_port)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadAddress("%s: %r is not HOST:PORT with a port 1..65535" % (flag, raw))
    return Address(host, int(port))


def parse_addresses(value: str | Sequence[str | Address], flag: str = "--coordinator",
                    default_port: int | None = None) -> tuple[Address, ...]:
    """A comma-separated list (or a sequence of entries, strings or Addresses) as Addresses,
    in order, each once."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    if not entries:
        raise BadAddress("%s names no address; give %s" % (flag, FORMS))
    addresses = []
    for entry in entries:
        if isinstance(entry, Address):
            addresses.append(entry)
            continue
        if not isinstance(entry, str):
            raise BadAddress("%s: %r is not a HOST:PORT string" % (flag, entry))
        if not entry.strip():
            raise BadAddress("%s: %r has an empty entry; give %s" % (flag, value, FORMS))
        addresses.append(parse_address(entry, flag, default_port))
    return tuple(dict.fromkeys(addresses))


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


def joined(addresses: Sequence[Address]) -> str:
    """The list as the flag takes it: ``A,B``."""
    return ",".join(str(a) for a in addresses)


class AllFailed(Exception):
    """Every address failed; the message names each, in order, with why (one line)."""

    def __init__(self, failures: list[tuple[Address, BaseException]]):
        super().__init__("; ".join("%s: %s" % (address, reason(exc)) for address, exc in failures))
        self.failures = failures


def reason(exc: BaseException) -> str:
    """Why a connection failed, in one line (``Connection refused``, ``timed out``)."""
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return exc.strerror
    return " ".join((str(exc) or type(exc).__name__).split())


def first_reachable(addresses: Sequence[Address], start: int, attempt: Callable[[Address], T],
                    moves_on: tuple[type[BaseException], ...] = (OSError,)) -> tuple[int, T]:
    """``attempt`` each address in turn, from index ``start`` round the list; the index and
    result of the first that succeeds. An exception in ``moves_on`` moves on to the next
    address; any other propagates at once. ``AllFailed`` when every address failed."""
    failures: list[tuple[Address, BaseException]] = []
    for i in range(len(addresses)):
        index = (start + i) % len(addresses)
        try:
            return index, attempt(addresses[index])
        except moves_on as exc:
            failures.append((addresses[index], exc))
    raise AllFailed(failures)
