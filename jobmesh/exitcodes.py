"""The exit codes of the ``jobmesh`` command line (CONTRACT.md, "Command line").

A leaf module: ``cli``, the client commands, the coordinator's shell, the worker and
``up`` use these, and none of them imports another at module level for it.
"""

EXIT_OK = 0
# A job ended FAILED/CANCELLED, a submit was rejected, the coordinator answered ERROR; a
# coordinator, worker or ``up`` that cannot start (or a worker that crashed).
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (``jobmesh list | head``): 128 + SIGPIPE, as for any Unix tool
EXIT_CORE_DIED = 70  # the coordinator's core greenlet died (a bug): it stops rather than serve without it
EXIT_COMMIT_FAILED = 71  # a commit failed in a way storage faults do not explain: recovery repairs it at the next start
# A coordinator on a shared store (PostgreSQL) lost its leadership: its database session
# ended, its lock went to another, or a batch's fence failed. It committed nothing more;
# a supervisor starts it again and it stands by (75 is EX_TEMPFAIL: try again).
EXIT_LEADERSHIP_LOST = 75
