"""The exit codes of the ``jobmesh`` command line (CONTRACT.md, "Command line").

A leaf module: ``cli`` and ``client.commands`` both use these, and neither imports the other
at module level.
"""

EXIT_OK = 0
EXIT_FAILED = 1        # job ended FAILED/CANCELLED, submit rejected, coordinator answered ERROR
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (``jobmesh list | head``): 128 + SIGPIPE, as for any Unix tool
