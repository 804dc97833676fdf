"""Load generation and baselines for jobmesh: ``python -m bench.loadgen``, ``bench/echo_baseline.py``.

Nothing in this package patches gevent on import; each entry point uses gevent's own
sockets and subprocesses explicitly, so tests can import these modules unpatched.
"""
