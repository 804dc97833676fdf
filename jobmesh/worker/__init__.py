"""The worker: registers with a coordinator, heartbeats, and executes tasks in a bounded pool.

``agent`` owns the connection, ``running`` the in-flight attempts, ``tasks`` the task
bodies. Nothing here monkey-patches; the process entry does that.
"""
