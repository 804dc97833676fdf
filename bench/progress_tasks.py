"""The task ``bench/progress.py`` runs beside its load: ``jobmesh worker --tasks=bench.progress_tasks``.

``REPORT`` holds its slot until its attempt is cancelled, calling ``ctx.progress`` at
``rate`` calls a second meanwhile (0: never); then it writes ``{calls, seconds}`` to the
file ``out`` and returns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jobmesh.worker import task

TICK = 0.001  # seconds between two catch-ups to the rate


@task("REPORT")
def report(payload, ctx):
    rate = payload["rate"]
    calls = 0
    started = time.monotonic()
    while not ctx.cancelled.is_set():
        due = int((time.monotonic() - started) * rate)
        while calls < due:
            ctx.progress(calls % 1000 / 1000, "step %d" % calls)
            calls += 1
        ctx.cancelled.wait(TICK)
    seconds = time.monotonic() - started
    Path(payload["out"]).write_text(json.dumps({"calls": calls, "seconds": seconds}))
    return {"calls": calls, "seconds": seconds}
