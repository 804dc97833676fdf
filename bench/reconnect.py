"""Connection set-up cost of many workers reconnecting at once: over TLS, with tokens, and
in plaintext, side by side.

Per variant and run, a fresh coordinator (``--db-synchronous=FULL``, its own database,
``--heartbeat-timeout-millis=600000`` so that no worker is presumed dead while the
machine is busy with handshakes) and ``--workers`` worker connections from this process,
each doing what a worker does when it (re)connects: TCP connect, the TLS handshake (tls
variants), AUTH with a worker token (tokens variants) and WORKER_REGISTER, answered by
WORKER_REGISTERED. The connections are opened once (``--connect-burst`` at a time), all
closed, and once the coordinator lists no worker they reconnect **all at once**, one
greenlet each, released together. Measured over that wave:

* ``all registered``: seconds from the release until the last WORKER_REGISTERED, and
  the p50 / p99 of each connection's own set-up time;
* ``coordinator CPU per set-up``: the time the coordinator's threads ran during the wave
  (``/proc/<pid>/task/*/schedstat``, in nanoseconds, where ``/proc/<pid>/stat`` counts
  10 ms ticks), divided by the connections set up, in microseconds; this process's CPU,
  the peers' side of the handshakes, is printed beside it;
* the coordinator's ``LIST_WORKERS`` count afterwards, which must be ``--workers``.

Variants: ``plain``, ``tls`` (a CA and an ECDSA P-256 certificate for 127.0.0.1 made in
the run directory, as ``tests/tls_support.py`` makes them), ``tokens`` (an auth file
with a worker and a reader token) and ``tls+tokens``. Each connection is a full
handshake: real workers are separate processes, so nothing resumes a TLS session.
Runs alternate (every variant once per round), and the medians end the output. Figures
only, no thresholds; on a quiet machine, since the peers share its cores. Exit status 1
if a connection failed or the coordinator's worker list did not match, 2 on a usage error.

Usage:
  reconnect.py [--workers=N] [--runs=R] [--variants=LIST] [--connect-burst=B]
               [--timeout=S] [--run-dir=DIR] [--out=FILE]
  reconnect.py (-h | --help)

Options:
  --workers=N        worker connections [default: 1000]
  --runs=R           rounds; each runs every variant once [default: 3]
  --variants=LIST    comma-separated of plain, tls, tokens, tls+tokens
                     [default: plain,tls+tokens]
  --connect-burst=B  connects in flight at once for the first connection (the
                     reconnect wave is always all at once) [default: 200]
  --timeout=S        cap on each wave, seconds [default: 120]
  --run-dir=DIR      where the databases, certificates and logs go (default: a temp
                     directory, removed)
  --out=FILE         write every run and the medians as JSON
  -h --help          show this help
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import gevent
import gevent.event
from docopt import docopt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import conns, procs  # noqa: E402
from bench.histogram import Histogram  # noqa: E402
from jobmesh.auth import new_token  # noqa: E402
from jobmesh.protocol.framing import FrameReader, encode_frame  # noqa: E402

VARIANTS = ("plain", "tls", "tokens", "tls+tokens")
FIGURES = ("all_registered_s", "setup_ms_p50", "setup_ms_p99", "coordinator_us_per_setup", "peers_us_per_setup")


class Peer:
    """One worker connection: set up (connect, TLS, AUTH, WORKER_REGISTER) and closed."""

    __slots__ = ("worker_id", "sock")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.sock: Any = None

    def connect(self, addr: tuple[str, int], token: str | None, timeout: float) -> None:
        sock = conns.dial(addr, timeout)
        self.sock = sock
        sock.settimeout(timeout)
        reader = FrameReader(sock.recv)
        if token is not None:
            conns.authenticate(sock, reader, token)
        sock.sendall(encode_frame({"type": "WORKER_REGISTER", "workerId": self.worker_id, "capacity": 1}))
        reply = reader.read_frame()
        if reply is None or reply.get("type") != "WORKER_REGISTERED":
            raise conns.ConnError("register_refused", str(reply))

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


def wave(peers: list[Peer], addr: tuple[str, int], token: str | None, burst: int, timeout: float,
         errors: Counter, hist: Histogram | None = None) -> float:
    """Connect every peer, ``burst`` at a time (0: all released together); the seconds
    until the last one is registered. Failures are counted in ``errors`` by kind."""
    go = gevent.event.Event()

    def one(peer: Peer) -> None:
        go.wait()
        t0 = time.perf_counter()
        try:
            peer.connect(addr, token, timeout)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, by kind
            errors[conns.classify(exc)] += 1
            peer.close()
            return
        if hist is not None:
            hist.record(time.perf_counter() - t0)

    step = burst or len(peers)
    greenlets: list[gevent.Greenlet] = []
    t0 = time.perf_counter()
    try:
        with gevent.Timeout(timeout, False):
            for i in range(0, len(peers), step):
                greenlets = [gevent.spawn(one, peer) for peer in peers[i:i + step]]
                gevent.sleep(0)  # every greenlet of the step waits on ``go`` before it is released
                go.set()
                gevent.joinall(greenlets)
                go.clear()
    finally:
        unfinished = [g for g in greenlets if not g.dead]
        if unfinished:
            gevent.killall(unfinished)
            errors["wave_timeout"] += len(unfinished)
    return time.perf_counter() - t0


def registered(client: conns.Conn) -> int:
    reply = client.request_obj({"type": "LIST_WORKERS"})
    return sum(1 for w in reply.get("workers", []) if str(w.get("workerId", "")).startswith("reconnect-"))


def await_count(client: conns.Conn, count: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    seen = registered(client)
    while seen != count and time.monotonic() < deadline:
        gevent.sleep(0.05)
        seen = registered(client)
    return seen


class Setup:
    """What a variant needs, made once per bench run in the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.certs: Any = None
        self.auth_file: Path | None = None
        self.worker_token = self.reader_token = ""

    def args(self, variant: str) -> list[str]:
        """The coordinator's flags for ``variant``; sets this process's TLS and token for it."""
        tls, tokens = variant in ("tls", "tls+tokens"), variant in ("tokens", "tls+tokens")
        out = []
        if tls:
            if self.certs is None:
                from tests.tls_support import make_certs  # cryptography, as the tests make certificates

                self.certs = make_certs(self.run_dir / "certs")
            out += ["--tls-cert=%s" % self.certs.server, "--tls-key=%s" % self.certs.server_key]
        conns.use_tls(str(self.certs.ca) if tls else None)
        if tokens:
            if self.auth_file is None:
                self.auth_file = self.run_dir / "auth.toml"
                self.worker_token = new_token(str(self.auth_file), "reconnect-worker", "worker")
                self.reader_token = new_token(str(self.auth_file), "reconnect-reader", "reader")
            out.append("--auth-file=%s" % self.auth_file)
        conns.use_token(self.reader_token if tokens else None)  # the LIST_WORKERS connection
        return out


def run_variant(setup: Setup, variant: str, index: int, n: int, burst: int, timeout: float) -> dict[str, Any]:
    run_dir = setup.run_dir / ("%s-%d" % (variant.replace("+", "-"), index))
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = setup.args(variant) + ["--heartbeat-timeout-millis=600000"]
    token = setup.worker_token if "tokens" in variant else None
    coordinator, worker_addr, client_addr = procs.start_coordinator(run_dir, run_dir / "bench.db", "FULL", extra)
    errors: Counter = Counter()
    out: dict[str, Any] = {"variant": variant, "workers": n}
    try:
        client = conns.Conn.open(client_addr)
        peers = [Peer("reconnect-%d" % i) for i in range(n)]
        out["first_connect_s"] = round(wave(peers, worker_addr, token, burst, timeout, errors), 3)
        out["first_registered"] = await_count(client, n, 30)
        for peer in peers:
            peer.close()
        out["listed_after_close"] = await_count(client, 0, 60)
        gevent.sleep(0.5)  # the coordinator is done with the closes
        hist = Histogram()
        cpu0, own0 = procs.run_seconds(coordinator.pid) or 0.0, time.process_time()
        out["all_registered_s"] = round(wave(peers, worker_addr, token, 0, timeout, errors, hist), 3)
        cpu1, own1 = procs.run_seconds(coordinator.pid) or 0.0, time.process_time()
        done = hist.count
        out["reconnected"] = done
        out["registered"] = await_count(client, n, 30)
        summary = hist.summary_ms()
        out["setup_ms_p50"], out["setup_ms_p99"] = summary["p50"], summary["p99"]
        out["coordinator_us_per_setup"] = round((cpu1 - cpu0) / done * 1e6, 1) if done else None
        out["peers_us_per_setup"] = round((own1 - own0) / done * 1e6, 1) if done else None
        out["errors"] = dict(errors)
        client.close()
        for peer in peers:
            peer.close()
    finally:
        procs.stop_all([coordinator])
    return out


def fmt(value: Any) -> str:
    return "?" if value is None else "%.3f" % value if isinstance(value, float) and value < 10 else \
        "%.1f" % value if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    n, runs, burst = int(args["--workers"]), int(args["--runs"]), int(args["--connect-burst"])
    variants = [v.strip() for v in args["--variants"].split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or n < 1 or runs < 1:
        print("reconnect.py: --variants are %s; --workers and --runs at least 1" % ", ".join(VARIANTS), file=sys.stderr)
        return 2
    conns.raise_fd_limit()
    own_dir = args["--run-dir"] is None
    run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-reconnect-") if own_dir else args["--run-dir"]).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup(run_dir)
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for r in range(runs):
            for variant in variants:
                rep = run_variant(setup, variant, r + 1, n, burst, float(args["--timeout"]))
                results[variant].append(rep)
                print("round %d %-10s %d workers: all registered again in %s s (set-up p50 %s ms, p99 %s ms); "
                      "coordinator CPU %s us per set-up, peers %s us; registered=%s errors=%s" % (
                          r + 1, variant, n, fmt(rep["all_registered_s"]), fmt(rep["setup_ms_p50"]),
                          fmt(rep["setup_ms_p99"]), fmt(rep["coordinator_us_per_setup"]),
                          fmt(rep["peers_us_per_setup"]), rep["registered"], rep["errors"] or 0))
                sys.stdout.flush()
    finally:
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    medians: dict[str, dict[str, Any]] = {}
    print("medians of %d runs:" % runs)
    for variant in variants:
        medians[variant] = {}
        for f in FIGURES:
            values = [rep[f] for rep in results[variant] if rep.get(f) is not None]
            medians[variant][f] = statistics.median(values) if values else None
        print("  %-10s %s" % (variant, " ".join("%s=%s" % (f, fmt(medians[variant][f])) for f in FIGURES)))
    base = variants[0]
    for variant in variants[1:]:
        a, b = medians[base]["coordinator_us_per_setup"], medians[variant]["coordinator_us_per_setup"]
        if a and b:
            print("  %s / %s coordinator CPU per set-up: %.2f (%+.0f us)" % (variant, base, b / a, b - a))
    if args["--out"]:
        Path(args["--out"]).write_text(json.dumps({"runs": results, "medians": medians}, indent=2) + "\n")
    failed = any(rep["registered"] != n or rep["listed_after_close"] or rep["errors"]
                 for reps in results.values() for rep in reps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
