"""One client process of ``bench/peers.py``: submitters, then a checker, for one system.

gevent-patched, so each system's own blocking client library runs unchanged in
``--clients`` greenlets. Steps:

1. ``--warmup=K``: submit K jobs and wait for their results (the workers have imported
   the task and taken jobs); not counted.
2. Print ``{"ready": true}`` and, with ``--wait-signal``, wait for SIGUSR1 (so that every
   client process starts at about the same moment; at most 10 minutes).
3. The greenlets submit ``--jobs`` jobs between them, each submit after the previous
   one's reply (closed loop), through the system's client (``bench/peer_apps.py``).
4. ``--mode=e2e``: one greenlet reads the results of the accepted jobs in submit order,
   through the system's client, one request per job, waiting 50 ms whenever the next is
   not in yet, until all are in or ``--drain-timeout`` passed (then one last look at
   every job still missing).
5. Print one JSON report line: ``accepted``, ``errors`` (by exception class),
   ``first_send``, ``last_reply`` (wall clock), ``submit_cpu_s`` (this process's CPU during
   the submits), and for e2e ``completed`` and ``last_done`` (the latest completion time
   the results carry).

Usage:
  peer_client.py SYSTEM --url=URL [--mode=MODE] [--clients=C] [--jobs=N] [--warmup=K]
                 [--drain-timeout=S] [--wait-signal]

Options:
  --url=URL            Redis URL, or the coordinator's client port HOST:PORT for jobmesh
  --mode=MODE          e2e or submit [default: e2e]
  --clients=C          concurrent submitters (greenlets) [default: 50]
  --jobs=N             jobs to submit [default: 1000]
  --warmup=K           jobs to run to completion first, uncounted [default: 0]
  --drain-timeout=S    cap on waiting for results, seconds [default: 120]
  --wait-signal        start the submits on SIGUSR1
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gevent  # noqa: E402
import gevent.event  # noqa: E402
from docopt import docopt  # noqa: E402

from bench.peer_apps import SYSTEMS, Client  # noqa: E402

POLL = 0.05
SIGNAL_WAIT = 600  # a client left behind by a driver that died ends by itself


class Submitters:
    def __init__(self, system: str, url: str, clients: int) -> None:
        self.system = SYSTEMS[system]
        self.url = url
        self.shared = self.system.client(url)
        self.clients = [self.shared] + [self.system.client(url) if self.shared.per_greenlet else self.shared
                                        for _ in range(clients - 1)]
        self.accepted: list[list[Any]] = [[] for _ in range(clients)]
        self.errors: Counter = Counter()
        self.first_send: float | None = None
        self.last_reply: float | None = None

    def run(self, jobs: int) -> None:
        count = len(self.clients)
        shares = [jobs // count + (1 if i < jobs % count else 0) for i in range(count)]
        self.first_send = time.time()
        gevent.joinall([gevent.spawn(self._loop, i, n) for i, n in enumerate(shares)])

    def _loop(self, i: int, n: int) -> None:
        client, out = self.clients[i], self.accepted[i]
        for _ in range(n):
            try:
                out.append(client.submit())
            except Exception as exc:  # noqa: BLE001 - counted and reported, the loop goes on
                self.errors[type(exc).__name__] += 1
                continue
            self.last_reply = time.time()

    def handles(self) -> list[Any]:
        """Every accepted job, in about the order they were submitted."""
        out: list[Any] = []
        for k in range(max((len(a) for a in self.accepted), default=0)):
            out.extend(a[k] for a in self.accepted if k < len(a))
        return out

    def close(self) -> None:
        for client in {id(c): c for c in self.clients}.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass


def drain(client: Client, handles: list[Any], timeout: float, errors: Counter) -> list[float]:
    """The completion times of ``handles`` whose results came in within ``timeout``."""
    deadline = time.monotonic() + timeout
    done: list[float] = []
    pending = list(handles)
    i = 0
    while i < len(pending) and time.monotonic() < deadline:
        at = look(client, pending[i], errors)
        if at is None:
            gevent.sleep(POLL)
            continue
        done.append(at)
        i += 1
    done.extend(at for at in (look(client, h, errors) for h in pending[i:]) if at is not None)
    return done


def look(client: Client, handle: Any, errors: Counter) -> float | None:
    try:
        return client.done_at(handle)
    except Exception as exc:  # noqa: BLE001 - a failed read counts as not in yet
        errors["result_" + type(exc).__name__] += 1
        return None


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    system, mode = args["SYSTEM"], args["--mode"]
    if system not in SYSTEMS or mode not in ("e2e", "submit"):
        raise SystemExit("peer_client: unknown system %r or mode %r" % (system, mode))
    go = gevent.event.Event()
    if args["--wait-signal"]:
        gevent.signal_handler(signal.SIGUSR1, go.set)
    else:
        go.set()
    subs = Submitters(system, args["--url"], int(args["--clients"]))
    warmup = int(args["--warmup"])
    if warmup:
        warm = Submitters(system, args["--url"], 1)
        warm.run(warmup)
        if len(drain(warm.shared, warm.handles(), 60, warm.errors)) < warmup:
            raise SystemExit("peer_client: %s's warm-up jobs did not all complete within 60 s (%s)"
                             % (system, dict(warm.errors)))
        warm.close()
    print(json.dumps({"ready": True}), flush=True)
    deadline = time.monotonic() + SIGNAL_WAIT
    while not go.wait(0.05):  # a signal handler alone keeps no loop running
        if time.monotonic() > deadline:
            raise SystemExit("peer_client: no start signal within %d s" % SIGNAL_WAIT)
    cpu0 = time.process_time()
    subs.run(int(args["--jobs"]))
    report: dict[str, Any] = {"accepted": sum(len(a) for a in subs.accepted), "first_send": subs.first_send,
                              "last_reply": subs.last_reply, "submit_cpu_s": time.process_time() - cpu0}
    if mode == "e2e":
        times = drain(subs.shared, subs.handles(), float(args["--drain-timeout"]), subs.errors)
        report.update(completed=len(times), last_done=max(times, default=None))
    report["errors"] = dict(subs.errors)
    subs.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
