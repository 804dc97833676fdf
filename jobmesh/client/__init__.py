"""The blocking client library and the CLI's client commands.

    from jobmesh.client import CoordinatorClient

    with CoordinatorClient("127.0.0.1", 7071) as client:
        job_id = client.submit("SHA256", {"text": "hello"})
        print(client.wait(job_id, timeout=30)["result"])
"""

from jobmesh.client.api import CoordinatorClient, WaitTimeout

__all__ = ["CoordinatorClient", "WaitTimeout"]
