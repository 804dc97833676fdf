"""Summarise a py-spy raw profile of the coordinator: where each thread's samples go.

Input: the output of ``py-spy record -p PID -d 4 -f raw --threads --idle -o FILE``
(one line per distinct stack, ``thread (TID);frame;...;frame COUNT``). The thread with
the most samples under ``_run_core`` or a server handler is the hub's (main) thread; the
thread that runs ``SQLiteStore.write`` (``JobStore.write`` in older trees) is the DB thread. Each sample is put in the first
matching bucket:

main thread
  send          writing replies and frames: the core's non-blocking ``os.write``
                (``Output.write``) or a flusher's ``sendall`` (the syscall, and reacquiring
                the GIL after it)
  recv          ``recv`` in a handler's frame reader
  handlers      the rest of the connection handlers: frame and message decoding,
                posting to the mailbox, waiting for room
  core:<step>   the core greenlet: ``submit_job``, ``on_task_result``, ``schedule``,
                ``get_job_status``, ``rows`` (take_dirty: encoding the batch's rows),
                ``handoff`` (starting the commit on the pool), ``release`` (encoding
                replies and worker frames, apart from their write), ``other``
  writers       flusher greenlets (bytes a full socket did not take) apart from send
  idle/loop     ``Hub.run`` with nothing above it: the event loop's C code, mostly
                ``epoll_wait`` with nothing to do
  other
DB thread
  insert, update, commit   the three statements of ``SQLiteStore.write`` (commit = COMMIT + fsync)
  waiting                  waiting for the next batch

Usage:
  pyspy_summary.py [--store=PATH] FILE...

``--store`` names the store module of the tree that was profiled (default: this tree's
``jobmesh/store/sqlite.py``; older trees: ``jobmesh/coordinator/store.py``),
whose line numbers tell the three statements apart.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

STORE = Path(__file__).resolve().parent.parent / "jobmesh" / "store" / "sqlite.py"
WRITE_FRAMES = ("SQLiteStore.write", "JobStore.write")  # the store class now, and before it was renamed

CORE_STEPS = (
    ("submit_job", "CoordinatorCore.submit_job"), ("on_task_result", "CoordinatorCore.on_task_result"),
    ("get_job_status", "CoordinatorCore.get_job_status"), ("schedule", "schedule_queued_jobs"),
    ("rows", "CoordinatorCore.take_dirty"), ("handoff", "ThreadPool.spawn"),
    ("release", "Coordinator._write_replies"), ("release", "Coordinator._send_outbound"),
    ("sweep", "CoordinatorCore.sweep"),
)


def read(path: str) -> dict[str, list[tuple[list[str], int]]]:
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            threads[frames[0]].append((frames[1:], int(count)))
    return threads


def _has(frames: list[str], needle: str) -> bool:
    return any(needle in f for f in frames)


def main_bucket(frames: list[str]) -> str:
    names = [f.split(" (")[0] for f in frames]
    leaf = names[-1] if names else ""
    if leaf.endswith((".send", ".sendall", "send_all", "Output.write")):
        return "send"
    if leaf.endswith(".recv") or leaf.endswith(".recv_into"):
        return "recv"
    if names == ["Hub.run"]:
        return "idle/loop"
    if _has(names, "Coordinator._run_core"):
        for label, needle in CORE_STEPS:
            if _has(names, needle):
                return "core:" + label
        return "core:other"
    if _has(names, "handle_client") or _has(names, "handle_worker"):
        return "handlers"
    if _has(names, "Output._flush"):
        return "writers"
    return "other"


def statement_lines(store: Path) -> dict[str, str]:
    """Line number -> insert/update/commit, for the statements of the store's ``write``."""
    lines: dict[str, str] = {}
    inside = False
    for no, text in enumerate(store.read_text().splitlines(), 1):
        if text.strip().startswith("def "):
            inside = text.strip().startswith("def write(")
        if not inside:
            continue
        for needle, label in (("INSERT_SQL", "insert"), ("UPDATE_SQL", "update"), ('"COMMIT"', "commit")):
            if needle in text:
                lines[str(no)] = label
    return lines


def db_bucket(frames: list[str], lines: dict[str, str]) -> str:
    for f in frames:
        if f.startswith(WRITE_FRAMES):
            line = f.rsplit(":", 1)[-1].rstrip(")")
            return lines.get(line, "write (other)")
    return "waiting"


def summarise(path: str, lines: dict[str, str]) -> str:
    threads = read(path)
    totals = {t: sum(n for _, n in stacks) for t, stacks in threads.items()}
    db = [t for t, stacks in threads.items() if any(_has(fr, w) for fr, _ in stacks for w in WRITE_FRAMES)]
    main = [t for t in threads if t not in db]
    main = max(main, key=lambda t: totals[t]) if main else None
    out = ["%s: %d threads" % (path, len(threads))]
    if main:
        c: Counter = Counter()
        for frames, n in threads[main]:
            c[main_bucket(frames)] += n
        total = totals[main]
        core = sum(v for k, v in c.items() if k.startswith("core:"))
        out.append("  main %s, %d samples: core %.0f%%" % (main, total, 100 * core / total))
        for k, v in c.most_common():
            out.append("    %-20s %5.1f%%" % (k, 100 * v / total))
    for t in db:
        c = Counter()
        for frames, n in threads[t]:
            c[db_bucket(frames, lines)] += n
        total = totals[t]
        out.append("  DB %s, %d samples: busy %.0f%%" % (t, total, 100 * (total - c["waiting"]) / total))
        for k, v in c.most_common():
            out.append("    %-20s %5.1f%%" % (k, 100 * v / total))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    store = STORE
    if argv and argv[0].startswith("--store="):
        store = Path(argv.pop(0).split("=", 1)[1])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    lines = statement_lines(store)
    for path in argv:
        print(summarise(path, lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
