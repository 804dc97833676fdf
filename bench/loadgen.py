"""Drive load at a jobmesh coordinator; report throughput, latency, memory and losses.

Usage:
  loadgen [options] [--coordinator-arg=ARG]... [--worker-arg=ARG]...
  loadgen (-h | --help)

Modes:
  submit   closed-loop SUBMIT_JOB on every connection (durable submits/s)
  e2e      submit and wait for completion: --e2e-style=stream (clients submit, one
           checker waits for every job) or loop (each client submits, then waits for
           its own job with WAIT_JOB until it ends, then submits the next)
  status   GET_JOB_STATUS of random jobs submitted during set-up
  mixed    per request, submit / status / list / cancel by --mix weights
  idle     open the connections and hold them (--hold); coordinator RSS per connection
  burst    open the connections, then every one submits once at the same moment

Options:
  --coordinator=HOST:PORT     attach to this client port instead of starting a coordinator
  --coordinator-worker=HOST:PORT  its worker port (needed to start workers when attached)
  --coordinator-pid=PID       its pid, to sample its RSS when attached
  --mode=MODE                 submit, e2e, status, mixed, idle or burst [default: e2e]
  --clients=C                 client connections [default: 1000]
  --workers=W                 workers to start (default: 8 for e2e and mixed, else 0)
  --worker-impl=IMPL          process (python -m jobmesh worker) or builtin (scripted
                              greenlets in this process) [default: process]
  --capacity=K                concurrent tasks per worker [default: 32]
  --jobs=N                    jobs to have accepted (requests in status mode) [default: 10000]
  --duration=S                run the load for S seconds instead of --jobs
  --task=SPEC                 TYPE[:ARG][=WEIGHT],... or a named mix (sleep0, mixed,
                              cpu, sleep10, flaky) [default: sleep0]
  --priority=SPEC             LEVEL[=WEIGHT],... of HIGH, NORMAL, LOW, NONE [default: NORMAL]
  --types=N                   submit declared task types T0..T(N-1) instead of --task (payload
                              {}, equal weights, chosen by the seeded per-client generator);
                              needs --worker-impl=builtin [default: 0]
  --types-per-worker=K        with --types: worker i declares T(i mod N)..T(i+K-1 mod N)
                              (default: all N)
  --max-attempts=N            maxAttempts on each submit (0 = coordinator default) [default: 0]
  --idempotency-keys          send a unique idempotencyKey with every submit
  --dup-rate=F                with keys, in submit mode and e2e stream style: chance that a
                              request resends an earlier key [default: 0]
  --e2e-style=STYLE           stream or loop [default: stream]
  --mix=SPEC                  mixed-mode weights of submit, status, list, cancel
                              [default: submit=6,status=3,list=1]
  --status-jobs=N             status mode: jobs submitted during set-up [default: 1000]
  --hold=S                    idle mode: seconds to hold the connections [default: 5]
  --seed=N                    seed for every random choice [default: 1]
  --connect-burst=N           connects in flight at once [default: 500]
  --timeout=S                 cap on the load phase, seconds [default: 120]
  --drain-timeout=S           cap on waiting for accepted jobs to end, seconds [default: 120]
  --verify=WHAT               full (status of every job + LIST_JOBS paging), status, or none
                              [default: full]
  --compare-echo              submit mode: also drive the echo baseline with the same
                              clients and load, and print the ratio
  --coordinator-arg=ARG       extra flag for the coordinator we start (repeatable), e.g.
                              --coordinator-arg=--max-active-jobs=1000000
  --worker-arg=ARG            extra flag for each worker process (repeatable)
  --db-synchronous=MODE       FULL or NORMAL, for the coordinator we start [default: FULL]
  --postgres                  run the coordinator we start on a fresh database of a throwaway
                              PostgreSQL server (bench/pgserver.py: Debian's postgresql, fsync
                              on), stopped at the end, instead of an SQLite file
  --tls-ca=PEM                connect the clients and scripted workers with TLS, trusting
                              this file; give the coordinator its certificate and the
                              worker processes this file with the pass-through flags
                              (--coordinator-arg=--tls-cert=..., --worker-arg=--tls-ca=...)
  --tls                       make a CA and a certificate for 127.0.0.1 in the run
                              directory, start the coordinator with them, and connect the
                              clients and workers with TLS (a coordinator it starts)
  --auth                      make an auth file in the run directory with a client and a
                              worker token, start the coordinator with --auth-file, and
                              present the tokens (a coordinator it starts)
  --token-file=PATH           the token the client connections present (AUTH), role
                              client or admin: for an attached coordinator, or one given
                              its auth file by a pass-through flag
  --worker-token-file=PATH    the worker token its workers present (worker processes get
                              it as their own token file)
  --run-dir=DIR               keep the database and logs here (default: a temp dir, removed)
  --out=FILE                  write the JSON report to FILE
  --quiet                     no live progress line on stderr
  -h --help                   show this help

Exit status: 0 when every accepted job is accounted for, 1 if any was lost or
duplicated, 2 on a usage error, 3 if the set-up failed, 130 when interrupted.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gevent
import gevent.event
from docopt import DocoptExit, docopt

from bench import procs
from bench.builtin_worker import BuiltinWorkers
from bench.conns import Conn, ConnError, classify, open_many, raise_fd_limit, use_tls, use_token
from bench.histogram import Histogram
from bench.pgserver import PostgresServer, ServerFailed
from bench.drive import (TERMINAL, CompletionTracker, Phase, run_clients, status_frame, submit_client,
                         submit_once, wait_frame, wait_phase)
from bench.workload import SpecError, Workload, worker_types
from jobmesh.addresses import parse_address
from jobmesh.auth import new_token, read_token
from jobmesh.errors import BadAddress, ConfigError
from jobmesh.protocol.framing import encode_frame

MODES = ("submit", "e2e", "status", "mixed", "idle", "burst")
EXIT_OK, EXIT_LOST, EXIT_USAGE, EXIT_SETUP, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
VERIFY_CONNS = 8
LIST_PAGE = 1000


class UsageError(Exception):
    pass


def _hostport(value: str, flag: str) -> tuple[str, int]:
    try:
        address = parse_address(value, flag)
    except BadAddress as exc:
        raise UsageError(str(exc)) from None
    return address.host, address.port


def _num(args: dict, flag: str, kind=int, low: float = 0) -> Any:
    try:
        value = kind(args[flag])
    except (TypeError, ValueError):
        raise UsageError("%s must be a number, got %r" % (flag, args[flag])) from None
    if value < low:
        raise UsageError("%s must be >= %s" % (flag, low))
    return value


def parse_args(argv: list[str]) -> dict[str, Any]:
    """argv -> options dict with typed values; raises UsageError or DocoptExit."""
    a = docopt(__doc__, argv=argv)
    o: dict[str, Any] = {}
    o["mode"] = a["--mode"]
    if o["mode"] not in MODES:
        raise UsageError("--mode must be one of %s" % ", ".join(MODES))
    o["clients"] = _num(a, "--clients", int, 1)
    if a["--workers"] is None:
        o["workers"] = 8 if o["mode"] in ("e2e", "mixed") else 0
    else:
        o["workers"] = _num(a, "--workers", int, 0)
    o["worker_impl"] = a["--worker-impl"]
    if o["worker_impl"] not in ("process", "builtin"):
        raise UsageError("--worker-impl must be process or builtin")
    o["capacity"] = _num(a, "--capacity", int, 1)
    o["duration"] = _num(a, "--duration", float, 0.1) if a["--duration"] else None
    o["jobs"] = None if o["duration"] else _num(a, "--jobs", int, 1)
    o["task"] = a["--task"]
    o["types"] = _num(a, "--types", int, 0)
    o["types_per_worker"] = None
    if a["--types-per-worker"] is not None:
        if not o["types"]:
            raise UsageError("--types-per-worker goes with --types")
        o["types_per_worker"] = _num(a, "--types-per-worker", int, 1)
        if o["types_per_worker"] > o["types"]:
            raise UsageError("--types-per-worker must be <= --types")
    elif o["types"]:
        o["types_per_worker"] = o["types"]
    o["priority"] = a["--priority"]
    o["max_attempts"] = _num(a, "--max-attempts", int, 0)
    o["keys"] = bool(a["--idempotency-keys"])
    o["dup_rate"] = _num(a, "--dup-rate", float, 0)
    if o["dup_rate"] and not o["keys"]:
        raise UsageError("--dup-rate needs --idempotency-keys")
    o["e2e_style"] = a["--e2e-style"]
    if o["e2e_style"] not in ("stream", "loop"):
        raise UsageError("--e2e-style must be stream or loop")
    o["mix"] = _parse_mix(a["--mix"])
    o["status_jobs"] = _num(a, "--status-jobs", int, 1)
    o["hold"] = _num(a, "--hold", float, 0)
    o["seed"] = _num(a, "--seed", int, 0)
    o["connect_burst"] = _num(a, "--connect-burst", int, 1)
    o["timeout"] = _num(a, "--timeout", float, 1)
    o["drain_timeout"] = _num(a, "--drain-timeout", float, 0)
    o["verify"] = a["--verify"]
    if o["verify"] not in ("full", "status", "none"):
        raise UsageError("--verify must be full, status or none")
    o["compare_echo"] = bool(a["--compare-echo"])
    if o["compare_echo"] and o["mode"] != "submit":
        raise UsageError("--compare-echo goes with --mode=submit")
    o["coordinator"] = _hostport(a["--coordinator"], "--coordinator") if a["--coordinator"] else None
    o["coordinator_worker"] = _hostport(a["--coordinator-worker"], "--coordinator-worker") if a["--coordinator-worker"] else None
    o["coordinator_pid"] = _num(a, "--coordinator-pid", int, 1) if a["--coordinator-pid"] else None
    if o["coordinator"] and o["workers"] and not o["coordinator_worker"]:
        raise UsageError("starting workers for an attached coordinator needs --coordinator-worker")
    o["coordinator_args"] = list(a["--coordinator-arg"])
    o["worker_args"] = list(a["--worker-arg"])
    o["db_synchronous"] = a["--db-synchronous"].upper()
    o["postgres"] = bool(a["--postgres"])
    if o["postgres"] and o["coordinator"]:
        raise UsageError("--postgres starts the coordinator's database: it does not go with --coordinator")
    if o["db_synchronous"] not in ("FULL", "NORMAL"):
        raise UsageError("--db-synchronous must be FULL or NORMAL")
    if o["types"]:
        # jobmesh worker has no --tasks flag on this tree, so only scripted workers declare types.
        if o["workers"] and o["worker_impl"] != "builtin":
            raise UsageError("--types needs --worker-impl=builtin")
        if not o["workers"] and not o["coordinator"]:
            raise UsageError("--types needs workers (a coordinator accepts a declared type once a worker declared it)")
        if o["workers"] and o["workers"] + o["types_per_worker"] - 1 < o["types"]:
            raise UsageError("%d workers with %d types each leave a type undeclared; need workers >= %d"
                             % (o["workers"], o["types_per_worker"], o["types"] - o["types_per_worker"] + 1))
    o["tls_ca"] = a["--tls-ca"]
    o["tls"] = bool(a["--tls"])
    o["auth"] = bool(a["--auth"])
    o["token_file"] = a["--token-file"]
    o["worker_token_file"] = a["--worker-token-file"]
    if o["tls"] and o["tls_ca"]:
        raise UsageError("--tls makes its own CA: give --tls or --tls-ca, not both")
    if o["auth"] and (o["token_file"] or o["worker_token_file"]):
        raise UsageError("--auth makes its own tokens: give --auth or --token-file/--worker-token-file, not both")
    for flag, key in (("--tls", "tls"), ("--auth", "auth")):
        if o[key] and o["coordinator"]:
            raise UsageError("%s goes with a coordinator it starts (attached: --tls-ca, --token-file)" % flag)
    o["run_dir"] = a["--run-dir"]
    o["out"] = a["--out"]
    o["quiet"] = bool(a["--quiet"])
    return o


def _parse_mix(spec: str) -> list[tuple[str, float]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        op, _, w = part.partition("=")
        if op not in ("submit", "status", "list", "cancel"):
            raise UsageError("--mix operations are submit, status, list, cancel; got %r" % op)
        try:
            out.append((op, float(w) if w else 1.0))
        except ValueError:
            raise UsageError("bad weight in --mix %r" % part) from None
    if not out or not any(w > 0 for op, w in out if op == "submit"):
        raise UsageError("--mix needs a submit weight above 0")
    return out


def _revision() -> str | None:
    """The commit measured, with "+dirty" if jobmesh/ had uncommitted changes.

    A tree exported without ``.git`` (``git archive``) is named by its ``REVISION`` file.
    """
    import subprocess as _sp

    stamp = procs.REPO_ROOT / "REVISION"
    if not (procs.REPO_ROOT / ".git").exists() and stamp.exists():
        return stamp.read_text().strip() or None
    try:
        head = _sp.run(["git", "rev-parse", "--short", "HEAD"], cwd=procs.REPO_ROOT, capture_output=True,
                       text=True, timeout=5).stdout.strip()
        dirty = _sp.run(["git", "status", "--porcelain", "--", "jobmesh"], cwd=procs.REPO_ROOT,
                        capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, _sp.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


class LoadGen:
    def __init__(self, opts: dict[str, Any]) -> None:
        self.o = opts
        self.workload = Workload(opts["task"], opts["priority"], opts["seed"], opts["keys"], opts["max_attempts"],
                                 opts["types"])
        self.abort = gevent.event.Event()
        self.interrupted = False
        self.children: list[procs.Child] = []
        self.builtin: BuiltinWorkers | None = None
        self.coordinator: procs.Child | None = None
        self.postgres: PostgresServer | None = None  # with --postgres: the coordinator's server
        self.client_addr: tuple[str, int] | None = None
        self.worker_addr: tuple[str, int] | None = None
        self.rss: procs.RssSampler | None = None
        self.run_dir: Path | None = None
        self.own_run_dir = False
        self.phase = Phase("load", opts["jobs"])
        self.tracker = CompletionTracker()
        self.e2e_hist = None
        self.conns: list[Conn] = []
        self.status_ids: list[str] = []
        self.live_conns = 0
        self.extra: dict[str, Any] = {}
        self.setup_errors: Counter = Counter()
        self.started = time.monotonic()
        self.cpu_start: float | None = None
        self.progress_g: gevent.Greenlet | None = None
        # TLS and tokens (--tls, --auth, --token-file, --worker-token-file): the flags they add
        # for the coordinator and the worker processes, and the scripted workers' token.
        self.secure_args: list[str] = []
        self.worker_secure_args: list[str] = []
        self.worker_token: str | None = None

    # ---- set-up and tear-down ---------------------------------------------------------

    def setup(self) -> None:
        o = self.o
        if o["run_dir"]:
            self.run_dir = Path(o["run_dir"]).resolve()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-bench-"))
            self.own_run_dir = True
        self.secure(o)
        if o["coordinator"]:
            self.client_addr = o["coordinator"]
            self.worker_addr = o["coordinator_worker"]
            pid = o["coordinator_pid"]
            Conn.open(self.client_addr).close()  # fail fast if nothing listens there
        else:
            db: Path | str = self.run_dir / "bench.db"
            for suffix in ("", "-wal", "-shm"):
                p = Path(str(db) + suffix)
                if p.exists():
                    p.unlink()
            if o["postgres"]:
                try:
                    self.postgres = PostgresServer(durable=True).start()
                except ServerFailed as exc:
                    raise procs.ChildFailed("PostgreSQL: %s" % exc) from None
                db = self.postgres.database("bench")
            self.coordinator, self.worker_addr, self.client_addr = procs.start_coordinator(
                self.run_dir, db, None if o["postgres"] else o["db_synchronous"],
                o["coordinator_args"] + self.secure_args)
            self.children.append(self.coordinator)
            pid = self.coordinator.pid
        self.rss = procs.RssSampler(pid)
        if pid:
            self.cpu_start = procs.cpu_seconds(pid)
        if o["workers"]:
            if o["worker_impl"] == "builtin":
                types = None
                if o["types"]:
                    types = [worker_types(i, o["types"], o["types_per_worker"]) for i in range(o["workers"])]
                self.builtin = BuiltinWorkers(self.worker_addr, o["workers"], o["capacity"], types, self.worker_token)
                self.builtin.start()
            else:
                for i in range(o["workers"]):
                    self.children.append(procs.start_worker(self.run_dir, i, self.worker_addr, o["capacity"],
                                                            o["worker_args"] + self.worker_secure_args))
            self._await_workers(o["workers"], timeout=30.0)

    def secure(self, o: dict[str, Any]) -> None:
        """TLS and tokens: with --tls a CA and a server certificate, with --auth an auth file
        and a client and a worker token, all made in the run directory; the flags the
        coordinator and the worker processes get for them, and what our connections use."""
        assert self.run_dir is not None
        if o["tls"]:
            from tests.tls_support import make_certs  # cryptography, as the tests make certificates

            certs = make_certs(self.run_dir / "certs")
            self.secure_args += ["--tls-cert=%s" % certs.server, "--tls-key=%s" % certs.server_key]
            self.worker_secure_args.append("--tls-ca=%s" % certs.ca)
            use_tls(str(certs.ca))
        token_file, worker_token_file = o["token_file"], o["worker_token_file"]
        if o["auth"]:
            auth_file = self.run_dir / "auth.toml"
            if auth_file.exists():
                auth_file.unlink()  # a kept --run-dir: fresh tokens each run
            token_file, worker_token_file = self.run_dir / "client.token", self.run_dir / "worker.token"
            for path, role in ((token_file, "client"), (worker_token_file, "worker")):
                token = new_token(str(auth_file), "bench-" + role, role)
                path.touch(0o600)
                path.write_text(token + "\n")
            self.secure_args.append("--auth-file=%s" % auth_file)
        if token_file:
            use_token(read_token(str(token_file), {}))
        if worker_token_file:
            self.worker_token = read_token(str(worker_token_file), {})
            self.worker_secure_args.append("--token-file=%s" % worker_token_file)

    def _await_workers(self, count: int, timeout: float) -> None:
        conn = Conn.open(self.client_addr)
        try:
            deadline = time.monotonic() + timeout
            while True:
                reply = conn.request_obj({"type": "LIST_WORKERS"})
                ours = [w for w in reply.get("workers", []) if str(w.get("workerId", "")).startswith("bench-")]
                if len(ours) >= count:
                    return
                for child in self.children[1:] if self.coordinator else self.children:
                    if not child.alive():
                        raise procs.ChildFailed("%s exited rc=%s:\n%s" % (
                            child.name, child.proc.returncode, procs.tail(child.err_path)))
                if time.monotonic() > deadline:
                    raise procs.ChildFailed("only %d of %d workers registered within %.0fs"
                                            % (len(ours), count, timeout))
                gevent.sleep(0.05)
        finally:
            conn.close()

    def teardown(self) -> dict[str, Any]:
        if self.progress_g is not None:
            self.progress_g.kill(block=False)
        for c in self.conns:
            c.close()
        if self.builtin is not None:
            self.builtin.stop()
        cpu = procs.cpu_seconds(self.coordinator.pid) if self.coordinator else None
        if cpu is not None and self.cpu_start is not None:
            self.extra["coordinator_cpu_total_s"] = round(cpu - self.cpu_start, 2)
        if self.rss is not None:
            self.rss.stop()
        codes = procs.stop_all(self.children)
        if self.postgres is not None:
            self.postgres.stop()
        if self.own_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return codes

    def on_signal(self) -> None:
        if self.interrupted:  # second Ctrl-C: stop now
            for child in self.children:
                child.signal(signal.SIGKILL)
            os._exit(EXIT_INTERRUPTED)
        self.interrupted = True
        sys.stderr.write("\ninterrupted: stopping the load and reporting what was measured\n")
        self.abort.set()
        self.phase.stop.set()

    # ---- progress -----------------------------------------------------------------------

    def _progress(self) -> None:
        tty = sys.stderr.isatty()
        last = (time.monotonic(), 0, 0, 0)
        while True:
            gevent.sleep(1.0)
            now = time.monotonic()
            p = self.phase
            done = len(self.tracker.done)
            ops = p.ops + p.sent
            dt = now - last[0]
            rss = self.rss.last_kb if self.rss else None
            line = ("[%6.1fs] conns=%d submitted=%d (%.0f/s) completed=%d (%.0f/s) ops/s=%.0f rejected=%d "
                    "errors=%d coord_rss=%s" % (
                        now - self.started, self.live_conns, p.accepted, (p.accepted - last[1]) / dt,
                        done, (done - last[2]) / dt, (ops - last[3]) / dt, p.rejected, sum(p.errors.values()),
                        "%.0fMB" % (rss / 1024) if rss else "?"))
            sys.stderr.write(("\r" + line + "   ") if tty else (line + "\n"))
            sys.stderr.flush()
            last = (now, p.accepted, done, ops)

    # ---- phases -------------------------------------------------------------------------

    def connect(self, count: int) -> None:
        burst = self.o["connect_burst"]
        deadline = 30.0 + count / 100.0

        def progress(n: int) -> None:
            self.live_conns = len(self.conns) + n

        t0 = time.perf_counter()
        self.conns = open_many(self.client_addr, count, burst, self.phase.errors, deadline, progress)
        self.live_conns = len(self.conns)
        self.extra["connect_s"] = round(time.perf_counter() - t0, 3)

    def run(self) -> None:
        o = self.o
        mode = o["mode"]
        if not o["quiet"]:
            self.progress_g = gevent.spawn(self._progress)
        if mode == "idle":
            return self.run_idle()
        if mode == "burst":
            return self.run_burst()
        if mode == "status":
            self.setup_status_jobs()
        self.connect(o["clients"])
        if self.abort.is_set():
            return
        wait_jobs = self.waits_for_completion()
        load_done = gevent.event.Event()
        checker = None
        if wait_jobs and not (mode == "e2e" and o["e2e_style"] == "loop"):
            checker = gevent.spawn(self.tracker.checker, Conn.open(self.client_addr), self.phase.ids,
                                   load_done, self.abort)
        if mode == "submit" or (mode == "e2e" and o["e2e_style"] == "stream"):
            greenlets = run_clients(self.conns, submit_client, self.phase, self.workload, o["dup_rate"])
        elif mode == "e2e":
            self.e2e_hist = Histogram()
            greenlets = run_clients(self.conns, self.loop_client)
        elif mode == "status":
            greenlets = run_clients(self.conns, self.status_client)
        else:
            greenlets = run_clients(self.conns, self.mixed_client)
        deadline = o["duration"] if o["duration"] else o["timeout"]
        if mode == "e2e" and o["e2e_style"] == "loop" and not o["duration"]:
            deadline = o["timeout"] + o["drain_timeout"]
        cpu0 = self.cpu_snapshot()
        self.extra["load_finished"] = wait_phase(greenlets, self.phase, deadline, self.abort)
        load_done.set()
        if checker is not None:
            checker.join(timeout=o["drain_timeout"])
            if not checker.dead:
                self.extra["drain_timed_out"] = True
                checker.kill()
        self.record_cpu(cpu0)

    def cpu_snapshot(self) -> dict[str, float]:
        """CPU seconds so far of the coordinator (and of its hub thread alone), our workers,
        this process and the whole machine (all CPUs, whoever used them)."""
        snap = {"wall": time.monotonic(), "loadgen": sum(os.times()[:2]),
                "machine": procs.machine_cpu_seconds() or 0.0}
        pid = self.coordinator.pid if self.coordinator is not None else self.o["coordinator_pid"]
        if pid:
            # by schedstat: the hub (the main thread) is then a share of the process by construction
            snap["coordinator"] = procs.run_seconds(pid) or 0.0
            snap["coordinator_hub"] = procs.run_seconds(pid, pid) or 0.0
        workers = [c for c in self.children if c.name.startswith("worker")]
        if workers:
            snap["workers"] = sum(procs.cpu_seconds(c.pid) or 0.0 for c in workers)
        return snap

    def record_cpu(self, before: dict[str, float]) -> None:
        """CPU use during load + drain, as a fraction of one core, per process group."""
        after = self.cpu_snapshot()
        wall = after["wall"] - before["wall"]
        self.extra["measured_s"] = round(wall, 3)
        if wall > 0:
            self.extra["cpu_cores_used"] = {k: round((after[k] - before[k]) / wall, 2)
                                            for k in after if k != "wall" and k in before}

    def waits_for_completion(self) -> bool:
        mode = self.o["mode"]
        if mode in ("e2e", "mixed"):
            return True
        return mode == "submit" and self.o["workers"] > 0

    def loop_client(self, idx: int, conn: Conn) -> None:
        """e2e loop style: submit one job, wait for it (WAIT_JOB, no polling), repeat."""
        phase, wl = self.phase, self.workload
        rng = wl.rng(idx)
        n = 0
        try:
            while phase.take():
                frame, key = wl.submit_frame(rng, idx, n)
                n += 1
                t0 = time.perf_counter()
                job_id, reply = submit_once(conn, phase, frame, key)
                if job_id is None:
                    if reply.get("type") == "SUBMIT_REJECTED":
                        phase.give_back()
                        gevent.sleep(rng.uniform(0.005, 0.05))
                    continue
                poll = wait_frame(job_id, 10_000)  # well inside the 30 s request timeout
                hist = phase.hist("wait")
                while not self.abort.is_set():
                    s0 = time.perf_counter()
                    st = conn.request(poll)
                    hist.record(time.perf_counter() - s0)
                    phase.ops += 1
                    if st.get("type") != "JOB_STATUS":
                        self.tracker.unknown.add(job_id)
                        break
                    if st["job"].get("state") in TERMINAL:
                        self.tracker.mark(job_id, st["job"])
                        self.e2e_hist.record(time.perf_counter() - t0)
                        break
        except Exception as exc:  # noqa: BLE001
            phase.errors[classify(exc)] += 1
            conn.close()

    def setup_status_jobs(self) -> None:
        """Status mode: submit the jobs the clients will ask about (not measured)."""
        setup = Phase("setup", self.o["status_jobs"])
        conns = open_many(self.client_addr, 10, 10, self.setup_errors)
        g = run_clients(conns, submit_client, setup, self.workload)
        wait_phase(g, setup, 60.0, self.abort)
        for c in conns:
            c.close()
        self.status_ids = list(setup.ids)
        self.setup_phase = setup
        if not self.status_ids:
            raise procs.ChildFailed("status mode: no job was accepted during set-up (%s)" % dict(setup.errors))

    def status_client(self, idx: int, conn: Conn) -> None:
        phase = self.phase
        rng = random.Random(self.o["seed"] * 7919 + idx)
        ids = self.status_ids
        hist = phase.hist("status")
        try:
            while phase.take():
                frame = status_frame(ids[rng.randrange(len(ids))])
                t0 = phase.mark_send()
                reply = conn.request(frame)
                t1 = time.perf_counter()
                hist.record(t1 - t0)
                phase.last_reply = t1
                phase.ops += 1
                if reply.get("type") != "JOB_STATUS":
                    phase.errors["reply_" + str(reply.get("type")).lower()] += 1
        except Exception as exc:  # noqa: BLE001
            phase.errors[classify(exc)] += 1
            conn.close()

    def mixed_client(self, idx: int, conn: Conn) -> None:
        phase, wl = self.phase, self.workload
        rng = wl.rng(idx)
        ops = [op for op, w in self.o["mix"] if w > 0]
        cum, total = [], 0.0
        for _, w in [(op, w) for op, w in self.o["mix"] if w > 0]:
            total += w
            cum.append(total)
        mine: list[str] = []
        n = 0
        list_frame = encode_frame({"type": "LIST_JOBS", "limit": 20})
        try:
            while not phase.stop.is_set():
                r = rng.random() * total
                op = next(o for o, c in zip(ops, cum) if r < c)
                if op != "submit" and not mine:
                    op = "submit"
                if op == "submit":
                    if not phase.take():
                        return
                    frame, key = wl.submit_frame(rng, idx, n)
                    n += 1
                    job_id, reply = submit_once(conn, phase, frame, key)
                    if job_id is not None:
                        mine.append(job_id)
                    elif reply.get("type") == "SUBMIT_REJECTED":
                        phase.give_back()
                        gevent.sleep(rng.uniform(0.005, 0.05))
                    continue
                if op == "status":
                    frame = status_frame(mine[rng.randrange(len(mine))])
                    want = "JOB_STATUS"
                elif op == "list":
                    frame, want = list_frame, "JOB_LIST"
                else:
                    frame = encode_frame({"type": "CANCEL_JOB", "jobId": mine[rng.randrange(len(mine))]})
                    want = "JOB_CANCEL"
                t0 = time.perf_counter()
                reply = conn.request(frame)
                phase.hist(op).record(time.perf_counter() - t0)
                phase.ops += 1
                if reply.get("type") != want:
                    phase.errors["%s_reply_%s" % (op, str(reply.get("type")).lower())] += 1
        except Exception as exc:  # noqa: BLE001
            phase.errors[classify(exc)] += 1
            conn.close()

    def run_idle(self) -> None:
        o = self.o
        gevent.sleep(1.0)
        before = self.rss.sample() if self.rss else None
        self.connect(o["clients"])
        end = time.monotonic() + o["hold"]
        while time.monotonic() < end and not self.abort.is_set():
            gevent.sleep(min(0.25, max(0.0, end - time.monotonic())))
        after = self.rss.sample() if self.rss else None
        self.extra["rss_before_kb"] = before
        self.extra["rss_after_kb"] = after
        if before and after and self.conns:
            self.extra["rss_per_connection_kb"] = round((after - before) / len(self.conns), 2)
        # Every held connection must still be served: one small request each, at once.
        answered = Counter()
        frame = encode_frame({"type": "LIST_WORKERS"})

        def ping(conn: Conn) -> None:
            try:
                conn.sock.settimeout(15)
                reply = conn.request(frame)
                answered[reply.get("type")] += 1
            except Exception as exc:  # noqa: BLE001
                answered["no_reply_" + classify(exc)] += 1

        t0 = time.perf_counter()
        gevent.joinall([gevent.spawn(ping, c) for c in self.conns], timeout=30)
        self.extra["idle_ping_s"] = round(time.perf_counter() - t0, 3)
        self.extra["idle_pings"] = dict(answered)
        unanswered = len(self.conns) - answered.get("WORKER_LIST", 0)
        self.extra["idle_unanswered"] = unanswered
        if unanswered:
            self.phase.errors["idle_unanswered"] += unanswered

    def run_burst(self) -> None:
        o = self.o
        self.connect(o["clients"])
        go = gevent.event.Event()
        phase = self.phase
        phase.tokens = None

        def one(idx: int, conn: Conn) -> None:
            go.wait()
            frame, key = self.workload.submit_frame(self.workload.rng(idx), idx, 0)
            try:
                submit_once(conn, phase, frame, key)
            except Exception as exc:  # noqa: BLE001
                phase.errors[classify(exc)] += 1
            conn.close()

        greenlets = run_clients(self.conns, one)
        gevent.sleep(0.5)
        cpu0 = self.cpu_snapshot()
        go.set()
        wait_phase(greenlets, phase, o["timeout"], self.abort)
        self.record_cpu(cpu0)

    # ---- verification -----------------------------------------------------------------

    def verify(self) -> dict[str, Any]:
        """Ask the coordinator about every accepted job; page LIST_JOBS for duplicates."""
        o = self.o
        ids = list(self.phase.ids)
        if o["mode"] == "status":
            ids = list(self.status_ids)
        out: dict[str, Any] = {"checked": 0}
        if o["verify"] == "none" or not ids and o["mode"] not in ("submit", "e2e", "mixed", "burst"):
            return out
        need_terminal = self.waits_for_completion()
        states: Counter = Counter()
        unknown: set[str] = set(self.tracker.unknown)
        unfinished: set[str] = set()
        changed = 0
        errors: Counter = Counter()
        chunks = [ids[i::VERIFY_CONNS] for i in range(VERIFY_CONNS)]

        def check(chunk: list[str]) -> None:
            nonlocal changed
            try:
                conn = Conn.open(self.client_addr)
            except Exception as exc:  # noqa: BLE001
                errors["verify_connect_" + classify(exc)] += 1
                return
            try:
                for i in range(0, len(chunk), 64):
                    batch = chunk[i:i + 64]
                    for job_id, reply in zip(batch, conn.pipeline([status_frame(j) for j in batch])):
                        out["checked"] += 1
                        if reply.get("type") != "JOB_STATUS":
                            unknown.add(job_id)
                            continue
                        job = reply["job"]
                        state = job.get("state")
                        states[state] += 1
                        seen = self.tracker.done.get(job_id)
                        if seen is not None and seen[0] != state:
                            changed += 1  # a terminal state must never change
                        if state in TERMINAL:
                            if seen is None:
                                self.tracker.mark(job_id, job)
                        elif need_terminal:
                            unfinished.add(job_id)
            except Exception as exc:  # noqa: BLE001
                errors["verify_" + classify(exc)] += 1
            finally:
                conn.close()

        t0 = time.perf_counter()
        gevent.joinall([gevent.spawn(check, c) for c in chunks if c], timeout=60 + len(ids) / 2000)
        out["states"] = dict(states)
        out["unknown"] = len(unknown)
        out["unfinished"] = len(unfinished)
        out["terminal_state_changed"] = changed
        lost = unknown | unfinished
        if o["verify"] == "full":
            listing = self.list_all(time.monotonic() + 60 + len(ids) / 2000, errors)
            if listing is not None:
                seen_ids, dup = listing
                idset = set(ids)
                missing = idset - seen_ids
                out["listed"] = len(seen_ids)
                out["listed_duplicates"] = dup
                out["listed_missing"] = len(missing)
                # Jobs we were never told about: created by requests cut off mid-flight
                # (or, when attached, by other clients).
                out["listed_unacknowledged"] = len(seen_ids - idset)
                lost |= missing
                self.phase.duplicates += dup
        out["verify_s"] = round(time.perf_counter() - t0, 3)
        out["errors"] = dict(errors)
        out["lost_ids_sample"] = sorted(lost)[:10]
        out["lost"] = len(lost)
        if errors:
            self.phase.errors.update(errors)
            if len(ids) and out["checked"] < len(ids):
                out["lost"] += len(ids) - out["checked"]  # unverifiable counts as lost
        return out

    def list_all(self, deadline: float, errors: Counter) -> tuple[set[str], int] | None:
        seen: set[str] = set()
        dup = 0
        cursor = None
        try:
            conn = Conn.open(self.client_addr)
        except Exception as exc:  # noqa: BLE001
            errors["list_connect_" + classify(exc)] += 1
            return None
        try:
            while time.monotonic() < deadline:
                req: dict[str, Any] = {"type": "LIST_JOBS", "limit": LIST_PAGE}
                if cursor is not None:
                    req["cursor"] = cursor
                reply = conn.request_obj(req)
                if reply.get("type") != "JOB_LIST":
                    errors["list_reply_" + str(reply.get("type")).lower()] += 1
                    return None
                for job in reply.get("jobs", []):
                    jid = job.get("jobId")
                    if jid in seen:
                        dup += 1
                    seen.add(jid)
                cursor = reply.get("nextCursor")
                if not cursor:
                    return seen, dup
            errors["list_timeout"] += 1
            return None
        except Exception as exc:  # noqa: BLE001
            errors["list_" + classify(exc)] += 1
            return None
        finally:
            conn.close()

    # ---- echo comparison ----------------------------------------------------------------

    def compare_echo(self) -> dict[str, Any]:
        from bench import echo_baseline

        child, addr = procs.start_echo(self.run_dir)
        self.children.append(child)
        try:
            before = (time.monotonic(), sum(os.times()[:2]), procs.cpu_seconds(child.pid) or 0.0)
            phase = echo_baseline.measure(addr, self.o["clients"], self.workload, self.o["jobs"],
                                          self.o["duration"], self.abort, self.o["timeout"])
            wall = time.monotonic() - before[0]
            cpu = {"loadgen": round((sum(os.times()[:2]) - before[1]) / wall, 2),
                   "echo": round(((procs.cpu_seconds(child.pid) or 0.0) - before[2]) / wall, 2)}
        finally:
            child.stop(5)
            self.children.remove(child)
        out = echo_baseline.report(phase, self.o["clients"])
        out["cpu_cores_used"] = cpu
        return out

    # ---- report -------------------------------------------------------------------------

    def report(self, verify: dict[str, Any], echo: dict[str, Any] | None) -> dict[str, Any]:
        o, p, t = self.o, self.phase, self.tracker
        jobs_per_s = 0.0
        if t.done and p.first_send_wall_ms:
            span = (t.last_update_ms - p.first_send_wall_ms) / 1000.0
            jobs_per_s = len(t.done) / span if span > 0 else 0.0
        errors = Counter(p.errors)
        errors.update(t.errors)
        if self.builtin is not None:
            errors.update(self.builtin.errors)
        ops_span = (p.last_reply - p.first_send) if p.first_send and p.last_reply else 0
        rep: dict[str, Any] = {
            "mode": o["mode"],
            "clients": o["clients"],
            "workers": o["workers"],
            "worker_impl": o["worker_impl"] if o["workers"] else None,
            "capacity": o["capacity"] if o["workers"] else None,
            "task": self.workload.spec,
            "priority": o["priority"],
            "idempotency_keys": o["keys"],
            "seed": o["seed"],
            "db_synchronous": None if o["coordinator"] or o["postgres"] else o["db_synchronous"],
            "store": None if o["coordinator"] else "postgres" if o["postgres"] else "sqlite",
            "coordinator_args": o["coordinator_args"],
            "tls": bool(o["tls"] or o["tls_ca"]),
            "tokens": bool(o["auth"] or o["token_file"]),
            "submits_per_s": round(p.submit_rate(), 1),
            "jobs_per_s": round(jobs_per_s, 1),
            "submit_latency_ms": p.submit_hist.summary_ms(),
            "connections": self.live_conns,
            "lost": verify.get("lost", 0),
            "duplicates": p.duplicates,
            "errors": dict(errors),
            "rejected": p.rejected,
            "coordinator_peak_rss_kb": self.rss.peak_kb if self.rss else None,
            "submitted": p.accepted,
            "submit_requests": p.sent,
            "deduplicated": p.deduplicated,
            "completed": t.states.get("COMPLETED", 0),
            "terminal": dict(t.states),
            "ops_per_s": round((p.ops + p.sent) / ops_span, 1) if ops_span > 0 else 0.0,
            "latency_ms_by_op": {op: h.summary_ms() for op, h in p.op_hists.items()},
            "checker_status_requests": t.polls,
            "verify": verify,
            "loadavg_start": self.extra.pop("loadavg_start", None),
            "loadavg_end": _loadavg(),
            "cpus": os.cpu_count(),
            "revision": _revision(),
            "interrupted": self.interrupted,
        }
        if self.e2e_hist is not None:
            rep["e2e_latency_ms"] = self.e2e_hist.summary_ms()
        if self.builtin is not None:
            rep["duplicate_executions"] = sum(1 for n in self.builtin.executions.values() if n > 1)
        if o["types"]:
            rep["types"] = o["types"]
            rep["types_per_worker"] = o["types_per_worker"]
            if self.builtin is not None:
                rep["assigned_by_type"] = dict(sorted(self.builtin.assigned_by_type.items()))
        if o["mode"] == "status":
            rep["status_per_s"] = rep["ops_per_s"]
        if echo is not None:
            rep["echo_round_trips_per_s"] = echo["round_trips_per_s"]
            rep["echo_latency_ms"] = echo["latency_ms"]
            rep["echo_errors"] = echo["errors"]
            rep["echo_cpu_cores_used"] = echo.get("cpu_cores_used")
            rep["ratio_vs_echo"] = round(rep["submits_per_s"] / echo["round_trips_per_s"], 3) \
                if echo["round_trips_per_s"] else None
        rep.update(self.extra)
        return rep


def summary_lines(rep: dict[str, Any]) -> list[str]:
    lat = rep["submit_latency_ms"]
    rss = rep["coordinator_peak_rss_kb"]
    err = sum(rep["errors"].values())
    lines = [
        "loadgen mode=%s clients=%d workers=%d%s task=%s: submits/s=%.0f jobs/s=%.0f "
        "submit_ms p50=%.3f p90=%.3f p99=%.3f max=%.3f connections=%d submitted=%d completed=%d "
        "lost=%d duplicates=%d rejected=%d errors=%d coordinator_peak_rss=%s" % (
            rep["mode"], rep["clients"], rep["workers"], "(%s)" % rep["worker_impl"] if rep["workers"] else "",
            rep["task"], rep["submits_per_s"], rep["jobs_per_s"], lat["p50"], lat["p90"], lat["p99"], lat["max"],
            rep["connections"], rep["submitted"], rep["completed"], rep["lost"], rep["duplicates"],
            rep["rejected"], err, "%.1fMB" % (rss / 1024) if rss else "?"),
    ]
    if err:
        lines.append("errors by kind: %s" % ", ".join("%s=%d" % kv for kv in sorted(rep["errors"].items())))
    if rep["mode"] == "status":
        s = rep["latency_ms_by_op"].get("status", {})
        lines.append("status requests/s=%.0f latency_ms p50=%s p99=%s max=%s"
                     % (rep["ops_per_s"], s.get("p50"), s.get("p99"), s.get("max")))
    if rep["mode"] == "idle":
        lines.append("idle: %d connections held, coordinator RSS %s -> %s KB = %s KB per connection, "
                     "unanswered after hold=%s" % (rep["connections"], rep.get("rss_before_kb"),
                                                  rep.get("rss_after_kb"), rep.get("rss_per_connection_kb"),
                                                  rep.get("idle_unanswered")))
    if rep.get("types"):
        lines.append("declared task types: %d, %d per worker; assigned by type: %s; misrouted=%d" % (
            rep["types"], rep["types_per_worker"],
            ", ".join("%s=%d" % kv for kv in rep.get("assigned_by_type", {}).items()) or "?",
            rep["errors"].get("misrouted", 0)))
    if "e2e_latency_ms" in rep:
        e = rep["e2e_latency_ms"]
        lines.append("e2e latency ms (submit to observed end) p50=%.3f p99=%.3f max=%.3f"
                     % (e["p50"], e["p99"], e["max"]))
    if "echo_round_trips_per_s" in rep:
        lines.append("durable submits/s vs echo baseline = %.0f / %.0f = %.3f" % (
            rep["submits_per_s"], rep["echo_round_trips_per_s"], rep["ratio_vs_echo"] or 0))
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts = parse_args(argv)
        use_tls(opts["tls_ca"])
        gen = LoadGen(opts)
    except DocoptExit as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except (UsageError, SpecError) as exc:
        print("loadgen: %s" % exc, file=sys.stderr)
        return EXIT_USAGE
    raise_fd_limit()
    gen.extra["loadavg_start"] = _loadavg()
    handlers = [gevent.signal_handler(s, gen.on_signal) for s in (signal.SIGINT, signal.SIGTERM)]
    verify: dict[str, Any] = {}
    echo = None
    rc = EXIT_OK
    try:
        try:
            gen.setup()
        except (procs.ChildFailed, OSError, ConnError, RuntimeError, ConfigError) as exc:
            print("loadgen: set-up failed: %s" % exc, file=sys.stderr)
            return EXIT_SETUP  # the finally below stops what was started
        gen.run()
        if not gen.interrupted:
            verify = gen.verify()
        if opts["compare_echo"] and not gen.interrupted:
            echo = gen.compare_echo()
    finally:
        if gen.progress_g is not None:
            gen.progress_g.kill(block=False)
            if not opts["quiet"] and sys.stderr.isatty():
                sys.stderr.write("\n")
        codes = gen.teardown()
        for h in handlers:
            h.cancel()
    rep = gen.report(verify, echo)
    rep["child_exit_codes"] = codes
    for line in summary_lines(rep):
        print(line)
    sys.stdout.flush()
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
    if gen.interrupted:
        return EXIT_INTERRUPTED
    if opts["clients"] and not rep["connections"]:
        print("loadgen: no client connection could be opened", file=sys.stderr)
        return EXIT_SETUP
    if rep["lost"] or rep["duplicates"]:
        print("loadgen: %d job(s) lost, %d duplicate(s)" % (rep["lost"], rep["duplicates"]), file=sys.stderr)
        rc = EXIT_LOST
    return rc


if __name__ == "__main__":
    sys.exit(main())
