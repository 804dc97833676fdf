"""Fixtures for the unit tier."""

import io

import pytest

from jobmesh.cli import parse
from jobmesh.client.api import CoordinatorClient
from jobmesh.client.commands import Console, run_client_command
from tests.support.scripted_server import ScriptedServer


@pytest.fixture
def serve():
    """``server, client = serve(*steps, **client_kwargs)``: a ScriptedServer and a client of it."""
    servers = []

    def make(*steps, **client_kwargs):
        server = ScriptedServer(steps)
        servers.append(server)
        client = CoordinatorClient("127.0.0.1", server.port, **client_kwargs)
        servers.append(client)
        return server, client

    yield make
    for s in reversed(servers):
        s.close()


@pytest.fixture
def jm():
    """``code, stdout, stderr, server = jm([replies...], *argv)``: one command against a ScriptedServer."""
    servers: list[ScriptedServer] = []

    def run(replies, *argv, stdin=None):
        server = ScriptedServer(replies)
        servers.append(server)
        command, args = parse(list(argv) + ["--coordinator=127.0.0.1:%d" % server.port])
        out, err = io.StringIO(), io.StringIO()
        code = run_client_command(command, args, Console(out, err, stdin))
        return code, out.getvalue(), err.getvalue(), server

    yield run
    for server in servers:
        server.close()
