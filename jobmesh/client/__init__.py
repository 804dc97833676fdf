"""The blocking client library and the CLI's client commands.

    from jobmesh.client import CoordinatorClient, chord, group, step

    with CoordinatorClient("127.0.0.1", 7071) as client:
        job_id = client.submit("SHA256", {"text": "hello"})
        print(client.wait(job_id, timeout=30)["result"])
        shards = group(step("SHA256", {"text": t}) for t in ("a", "b"))
        workflow_id, _ = client.submit_workflow(chord(shards, step("WORD_COUNT", {"text": "merge"})))
        print(client.wait_workflow(workflow_id, timeout=30)["state"])

The workflow shapes (``chain``, ``group``, ``chord``, ``step``) are ``jobmesh.canvas``'s.
"""

from jobmesh.canvas import CanvasError, chain, chord, group, step
from jobmesh.client.api import CoordinatorClient, SubmittedWorkflow, WaitTimeout, WorkflowWaitTimeout

__all__ = ["CoordinatorClient", "WaitTimeout", "WorkflowWaitTimeout", "SubmittedWorkflow", "CanvasError", "chain",
           "chord", "group", "step"]
