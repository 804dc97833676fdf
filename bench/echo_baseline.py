"""The echo baseline: the same framing and client, no coordinator behind it.

The server is a bare gevent ``StreamServer`` (backlog 4096, a ``Pool``, TCP_NODELAY)
that reads each frame (4-byte big-endian length + JSON, parsed as jobmesh parses it)
and answers with a small JSON reply shaped like JOB_SUBMITTED, one write per reply.
The driver is the load generator's own submit loop, so "durable submits/s vs echo
round trips/s" compares the coordinator with the cheapest server the framing allows,
measured by the same client code on the same machine.

Usage:
  echo_baseline.py [--connections=C] [--requests=N | --duration=S] [--out=FILE]
  echo_baseline.py --serve [--port=PORT]
  echo_baseline.py (-h | --help)

Options:
  --connections=C    client connections [default: 50]
  --requests=N       round trips in total [default: 100000]
  --duration=S       run for S seconds instead of a request count
  --out=FILE         write a JSON report here
  --serve            run only the server; prints "echo listening HOST:PORT"
  --port=PORT        server port with --serve (0 = pick one) [default: 0]
  -h --help          show this help
"""

from __future__ import annotations

import json
import os
import socket as _stdsocket
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gevent  # noqa: E402
import gevent.event  # noqa: E402
import gevent.pool  # noqa: E402
import gevent.server  # noqa: E402
from docopt import docopt  # noqa: E402

from bench import procs  # noqa: E402
from bench.conns import open_many, raise_fd_limit  # noqa: E402
from bench.drive import Phase, run_clients, submit_client, wait_phase  # noqa: E402
from bench.workload import Workload  # noqa: E402
from jobmesh.errors import ProtocolError  # noqa: E402
from jobmesh.protocol.framing import FrameReader, encode_frame  # noqa: E402

BACKLOG = 4096


def handle(sock, addr) -> None:
    sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
    reader = FrameReader(sock.recv)
    prefix = "%08x-%04x-4000-8000-" % (id(sock) & 0xFFFFFFFF, addr[1] & 0xFFFF)
    n = 0
    try:
        while True:
            obj = reader.read_frame()
            if obj is None:
                return
            n += 1
            reply = {"type": "JOB_SUBMITTED", "jobId": "%s%012x" % (prefix, n)}
            if obj.get("type") != "SUBMIT_JOB":
                reply = {"type": "ERROR", "message": "echo server answers SUBMIT_JOB only"}
            sock.sendall(encode_frame(reply))
    except (OSError, ProtocolError):
        return


def serve(port: int) -> int:
    raise_fd_limit()
    server = gevent.server.StreamServer(("127.0.0.1", port), handle, backlog=BACKLOG,
                                        spawn=gevent.pool.Pool(15000))
    server.start()
    sys.stdout.write("echo listening 127.0.0.1:%d\n" % server.server_port)
    sys.stdout.flush()
    stopped = gevent.event.Event()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(sig, stopped.set)
    stopped.wait()
    server.stop(timeout=1)
    return 0


def measure(addr: tuple[str, int], connections: int, workload: Workload, requests: int | None,
            duration: float | None, abort: gevent.event.Event | None = None,
            timeout: float = 120.0) -> Phase:
    """Drive ``connections`` closed-loop clients at ``addr`` with the submit loop."""
    abort = abort or gevent.event.Event()
    phase = Phase("echo", None if duration else requests)
    conns = open_many(addr, connections, 500, phase.errors, secured=False)  # the echo server: plaintext, no AUTH
    greenlets = run_clients(conns, submit_client, phase, workload)
    wait_phase(greenlets, phase, duration if duration else timeout, abort)
    for c in conns:
        c.close()
    return phase


def report(phase: Phase, connections: int) -> dict:
    return {
        "round_trips_per_s": round(phase.submit_rate(), 1),
        "round_trips": phase.accepted,
        "connections": connections,
        "latency_ms": phase.submit_hist.summary_ms(),
        "errors": dict(phase.errors),
    }


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    if args["--serve"]:
        return serve(int(args["--port"]))
    raise_fd_limit()
    connections = int(args["--connections"])
    duration = float(args["--duration"]) if args["--duration"] else None
    requests = None if duration else int(args["--requests"])
    run_dir = Path(tempfile.mkdtemp(prefix="jobmesh-echo-"))
    child, addr = procs.start_echo(run_dir)
    try:
        phase = measure(addr, connections, Workload("sleep0", "NORMAL", 1, False), requests, duration)
    finally:
        child.stop(5)
    out = report(phase, connections)
    lat = out["latency_ms"]
    print("echo baseline: %d connections, %d round trips, %.0f round trips/s, latency ms p50=%.3f p99=%.3f max=%.3f"
          % (connections, phase.accepted, out["round_trips_per_s"], lat["p50"], lat["p99"], lat["max"]))
    if args["--out"]:
        Path(args["--out"]).write_text(json.dumps(out, indent=2) + "\n")
    for name in os.listdir(run_dir):
        os.unlink(run_dir / name)
    os.rmdir(run_dir)
    return 0 if phase.accepted and not phase.errors else 1


if __name__ == "__main__":
    sys.exit(main())
