"""Alternate load-generator runs of two or more variants; print every run and the medians.

A variant is a name, a source tree (a checkout, a worktree, or a ``git archive`` export
with a ``REVISION`` file) and optional extra loadgen arguments:
``NAME@TREE`` or ``NAME@TREE@EXTRA ARGS``. Each run is that tree's own ``bench/loadgen.py``
started with ``cwd=TREE`` and ``PYTHONPATH=TREE``, so both the load generator and the
coordinator and workers it starts import that tree's ``jobmesh``; the driver prints which
``jobmesh/__init__.py`` each variant imports before the first run. Runs alternate
(A, B, A, B, ...; round r runs every variant once, in the order given), since the
machine's speed drifts over minutes and only runs close in time compare.

With ``--echo`` each round first runs the bare echo baseline (``bench/echo_baseline.py`` of
the driver's own tree, so it is the same server for every variant) with ``--echo-clients``
closed-loop connections for ``--echo-seconds``, and every run of that round gains
``submits_per_echo`` and ``jobs_per_echo``: its rate divided by the round's echo round
trips/s. A ratio holds across machines and across slow minutes far better than a rate, so
an issue states its cost against its starting commit as these ratios.

``coord_cpu_us_per_job`` is the coordinator's CPU time during the measured phase divided
by the jobs completed (submitted, in submit mode), in µs: on this machine it moves far
less from run to run than the rates do, since a slow minute lowers the rate but not the
work per job. ``hub_cpu_us_per_job`` is the same for the coordinator's main thread alone
(the hub: sockets, framing, the core), the rest being mostly the store's write thread;
a tree whose load generator does not report it shows ``?``. The driver prints figures; it does not judge them (no thresholds, exit status 0 unless
the set-up itself fails).

Usage:
  sidebyside.py [options] --variant=V... [--] LOADGEN_ARG...
  sidebyside.py (-h | --help)

Examples:
  python bench/sidebyside.py --runs=5 --variant=before@/tmp/jm-before --variant=after@. -- \\
      --mode=e2e --clients=1000 --workers=8 --jobs=50000 --task=sleep0
  python bench/sidebyside.py --runs=3 --echo --variant=before@/tmp/jm-before --variant=after@. -- \\
      --mode=submit --clients=50 --duration=10 --coordinator-arg=--max-active-jobs=1000000
  python bench/sidebyside.py --runs=5 --variant=single@. \\
      --variant='mixed@.@--types=4 --types-per-worker=2' -- \\
      --mode=e2e --clients=1000 --workers=8 --worker-impl=builtin --jobs=50000 --task=sleep0

Options:
  --variant=V       NAME@TREE[@EXTRA LOADGEN ARGS] (repeatable, at least two)
  --runs=N          rounds; each runs every variant once [default: 5]
  --python=EXE      interpreter for every run (default: this one)
  --out-dir=DIR     where the JSON reports go (default: a new temp directory)
  --timeout=S       cap on each run, seconds [default: 600]
  --figures=LIST    comma-separated figures as paths into the JSON report, or the derived
                    coord_cpu_us_per_job (default: by mode)
  --echo            run the echo baseline in every round; add the rates divided by it
  --echo-clients=N  connections of the echo run [default: 50]
  --echo-seconds=S  length of the echo run [default: 5]
  --from-dir=DIR    run nothing: print the table from the reports a previous run left in DIR
  -h --help         show this help
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docopt import docopt  # noqa: E402

from bench.profiles import dig  # noqa: E402

DEFAULT_FIGURES = {
    "e2e": ["jobs_per_s", "submits_per_s", "submit_latency_ms.p99", "cpu_cores_used.coordinator", "coord_cpu_us_per_job",
            "hub_cpu_us_per_job", "coordinator_peak_rss_kb", "completed", "lost", "duplicates"],
    "submit": ["submits_per_s", "submit_latency_ms.p50", "submit_latency_ms.p99", "cpu_cores_used.coordinator",
               "coord_cpu_us_per_job", "hub_cpu_us_per_job",
               "submitted", "lost", "duplicates"],
}
FALLBACK_FIGURES = ["submits_per_s", "jobs_per_s", "submit_latency_ms.p99", "lost", "duplicates"]
ECHO_FIGURES = {"submits_per_echo": "submits_per_s", "jobs_per_echo": "jobs_per_s"}
HERE = Path(__file__).resolve().parent.parent


def figure(report: dict, name: str, echo: float | None = None):
    if name in ECHO_FIGURES:
        rate = dig(report, ECHO_FIGURES[name])
        return round(rate / echo, 4) if rate and echo else None
    if name in ("coord_cpu_us_per_job", "hub_cpu_us_per_job"):
        cores = dig(report, "cpu_cores_used.coordinator" + ("_hub" if name == "hub_cpu_us_per_job" else ""))
        wall = report.get("measured_s")
        jobs = report.get("completed") or report.get("submitted")
        if cores is None or not wall or not jobs:
            return None
        return round(cores * wall / jobs * 1e6, 1)
    return dig(report, name)


def fmt(value) -> str:
    if value is None:
        return "?"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 100 or value == 0:
        return "%d" % value
    if isinstance(value, float):
        return "%.3f" % value if abs(value) < 10 else "%.1f" % value if abs(value) < 100 else "%.0f" % value
    return str(value)


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def parse_variant(text: str) -> tuple[str, Path, list[str]]:
    parts = text.split("@", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise SystemExit("--variant wants NAME@TREE[@EXTRA ARGS], got %r" % text)
    tree = Path(parts[1]).resolve()
    if not (tree / "bench" / "loadgen.py").exists():
        raise SystemExit("%s has no bench/loadgen.py" % tree)
    return parts[0], tree, shlex.split(parts[2]) if len(parts) > 2 else []


def env_for(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def imported_from(python: str, tree: Path) -> str:
    """The jobmesh and bench packages a run in ``tree`` imports (a check that PYTHONPATH wins)."""
    proc = subprocess.run([python, "-c", "import jobmesh, bench.loadgen; print(jobmesh.__file__, bench.loadgen.__file__)"],
                          cwd=tree, env=env_for(tree), capture_output=True, text=True, timeout=60)
    return (proc.stdout.strip() or proc.stderr.strip()[-300:])


def run_bounded(cmd: list[str], tree: Path, timeout: float) -> tuple[object, str, str]:
    """Run one loadgen; past ``timeout`` send it SIGTERM (it stops its own children by
    pid and reports), and SIGKILL only if it has not exited 60 s later."""
    proc = subprocess.Popen(cmd, cwd=tree, env=env_for(tree), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return "timeout(%s)" % proc.returncode, stdout, stderr


def run_echo(python: str, out: Path, clients: int, seconds: float, timeout: float) -> float | None:
    """One run of the bare echo baseline from this tree; its round trips/s (None if it failed)."""
    cmd = [python, str(HERE / "bench" / "echo_baseline.py"), "--connections=%d" % clients,
           "--duration=%s" % seconds, "--out=%s" % out]
    rc, _, stderr = run_bounded(cmd, HERE, timeout)
    if not out.exists():
        print("  echo run failed rc=%s: %s" % (rc, stderr.strip()[-500:]))
        return None
    return json.loads(out.read_text()).get("round_trips_per_s")


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    variants = [parse_variant(v) for v in args["--variant"]]
    if len(variants) < 2:
        raise SystemExit("give at least two --variant")
    runs = int(args["--runs"])
    python = args["--python"] or sys.executable
    timeout = float(args["--timeout"])
    common = list(args["LOADGEN_ARG"])
    mode = next((a.split("=", 1)[1] for a in common if a.startswith("--mode=")), "e2e")
    figures = args["--figures"].split(",") if args["--figures"] else list(DEFAULT_FIGURES.get(mode, FALLBACK_FIGURES))
    echo_on = bool(args["--echo"])
    if echo_on:
        figures = ["submits_per_echo" if mode == "submit" else "jobs_per_echo", "echo_round_trips_per_s"] + [
            f for f in figures if f not in ECHO_FIGURES]
    from_dir = args["--from-dir"]
    out_dir = Path(from_dir or args["--out-dir"] or tempfile.mkdtemp(prefix="jobmesh-sidebyside-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    print("side by side: %d rounds, loadgen %s" % (runs, " ".join(common)))
    for name, tree, extra in variants:
        print("  %s: %s %s -> imports %s" % (name, tree, " ".join(extra), imported_from(python, tree)))
    print("  reports in %s; load at start %s" % (out_dir, loadavg()))
    sys.stdout.flush()

    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for r in range(runs):
        echo = None
        if echo_on:
            echo_out = out_dir / ("echo-%d.json" % (r + 1))
            if from_dir:
                echo = json.loads(echo_out.read_text()).get("round_trips_per_s") if echo_out.exists() else None
            else:
                echo = run_echo(python, echo_out, int(args["--echo-clients"]), float(args["--echo-seconds"]), timeout)
            print("round %d echo     round_trips_per_s=%s" % (r + 1, fmt(echo)))
        for name, tree, extra in variants:
            out = out_dir / ("%s-%d.json" % (name, r + 1))
            cmd = [python, str(tree / "bench" / "loadgen.py")] + common + extra + ["--quiet", "--out=%s" % out]
            load = loadavg()
            t0 = time.monotonic()
            if from_dir:
                rc, stderr = "?", ""
                report = json.loads(out.read_text()) if out.exists() else {}
                load = " ".join("%.2f" % x for x in report.get("loadavg_start") or []) or "?"
            else:
                rc, _, stderr = run_bounded(cmd, tree, timeout)
                report = json.loads(out.read_text()) if out.exists() else {}
            row = {"load": load, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                   "revision": report.get("revision")}
            row.update({f: echo if f == "echo_round_trips_per_s" else figure(report, f, echo) for f in figures})
            results[name].append(row)
            print("round %d %-8s load %s rc=%s %5.1fs rev=%s: %s" % (
                r + 1, name, load, rc, row["seconds"], row["revision"],
                " ".join("%s=%s" % (f, fmt(row[f])) for f in figures)))
            if rc not in (0, 1, "?"):
                print("  stderr: %s" % stderr.strip()[-1500:])
            sys.stdout.flush()

    print("\nmedians of %d runs (every run after the slash, in order):" % runs)
    base = variants[0][0]
    for f in figures:
        cells = []
        meds = {}
        for name, _, _ in variants:
            vals = [row[f] for row in results[name]]
            nums = [v for v in vals if isinstance(v, (int, float))]
            meds[name] = statistics.median(nums) if nums else None
            cells.append("%s %s (%s)" % (name, fmt(meds[name]), " / ".join(fmt(v) for v in vals)))
        ratio = ""
        if meds[base]:
            ratio = "; " + ", ".join("%s/%s %.3f" % (n, base, meds[n] / meds[base])
                                     for n, _, _ in variants[1:] if meds[n] is not None)
        print("  %-28s %s%s" % (f, " | ".join(cells), ratio))
    print("  load at start of each run: " + " | ".join(
        "%s %s" % (name, " / ".join(row["load"].split()[0] for row in results[name])) for name, _, _ in variants))
    print("  load at end: %s" % loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
