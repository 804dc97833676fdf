"""The worker: registers with a coordinator, heartbeats, and executes tasks in a bounded pool.

``agent`` owns the connection, ``running`` the in-flight attempts, ``tasks`` the built-in
task bodies, ``usertasks`` the ``@task`` decorator for users' own task types, whose
functions run in unpatched child processes (``processes`` in the worker, ``child`` in
each child). Nothing here monkey-patches; the process entry does that.

Importing this package imports ``usertasks`` only (stdlib, no gevent), so a user's tasks
module can say ``from jobmesh.worker import task`` in the clean child interpreter.
"""

from jobmesh.worker.usertasks import TaskContext, TaskDefinitionError, load_modules, task

__all__ = ["task", "TaskContext", "TaskDefinitionError", "load_modules"]
