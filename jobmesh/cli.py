"""The ``jobmesh`` command line (docopt). The only module that prints usage or exits.

Each command has its own usage text, so ``jobmesh COMMAND --help`` explains that
command alone. Exit codes are the contract's (``jobmesh.exitcodes``). The client commands
write through a ``Console`` on this process's streams, which this module supplies.

``main`` is the backstop: whatever escapes a command ends as one line on stderr and an
exit code, never a traceback (``JOBMESH_DEBUG=1`` adds the traceback). A reader that
goes away (``jobmesh list | head``) ends the command quietly with 141, as for any tool.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import traceback
from typing import Any

from docopt import DocoptExit, docopt

from jobmesh import __version__
from jobmesh.config import CONFIG_ENV, Source, blame, describe_settings, layered
from jobmesh.errors import ConfigError
from jobmesh.exitcodes import (EXIT_BROKEN_PIPE, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TIMEOUT,
                               EXIT_UNREACHABLE, EXIT_USAGE)
from jobmesh.logs import TEXT_FORMAT, JsonFormatter, JsonLines, json_line

__all__ = ["main", "parse", "UsageError", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_UNREACHABLE",
           "EXIT_TIMEOUT"]

MAIN_DOC = """jobmesh - a durable distributed job coordinator.

Usage:
  jobmesh <command> [<args>...]
  jobmesh (-h | --help)
  jobmesh --version

Commands:
  up           run a coordinator and local workers together, until Ctrl-C
  coordinator  run the coordinator (the scheduling authority)
  worker       run a worker that executes tasks
  submit       submit a job
  status       show one job
  list         list jobs, newest first
  workers      list live workers
  cancel       cancel a job
  wait         wait for a job to finish
  events       show a job's timeline
  retry        submit a finished job again, as a new job
  purge        delete finished jobs older than a given age
  top          a live view of jobs and workers, until Ctrl-C
  schedule     recurring schedules: add, list, show, pause, resume, rm, trigger, preview
  limit        limits per task type: set, list, show, rm
  workflow     jobs that depend on each other: submit, status, cancel, wait
  pause        start no more jobs of a task type (running ones go on)
  resume       start jobs of a paused task type again
  token        make, list and remove the tokens of an auth file

Run 'jobmesh <command> --help' for a command's options.
"""

COORDINATOR_OPTIONS = """
Coordinator options:
  --bind=ADDR                    address to listen on [default: 127.0.0.1]
  --worker-port=PORT             worker port (0 = pick a free one) [default: 7070]
  --client-port=PORT             client port (0 = pick a free one) [default: 7071]
  --periodic-port=PORT           Periodic-protocol port for aio-periodic clients and
                                 workers, off unless given (0 = pick a free one)
  --metrics-port=PORT            HTTP port for /metrics, /healthz, /readyz and the
                                 dashboard at /, off unless given (0 = pick a free one)
  --db=PATH                      SQLite database file, or a PostgreSQL URL
                                 (postgresql://USER@HOST:PORT/DBNAME, needs the postgres
                                 extra) that several coordinators may share: one leads,
                                 the others stand by [default: jobmesh.db]
  --heartbeat-timeout-millis=N   worker presumed dead after this [default: 6000]
  --task-timeout-millis=N        per-attempt execution deadline [default: 600000]
  --max-active-jobs=N            admission limit on non-terminal jobs [default: 100000]
  --aging-step-millis=N          priority aging step [default: 60000]
  --retry-base-millis=N          retry backoff base [default: 1000]
  --retry-cap-millis=N           retry backoff cap [default: 30000]
  --default-max-attempts=N       used when a submit says <= 0 [default: 3]
  --sweep-interval-millis=N      period of the sweep [default: 500]
  --db-synchronous=MODE          SQLite synchronous mode: FULL survives power loss,
                                 NORMAL survives a process crash (FULL unless given;
                                 refused with a PostgreSQL --db: its server decides)
  --db-session-timeout-millis=N  PostgreSQL: the leader's database session ends after
                                 this long idle or unanswered, so a standby takes over
                                 from a frozen or cut-off leader within about this long;
                                 keep it above a few sweep intervals [default: 5000]
  --retain-finished-millis=N     delete finished jobs (and their events) this long
                                 after their last update; 0 keeps them [default: 604800000]
  --idle-timeout-millis=N        close a client connection whose first frame, or a worker
                                 connection whose registration, is not complete after
                                 this long [default: 120000]
  --periodic-keepalive-millis=N  close a Periodic connection that sent nothing for this
                                 long after its handshake (aio-periodic pings every 10 s
                                 when idle); 0 = never [default: 120000]
  --periodic-forget-idle-millis=N  a Periodic func that no worker declares and no job
                                 belongs to leaves STATUS after this long (DROP_FUNC
                                 forgets it at once) [default: 3600000]
  --periodic-key=PEM             the server's RSA private key: every Periodic connection
                                 starts with Periodic's RSA handshake (aio-periodic's
                                 RSATransport; Plain, RSA or AES, as the peer chooses)
  --periodic-authorized-keys=PATH  the peers' RSA public keys the handshake accepts: a
                                 PEM file or a directory of *.pem (PKCS#1 or SPKI);
                                 any other key is closed (with --periodic-key); SIGHUP
                                 reads it again
  --auth-file=PATH               tokens with roles (TOML; jobmesh token new): every
                                 connection must authenticate, and the metrics port
                                 asks for a token too (but /healthz and /readyz);
                                 SIGHUP reads the file again (docs/SECURITY.md)
  --auth-timeout-millis=N        with --auth-file: close a connection whose TLS
                                 handshake and AUTH (or Periodic registration) are not
                                 done this long after it was accepted [default: 10000]
  --insecure                     allow a --bind address other machines can reach
                                 without --auth-file
  --schedules=FILE               recurring schedules to keep: a TOML file, one table per
                                 schedule; applied at start and again on SIGHUP (it
                                 replaces and deletes only the schedules it made)
  --log-level=LEVEL              DEBUG, INFO, WARNING or ERROR [default: INFO]
  --log-format=FORMAT            text, or json: one JSON object per line on stderr [default: text]
  --tls-cert=PEM                 speak TLS on the worker, client and metrics ports with
                                 this certificate (it must carry the name or address
                                 clients connect to); with --tls-key
  --tls-key=PEM                  the private key of --tls-cert
  --tls-client-ca=PEM            with --tls-cert: clients and workers must present a
                                 certificate signed by a CA in this file
  --tls-handshake-timeout-millis=N  close a connection whose TLS handshake is not done
                                 within this long [default: 10000]
  --config=PATH                  read settings from this TOML file; its keys are flag
                                 names without -- (default: $JOBMESH_CONFIG)
  --print-config                 print the effective settings, each with where it came
                                 from, and exit
  -h --help                      show this help
"""

SETTINGS_HELP = """
Every flag may also be set by an environment variable, JOBMESH_ and the flag's name in
upper case with - as _ (JOBMESH_HEARTBEAT_TIMEOUT_MILLIS=300), or in the --config file
(heartbeat-timeout-millis = 300). A flag beats the environment, which beats the file,
which beats the default.
"""

COORDINATOR_DOC = """Run the jobmesh coordinator.

It listens on a worker port and a client port, keeps every job in a SQLite file and
recovers them on start. When ready it prints one line to stdout:

  jobmesh coordinator listening worker=HOST:PORT client=HOST:PORT [metrics=HOST:PORT]

SIGTERM or SIGINT stops it gracefully; with --drain-millis it first assigns nothing
more and lets running attempts finish for up to that long (a second signal stops at
once). One coordinator runs per SQLite file: a second one on the same file exits 1.
Several may share one PostgreSQL database (--db=postgresql://...): one leads, the
others print "jobmesh coordinator standing by", open no job ports (the metrics port
answers /readyz with 503) and take over when the leader's database session ends. A
leader that loses its leadership exits 75; started again, it stands by. It
speaks plaintext unless given --tls-cert and --tls-key. Without --auth-file it
authenticates nobody, so it binds 127.0.0.1 unless told otherwise, and refuses an
address other machines can reach unless given --auth-file (or --insecure). SIGHUP
re-reads the auth file, the Periodic authorized keys and the schedules file.
""" + SETTINGS_HELP + """
Usage:
  jobmesh coordinator [options]

Options:
  --drain-millis=N               on SIGTERM/SIGINT, let running attempts finish for up
                                 to N ms before stopping (0 = stop at once) [default: 0]
  --lease-grace-millis=N         a job found RUNNING at start (or at a takeover) stays
                                 on its attempt for N ms, for its worker to claim when it
                                 registers again; unclaimed, it is then requeued (or
                                 failed on its final attempt). 0 = requeue or fail at
                                 once (default: 0 on a SQLite file; on PostgreSQL the
                                 heartbeat timeout)
""" + COORDINATOR_OPTIONS

UP_DOC = """Run a coordinator and N local worker processes as one supervised unit.

A worker that dies is restarted, and so is a coordinator that exits on its own: on the
same ports and database, where its workers register again and keep the attempts they
were running. Ctrl-C or SIGTERM stops everything (exit 0): the coordinator first
assigns nothing more and lets running attempts finish (for up to the --drain-millis
time), then the workers stop; a second Ctrl-C stops at once.

With --auth-file its workers present a worker token: one of that file, given with
the --token-file flag, JOBMESH_TOKEN or JOBMESH_TOKEN_FILE, or else one that up makes
for this run (kept in memory; the coordinator reads a private copy of the file with
its hash added).

With --tls-cert, the workers connect over TLS and trust exactly that certificate (so
it must carry 127.0.0.1, or the --bind address when that is a specific one); when
given --tls-client-ca they present it as their client certificate too.
""" + SETTINGS_HELP + """
Usage:
  jobmesh up [--workers=N] [--capacity=N] [--tasks=MODULES] [options]

Options:
  --token-file=PATH              with --auth-file: a worker token of that file for its
                                 workers (default: up makes one for this run)
  --workers=N                    local worker processes [default: 2]
  --capacity=N                   concurrent tasks per worker [default: 4]
  --tasks=MODULES                MODULE[,MODULE...]: modules whose @task functions the
                                 workers run besides the built-ins
  --drain-millis=N               on Ctrl-C/SIGTERM, let running attempts finish for up
                                 to N ms before stopping (0 = stop at once) [default: 10000]
  --lease-grace-millis=N         after a coordinator restart, how long a running job
                                 waits for its worker to claim it (default: the
                                 heartbeat timeout)
""" + COORDINATOR_OPTIONS

WORKER_DOC = """Run a jobmesh worker: register with the coordinator and execute tasks.

It reconnects with capped backoff when the coordinator goes away, and meanwhile keeps
its running attempts (and the results of those that finish) for as long as the
flag --keep-running-millis says: registering again, it names them, so a restarted
coordinator started with --lease-grace-millis lets them finish. SIGTERM or SIGINT stops it;
SIGHUP reads its token file again (the next connection presents the new token).
Given --tls or --tls-ca it speaks TLS; the coordinator's certificate must carry the HOST
of --coordinator. Given several addresses (a leader and its standbys), it tries them in
turn, the next one first after a lost connection: a refused address moves on at once, a
silent one after --connect-timeout-millis; the backoff comes between whole rounds.
""" + SETTINGS_HELP + """
Usage:
  jobmesh worker [options]

Options:
  --coordinator=HOST:PORT[,HOST:PORT...]
                                   the coordinator's worker port, or several, tried in
                                   turn [default: 127.0.0.1:7070]
  --connect-timeout-millis=N       give up on an address after this long and try the
                                   next [default: 1000]
  --id=ID                          worker id (default: a generated one)
  --capacity=N                     concurrent tasks, 1..1024 [default: 4]
  --heartbeat-interval-millis=N    heartbeat period [default: 2000]
  --keep-running-millis=N          keep running attempts this long while the coordinator
                                   is unreachable (0 = stop them at once) [default: 30000]
  --tasks=MODULES                  MODULE[,MODULE...]: modules (from the current directory
                                   or PYTHONPATH) whose @task functions this worker runs
                                   besides the built-ins, each in a child process
                                   whose output goes to stderr, the log
  --django=SETTINGS                run the tasks of the Django project with this settings
                                   module (e.g. mysite.settings, from the current
                                   directory or PYTHONPATH) that use jobmesh's backend
  --cancel-grace-millis=N          a cancelled user task that has not returned after N ms
                                   gets SIGTERM (with all it started), after 2N ms SIGKILL
                                   [default: 5000]
  --token-file=PATH                a file holding the worker token to present, for a
                                   coordinator with --auth-file (or JOBMESH_TOKEN, or
                                   JOBMESH_TOKEN_FILE; never a token on the command line)
  --log-level=LEVEL                DEBUG, INFO, WARNING or ERROR [default: INFO]
  --log-format=FORMAT              text, or json: one JSON object per line on stderr [default: text]
  --tls                            connect with TLS, trusting the system's CAs
  --tls-ca=PEM                     connect with TLS, trusting the certificates in this file
  --tls-cert=PEM                   a client certificate to present (with --tls-key)
  --tls-key=PEM                    the private key of --tls-cert
  --config=PATH                    read settings from this TOML file; its keys are flag
                                   names without -- (default: $JOBMESH_CONFIG)
  --print-config                   print the effective settings, each with where it came
                                   from, and exit
  -h --help                        show this help
"""

TLS_CLIENT_OPTIONS = """  --tls                     connect with TLS, trusting the system's CAs ($JOBMESH_TLS)
  --tls-ca=PEM              connect with TLS, trusting the certificates in this file;
                            the certificate must carry HOST ($JOBMESH_TLS_CA)
  --tls-cert=PEM            a client certificate to present ($JOBMESH_TLS_CERT)
  --tls-key=PEM             the private key of --tls-cert ($JOBMESH_TLS_KEY)
"""

CONNECTION_OPTIONS = """  --coordinator=HOST:PORT[,HOST:PORT...]
                            the coordinator's client port; several (a leader and its
                            standbys) are tried in turn ($JOBMESH_COORDINATOR)
                            [default: 127.0.0.1:7071]
  --connect-timeout-millis=N  give up on an address after this long and try the next; a
                            refused one moves on at once [default: 1000]
  --token-file=PATH         a file holding the token to present, for a coordinator with
                            --auth-file (or JOBMESH_TOKEN, or JOBMESH_TOKEN_FILE)
""" + TLS_CLIENT_OPTIONS

CLIENT_OPTIONS = """
""" + CONNECTION_OPTIONS + """  --json                    print one JSON document instead of text
  -h --help                 show this help
"""

SUBMIT_DOC = """Submit a job.

TASK_TYPE is a built-in (SLEEP, WORD_COUNT, SHA256, PRIME_COUNT or FAIL, in any case) or
a type declared by a worker (jobmesh worker --tasks=MODULE; such names are case-sensitive).
PAYLOAD_JSON is the task's payload as JSON, or - to read it from stdin (default: {}).

A job given --delay-millis or --run-at is SCHEDULED until then, and QUEUED after. TIME
is epoch milliseconds or ISO 8601, e.g. 2026-12-24T18:00:00Z (without a zone: local time).

Usage:
  jobmesh submit TASK_TYPE [PAYLOAD_JSON] [options]

Options:
  --max-attempts=N          attempt budget; 0: its task type's (@task max_attempts), else
                            the coordinator's default [default: 0]
  --priority=LEVEL          HIGH, NORMAL or LOW [default: NORMAL]
  --idempotency-key=KEY     submit at most once per key (default: a random one, so
                            that a submit sent again to the next address after a
                            lost connection cannot make two jobs)
  --submit-retries=N        resubmit up to N times when the coordinator is overloaded [default: 0]
  --delay-millis=N          run no earlier than N milliseconds from now
  --run-at=TIME             run no earlier than TIME
  --concurrency-key=K       the key a per-key limit of the type counts this job under
                            (jobmesh limit set TYPE --max-running-per-key=N)
  --unique-key=K            while a job of this type with key K is not finished, submit
                            nothing new and print that job
  --wait                    wait for the job to finish and print its final state
  --timeout-millis=N        with --wait: give up after this long (0 = never) [default: 0]
""" + CLIENT_OPTIONS

STATUS_DOC = """Show one job.

Usage:
  jobmesh status JOB_ID [options]

Options:""" + CLIENT_OPTIONS

LIST_DOC = """List jobs, newest first.

Usage:
  jobmesh list [options]

Options:
  --state=STATE             only jobs in this state (QUEUED, SCHEDULED, RUNNING, WAITING, ...)
  --type=TYPE               only jobs of this task type
  --limit=N                 at most this many jobs [default: 100]
""" + CLIENT_OPTIONS

WORKERS_DOC = """List the live workers.

Usage:
  jobmesh workers [options]

Options:""" + CLIENT_OPTIONS

CANCEL_DOC = """Cancel a job (QUEUED, SCHEDULED, RETRY_WAIT or RUNNING). A finished job is reported as it is.

Usage:
  jobmesh cancel JOB_ID [options]

Options:""" + CLIENT_OPTIONS

WAIT_DOC = """Wait for a job to finish. Exits 0 only if it COMPLETED; 4 on timeout.

Usage:
  jobmesh wait JOB_ID [options]

Options:
  --timeout-millis=N        give up after this long (0 = never) [default: 0]
""" + CLIENT_OPTIONS

EVENTS_DOC = """Show a job's timeline, oldest first: each event, when (from the first event, and the
wall-clock time), the attempt and its worker, and what happened.

Usage:
  jobmesh events JOB_ID [options]

Options:""" + CLIENT_OPTIONS

RETRY_DOC = """Submit a finished job (COMPLETED, FAILED or CANCELLED) again: a new job with the same
type, payload, priority and attempt budget, whose snapshot names the old one in retryOf.

Usage:
  jobmesh retry JOB_ID [options]

Options:""" + CLIENT_OPTIONS

PURGE_DOC = """Delete finished jobs (and their events) last updated longer ago than DURATION.

DURATION is a number with a unit, 90s, 15m, 12h or 7d, or plain milliseconds; 0 means
every finished job. --dry-run deletes nothing and says how many jobs would go.

Usage:
  jobmesh purge --older-than=DURATION [--dry-run] [options]

Options:
  --older-than=DURATION     how long ago a finished job was last updated
  --dry-run                 count the jobs that would be purged; delete nothing
""" + CLIENT_OPTIONS

TOP_DOC = """A live view of the coordinator: jobs by state, submit and finish rates, workers, and
the oldest waiting jobs with the reason each waits. Ctrl-C stops it.

Usage:
  jobmesh top [options]

Options:
  --interval-millis=N       time between refreshes [default: 1000]
  --iterations=N            stop after N refreshes (0 = until Ctrl-C) [default: 0]
""" + CONNECTION_OPTIONS + """  -h --help                 show this help
"""

TOKEN_DOC = """Make, list and remove the tokens of an auth file (TOML, read by the coordinator
through --auth-file; docs/SECURITY.md). The file stores each token's SHA-256 only: 'new'
prints the token once, on stdout, and nowhere else; write it to a file only you can read:
(umask 077; jobmesh token new ci --role=client > ci.token). A running coordinator takes the change on
SIGHUP; removing a token closes its connections then.

Roles: worker (the worker port only), reader (status, list, workers, events, wait,
stats, schedule get/list/preview, limit list/show, and the metrics port), client
(also submit and cancel), admin (everything: retry, purge, schedule changes, limit
set/rm, pause, resume).

Usage:
  jobmesh token new NAME --role=ROLE [--task-types=TYPES] [--auth-file=PATH]
  jobmesh token list [--auth-file=PATH] [--json]
  jobmesh token rm NAME [--auth-file=PATH]

Options:
  --role=ROLE          worker, reader, client or admin
  --task-types=TYPES   NAME[,NAME...]: the only task types the token may submit (client,
                       admin) or declare (worker); NAME may be PREFIX.* for every type
                       that starts with PREFIX.
  --auth-file=PATH     the auth file ($JOBMESH_AUTH_FILE too, as for the coordinator);
                       created, mode 0600, by the first 'new'
                       [default: jobmesh-auth.toml]
  --json               list: one JSON array of {name, role, taskTypes}
  -h --help            show this help
"""

SCHEDULE_DOC = """Recurring schedules: jobs made from a template at cron times or fixed intervals.

A cron EXPR has five fields (minute hour day-of-month month day-of-week, as Debian's
cron reads them) or is @hourly, @daily, @weekly, @monthly or @yearly; its times are
wall-clock times in --tz. --every-millis=N fires every N ms (N >= 1000) from the
schedule's creation. 'add' replaces a schedule of the same name (fire times already
made are not made again). 'preview' prints the next fire times of any expression, so
you can check one before saving it. TIME is epoch milliseconds or ISO 8601.

Usage:
  jobmesh schedule add NAME (--cron=EXPR | --every-millis=N) TASK_TYPE [PAYLOAD_JSON] [options]
  jobmesh schedule list [options]
  jobmesh schedule show NAME [options]
  jobmesh schedule pause NAME [options]
  jobmesh schedule resume NAME [options]
  jobmesh schedule rm NAME [options]
  jobmesh schedule trigger NAME [options]
  jobmesh schedule preview (--cron=EXPR | --every-millis=N) [options]

Options:
  --cron=EXPR                  a cron expression (quote it: '0 3 * * *')
  --every-millis=N             an interval in milliseconds (at least 1000)
  --tz=ZONE                    the IANA time zone of the cron times [default: UTC]
  --missed=POLICY              fire times missed while the coordinator was down: latest,
                               all (at most 100) or skip [default: latest]
  --catchup-window-millis=N    only missed fire times this recent count [default: 86400000]
  --overlap=POLICY             skip: no new job while the last one has not ended; or allow
                               [default: skip]
  --jitter-millis=N            delay each job by an amount in [0, N) fixed per fire time
                               [default: 0]
  --priority=LEVEL             HIGH, NORMAL or LOW [default: NORMAL]
  --max-attempts=N             attempt budget of each job; 0: its task type's (@task
                               max_attempts), else the coordinator's default [default: 0]
  --paused                     add it paused
  --from=TIME                  preview: fire times after this (default: now)
  --count=N                    preview: how many fire times, 1..1000 [default: 10]
""" + CLIENT_OPTIONS

LIMIT_DOC = """Limits per task type, checked where the coordinator assigns: at most N running
(in all, or per concurrency key), at most R starts a second (in all, or per key).

'set' creates or replaces the limits of TASK_TYPE with those it is given (a limit not
given is removed; a pause is kept). 'show' and 'list' print each limit with the type's
running and queued jobs and whether it is paused; 'rm' removes every limit of the type
(and its pause). R is starts a second, e.g. 10 or 0.5 (one every two seconds); --burst
is how many may start at once after a quiet spell (default: R rounded up, at least 1).

Usage:
  jobmesh limit set TASK_TYPE [--max-running=N] [--max-running-per-key=N] [--rate=R] [--burst=N] [--rate-per-key=R] [options]
  jobmesh limit list [options]
  jobmesh limit show TASK_TYPE [options]
  jobmesh limit rm TASK_TYPE [options]

Options:
  --max-running=N           at most N jobs of the type running at once
  --max-running-per-key=N   at most N running at once per --concurrency-key of the job
  --rate=R                  at most R starts a second (a token bucket of --burst)
  --burst=N                 with --rate: starts allowed at once after a quiet spell
  --rate-per-key=R          at most R starts a second per concurrency key (burst 1)
""" + CLIENT_OPTIONS

PAUSE_DOC = """Pause a task type: no job of it starts until 'jobmesh resume'; running jobs go on,
and submits are accepted (they wait QUEUED). The pause holds across restarts.

Usage:
  jobmesh pause TASK_TYPE [options]

Options:""" + CLIENT_OPTIONS

RESUME_DOC = """Resume a paused task type: its queued jobs start again, within its limits.

Usage:
  jobmesh resume TASK_TYPE [options]

Options:""" + CLIENT_OPTIONS

WORKFLOW_DOC = """Workflows: jobs that depend on each other, submitted together and created in one
commit (docs/OPERATIONS.md, "Workflows"). A job starts once every job it depends on has
COMPLETED, and gets their results (ctx.parents); until then it is WAITING. If one of
them FAILED or was CANCELLED, its dependents are CANCELLED; other branches go on.

FILE (or - for stdin) holds one JSON object, the workflow: a "name" (optional) and its
"jobs", each a submit's fields (taskType, payload, priority, maxAttempts, delayMillis,
...) with a "ref" of its own and the refs it depends on in "dependsOn":

  {"name": "etl", "jobs": [
    {"ref": "fetch", "taskType": "FETCH", "payload": {"url": "https://example.com/a.csv"}},
    {"ref": "load", "taskType": "LOAD", "payload": {}, "dependsOn": ["fetch"]}]}

'submit' prints the workflowId (with --json, {"workflowId", "jobIds": {ref: jobId}});
each job gets the idempotency key KEY:REF, so a submit sent again after a lost
connection makes no second workflow. 'status', 'cancel' and 'wait' print the
workflow's state, its jobs counted by state, and a line per job (in a large workflow
only the unfinished ones; with --json all of them). 'wait', and 'submit' with --wait,
exit 0 when every job COMPLETED, 1 when the workflow ended FAILED or CANCELLED, and 4
when the time of --timeout-millis ran out.

Usage:
  jobmesh workflow submit FILE [--wait] [--timeout-millis=N] [--idempotency-key=KEY] [options]
  jobmesh workflow status ID [options]
  jobmesh workflow cancel ID [options]
  jobmesh workflow wait ID [--timeout-millis=N] [options]

Options:
  --wait                    wait for the workflow to end and print it
  --timeout-millis=N        give up waiting after this long (0 = never) [default: 0]
  --idempotency-key=KEY     the key the jobs' keys are made from (KEY:REF); submitting
                            with the same key again answers the workflow it made
                            (default: a random one)
""" + CLIENT_OPTIONS

DOCS = {
    "coordinator": COORDINATOR_DOC,
    "up": UP_DOC,
    "worker": WORKER_DOC,
    "submit": SUBMIT_DOC,
    "status": STATUS_DOC,
    "list": LIST_DOC,
    "workers": WORKERS_DOC,
    "cancel": CANCEL_DOC,
    "wait": WAIT_DOC,
    "events": EVENTS_DOC,
    "retry": RETRY_DOC,
    "purge": PURGE_DOC,
    "top": TOP_DOC,
    "schedule": SCHEDULE_DOC,
    "limit": LIMIT_DOC,
    "pause": PAUSE_DOC,
    "resume": RESUME_DOC,
    "token": TOKEN_DOC,
    "workflow": WORKFLOW_DOC,
}
CLIENT_COMMANDS = ("submit", "status", "list", "workers", "cancel", "wait", "events", "retry", "purge", "top",
                   "schedule", "limit", "pause", "resume", "workflow")
SERVER_COMMANDS = ("coordinator", "up", "worker")
OTHER_COMMANDS = ("token",)


class UsageError(Exception):
    """The command line does not match the usage; the message says how."""


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse argv into (command, docopt dict). Raises UsageError, DocoptExit or SystemExit (help)."""
    try:
        top = docopt(MAIN_DOC, argv=argv, version="jobmesh " + __version__, options_first=True)
    except DocoptExit:
        if not argv:
            raise  # bare ``jobmesh``: the usage is the answer
        # docopt-ng says "found unmatched (duplicate?) arguments [Option('-v', ...)]": say it plainly.
        raise UsageError("jobmesh: unknown option %s; run 'jobmesh --help' for the commands and options"
                         % argv[0]) from None
    command = top["<command>"]
    if command not in DOCS:
        raise UsageError("jobmesh: unknown command %r%s\n\nUsage: jobmesh <command> [<args>...]; commands: %s\n"
                         "Run 'jobmesh --help' for what each does."
                         % (command, _did_you_mean(command, DOCS), ", ".join(SERVER_COMMANDS + CLIENT_COMMANDS
                                                                             + OTHER_COMMANDS)))
    try:
        args = docopt(DOCS[command], argv=[command] + list(top["<args>"]), version="jobmesh " + __version__)
    except DocoptExit as exc:
        # docopt-ng reports a missing positional as "found unmatched (duplicate?) arguments";
        # say what is wrong in our own words: the flag it does not know, or the usage lines.
        usage = str(exc).split("Usage:", 1)[-1].strip()
        unknown = _unknown_options(DOCS[command], top["<args>"])
        what = ("unknown option %s%s" % (unknown[0], _did_you_mean(unknown[0], _options_of(DOCS[command])))
                if unknown else "missing, unknown or misplaced arguments")
        raise UsageError(
            "jobmesh %s: %s\n\nUsage:\n  %s\n\nRun 'jobmesh %s --help' for details." % (command, what, usage, command)
        ) from None
    return command, args


def _options_of(doc: str) -> list[str]:
    """The long options a usage text declares."""
    return sorted(set(re.findall(r"--[a-z][a-z0-9-]*", doc)))


def _long_args(args: list[str]) -> list[str]:
    """The ``--flags`` ``args`` names (before any ``--``), without their values."""
    names = []
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("--"):
            names.append(arg.split("=", 1)[0])
    return names


def _resolve(name: str, known: list[str]) -> str | None:
    """The option ``name`` means, whole or as a unique prefix of one, as docopt reads it."""
    matches = [name] if name in known else [k for k in known if k.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def _unknown_options(doc: str, args: list[str]) -> list[str]:
    """The ``--flags`` in ``args`` that ``doc`` declares neither whole nor as a unique prefix."""
    known = _options_of(doc)
    return [name for name in _long_args(args) if _resolve(name, known) is None]


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return " (did you mean %r?)" % close[0] if close else ""


def setup_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Log to stderr at ``level``; ``log_format`` ``json`` makes every stderr line a JSON object.

    In json mode, warnings, gevent's hub (greenlet errors, blocking reports) and an uncaught
    exception are written as JSON objects too, so nothing else reaches stderr as plain text.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level, logging.INFO), handlers=[handler])
    if log_format != "json":
        return
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    if "gevent" in sys.modules:  # a server command: the entry patched, the hub exists or will
        import gevent

        gevent.get_hub().exception_stream = JsonLines(sys.stderr, "gevent.hub")


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    logging.getLogger("jobmesh").critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))


def _wants_json_logs(argv: list[str]) -> bool:
    """Whether a server command's argv asks for --log-format=json (before, or without, parsing it)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--log-format="):
            return arg.split("=", 1)[1].lower() == "json"
        if arg == "--log-format" and i + 1 < len(argv):
            return argv[i + 1].lower() == "json"
    return False


def _report(text: str, as_json: bool) -> None:
    """An error the CLI prints itself, on stderr: as is, or as one JSON log object."""
    if as_json:
        text = json_line("ERROR", "jobmesh.cli", text)
    print(text, file=sys.stderr)


def _print_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush cannot fail again
    (the Python docs' recipe for SIGPIPE, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str]) -> int:
    """Run one command; returns its exit code. Nothing escapes as a traceback."""
    command = None
    json_logs = bool(argv) and argv[0] in SERVER_COMMANDS and _wants_json_logs(argv[1:])
    try:
        try:
            command, args = parse(argv)
        except (DocoptExit, UsageError) as exc:
            _report(str(exc), json_logs)
            return EXIT_USAGE
        return _run(command, argv, args, json_logs)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # the backstop: one line, not a traceback
        if os.environ.get("JOBMESH_DEBUG") == "1":
            traceback.print_exc()
        text = " ".join(str(exc).split())  # one line, however the message was written
        print("jobmesh%s: internal error: %s: %s"
              % (" " + command if command else "", type(exc).__name__, text[:500]), file=sys.stderr)
        return EXIT_FAILED


# Client commands take these flags from the environment too (JOBMESH_COORDINATOR,
# JOBMESH_TLS_CA ...); their other flags come from the command line alone.
CLIENT_ENV_FLAGS = ("--coordinator", "--connect-timeout-millis", "--tls", "--tls-ca", "--tls-cert", "--tls-key")
# `jobmesh token` edits the file the coordinator reads: JOBMESH_AUTH_FILE names it for both.
TOKEN_ENV_FLAGS = ("--auth-file",)


def settings(command: str, argv: list[str], args: dict[str, Any], environ: Any) -> tuple[dict[str, Any], dict[str, Source]]:
    """docopt's dict for ``command`` with each setting from the command line, the
    environment, the --config file or the default, in that order, and where each came from.

    docopt fills in defaults, which must not beat the environment, so the flags the
    command line gave are read from argv itself (``given_flags``)."""
    given = given_flags(DOCS[command], argv[argv.index(command) + 1:])
    flags = None if command in SERVER_COMMANDS else TOKEN_ENV_FLAGS if command == "token" else CLIENT_ENV_FLAGS
    return layered(args, given, environ, flags)


def given_flags(doc: str, args: list[str]) -> set[str]:
    """The long options ``args`` names, whole or as a unique prefix, as docopt reads them."""
    known = _options_of(doc)
    return {flag for flag in (_resolve(name, known) for name in _long_args(args)) if flag is not None}


def _print_config(command: str, args: dict[str, Any], sources: dict[str, Source]) -> int:
    """``--print-config``: check the settings as a start would, then print them."""
    from jobmesh.config import coordinator_config, is_database_url, worker_config
    from jobmesh.store.opening import shown

    db = str(args.get("--db"))
    if command == "worker":
        worker_config(args)
    else:
        cfg = coordinator_config(args)
        if shown(db) != db:  # a URL's password: the line shows the rest, as a comment
            args = dict(args, **{"--db": shown(db)})
    _print_line("# jobmesh %s: effective settings (command line > environment > --config file > default)" % command)
    path = args.get("--config") or os.environ.get(CONFIG_ENV)
    if path:
        _print_line("# config file: %s (from %s)" % (path, "--config" if args.get("--config") else CONFIG_ENV))
    for line in describe_settings(args, sources):
        if line.startswith("db = ") and args.get("--db") != db:
            line = "# " + line + ", its password not shown"
        if line.startswith("# lease-grace-millis is not set") and command != "worker":
            if command == "up":
                line += "; up gives its coordinator the heartbeat timeout, %d ms" % cfg.heartbeat_timeout_millis
            elif cfg.lease_grace_millis:
                line += "; on PostgreSQL it is the heartbeat timeout, %d ms" % cfg.lease_grace_millis
        if line.startswith("# db-synchronous is not set") and command != "worker" and not is_database_url(db):
            line += "; FULL on an SQLite file"
        _print_line(line)
    return EXIT_OK


def _run(command: str, argv: list[str], args: dict[str, Any], json_logs: bool) -> int:
    sources: dict[str, Source] = {}
    try:
        args, sources = settings(command, argv, args, os.environ)
        json_logs = json_logs or str(args.get("--log-format")).lower() == "json"
        if args.get("--print-config"):
            return _print_config(command, args, sources)
        if command == "coordinator":
            from jobmesh.config import coordinator_config
            from jobmesh.coordinator.shell.runtime import run_coordinator

            cfg = coordinator_config(args)
            setup_logging(cfg.log_level, cfg.log_format)
            return run_coordinator(cfg, announce=_print_line)
        if command == "up":
            from jobmesh.config import coordinator_config
            from jobmesh.up import run_up

            cfg = coordinator_config(args)
            setup_logging(cfg.log_level, cfg.log_format)
            return run_up(args)
        if command == "worker":
            from jobmesh.config import worker_config
            from jobmesh.worker.agent import run_worker

            worker_cfg = worker_config(args)
            setup_logging(worker_cfg.log_level, worker_cfg.log_format)
            if worker_cfg.django_settings is not None:
                from jobmesh.contrib.django_worker import set_up

                set_up(worker_cfg.django_settings, worker_cfg.worker_id)
            return run_worker(worker_cfg)
        if command == "token":
            return run_token_command(args)
        from jobmesh.client.commands import Console, run_client_command

        setup_logging("WARNING")
        return run_client_command(command, args, Console(sys.stdout, sys.stderr, sys.stdin))
    except ConfigError as exc:
        _report("jobmesh %s: %s" % (command, blame(str(exc), sources)), json_logs)
        return EXIT_USAGE


def _exposed_stdout() -> int | None:
    """The mode of the regular file stdout was redirected to, when others may read it."""
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return None
    import stat

    return st.st_mode & 0o7777 if stat.S_ISREG(st.st_mode) and st.st_mode & 0o044 else None


def run_token_command(args: dict[str, Any]) -> int:
    """``jobmesh token new|list|rm``: edit an auth file. ``AuthFileError`` (a ConfigError) for
    a bad name, role or file: one line, exit 2."""
    from jobmesh import auth

    path = args["--auth-file"]
    if args["new"]:
        raw_types = args["--task-types"]
        task_types = None if raw_types is None else tuple(t.strip() for t in raw_types.split(",") if t.strip())
        token = auth.new_token(path, args["NAME"], args["--role"], task_types)
        _print_line(token)
        print("jobmesh token: added %r (role %s) to %s; the token above is shown only this once. A running "
              "coordinator takes it on SIGHUP." % (args["NAME"], args["--role"], path), file=sys.stderr)
        exposed = _exposed_stdout()
        if exposed is not None:
            print("jobmesh token: warning: the token went into a file other users may read (mode %04o): chmod 600 "
                  "it, and make the next one with (umask 077; jobmesh token new ... > FILE)" % exposed,
                  file=sys.stderr)
        return EXIT_OK
    if args["rm"]:
        auth.remove_token(path, args["NAME"])
        print("jobmesh token: removed %r from %s; a running coordinator drops it (and closes its connections) "
              "on SIGHUP" % (args["NAME"], path), file=sys.stderr)
        return EXIT_OK
    entries = auth.list_tokens(path)
    if args["--json"]:
        import json

        _print_line(json.dumps([{"name": e.name, "role": e.role,
                                 "taskTypes": None if e.task_types is None else list(e.task_types)}
                                for e in entries]))
        return EXIT_OK
    width = max([4] + [len(e.name) for e in entries])
    _print_line("%-*s  %-6s  %s" % (width, "NAME", "ROLE", "TASK TYPES"))
    for e in entries:
        _print_line("%-*s  %-6s  %s" % (width, e.name, e.role, "any" if e.task_types is None
                                         else ", ".join(e.task_types) or "none"))
    return EXIT_OK
