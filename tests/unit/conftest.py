"""Fixtures for the unit tier."""

import pytest

from jobmesh.client.api import CoordinatorClient
from tests.helpers import ScriptedServer


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
