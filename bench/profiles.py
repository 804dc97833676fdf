"""Run the standard load profiles several times and print their medians.

Each profile is one ``bench/loadgen`` command line (``PROFILES`` below, the same ones
``bench/README.md`` lists). Every run writes its JSON report into the output directory;
the table printed at the end gives the median of each figure over the runs, with the
machine's load average at the start of each run, since the figures mean little on a
busy machine.

Usage:
  profiles.py [--runs=N] [--only=NAMES] [--out-dir=DIR] [--list]
  profiles.py (-h | --help)

Options:
  --runs=N         runs per profile [default: 3]
  --only=NAMES     comma-separated profile names (default: all)
  --out-dir=DIR    where the JSON reports go (default: jobmesh-bench-results in the temp dir)
  --list           print the profiles' command lines and exit
  -h --help        show this help
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from docopt import docopt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# name -> (loadgen arguments, figures to report as (label, path into the JSON report))
PROFILES: dict[str, tuple[list[str], list[tuple[str, str]]]] = {
    "e2e-1000c-8w": (
        ["--mode=e2e", "--clients=1000", "--workers=8", "--jobs=50000", "--task=sleep0"],
        [("jobs/s", "jobs_per_s"), ("submits/s", "submits_per_s"), ("submit p99 ms", "submit_latency_ms.p99"),
         ("peak RSS KB", "coordinator_peak_rss_kb"), ("coord cores", "cpu_cores_used.coordinator"),
         ("lost", "lost")],
    ),
    "e2e-1000c-8w-builtin": (
        ["--mode=e2e", "--clients=1000", "--workers=8", "--worker-impl=builtin", "--jobs=50000", "--task=sleep0"],
        [("jobs/s", "jobs_per_s"), ("submits/s", "submits_per_s"), ("submit p99 ms", "submit_latency_ms.p99"),
         ("coord cores", "cpu_cores_used.coordinator"), ("lost", "lost")],
    ),
    "submit-50c-vs-echo": (
        ["--mode=submit", "--clients=50", "--duration=10", "--compare-echo",
         "--coordinator-arg=--max-active-jobs=1000000"],
        [("durable submits/s", "submits_per_s"), ("echo rt/s", "echo_round_trips_per_s"),
         ("ratio", "ratio_vs_echo"), ("submit p50 ms", "submit_latency_ms.p50"),
         ("submit p99 ms", "submit_latency_ms.p99"), ("coord cores", "cpu_cores_used.coordinator"),
         ("echo server cores", "echo_cpu_cores_used.echo"), ("echo client cores", "echo_cpu_cores_used.loadgen")],
    ),
    "latency-1c": (
        ["--mode=submit", "--clients=1", "--jobs=5000"],
        [("submits/s", "submits_per_s"), ("p50 ms", "submit_latency_ms.p50"), ("p90 ms", "submit_latency_ms.p90"),
         ("p99 ms", "submit_latency_ms.p99"), ("max ms", "submit_latency_ms.max")],
    ),
    "latency-saturation-200c": (
        ["--mode=submit", "--clients=200", "--duration=10", "--coordinator-arg=--max-active-jobs=1000000"],
        [("submits/s", "submits_per_s"), ("p50 ms", "submit_latency_ms.p50"), ("p99 ms", "submit_latency_ms.p99"),
         ("max ms", "submit_latency_ms.max"), ("coord cores", "cpu_cores_used.coordinator")],
    ),
    "idle-10k": (
        ["--mode=idle", "--clients=10000", "--hold=10"],
        [("connections", "connections"), ("RSS KB/conn", "rss_per_connection_kb"),
         ("RSS before KB", "rss_before_kb"), ("RSS after KB", "rss_after_kb"),
         ("unanswered", "idle_unanswered"), ("connect s", "connect_s")],
    ),
    "burst-5k": (
        ["--mode=burst", "--clients=5000"],
        [("submits/s", "submits_per_s"), ("p50 ms", "submit_latency_ms.p50"), ("p99 ms", "submit_latency_ms.p99"),
         ("connect s", "connect_s"), ("lost", "lost")],
    ),
}


def dig(report: dict, path: str):
    value = report
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def median(values: list) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(nums) if nums else None


def fmt(value) -> str:
    if value is None:
        return "?"
    if isinstance(value, float) and not value.is_integer():
        return "%.3f" % value if abs(value) < 10 else "%.0f" % value
    return "%d" % value


def loadavg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = docopt(__doc__, argv=argv)
    names = list(PROFILES)
    if args["--only"]:
        names = [n.strip() for n in args["--only"].split(",") if n.strip()]
        unknown = [n for n in names if n not in PROFILES]
        if unknown:
            print("unknown profile(s): %s (known: %s)" % (", ".join(unknown), ", ".join(PROFILES)), file=sys.stderr)
            return 2
    if args["--list"]:
        for name in names:
            print("%-26s bench/loadgen %s" % (name, " ".join(PROFILES[name][0])))
        return 0
    runs = int(args["--runs"])
    out_dir = Path(args["--out-dir"] or Path(tempfile.gettempdir()) / "jobmesh-bench-results")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = []
    for name in names:
        loadgen_args, figures = PROFILES[name]
        reports, loads, codes = [], [], []
        for i in range(runs):
            out = out_dir / ("%s-%d.json" % (name, i + 1))
            loads.append(loadavg())
            cmd = [sys.executable, "-m", "bench.loadgen"] + loadgen_args + ["--quiet", "--out=%s" % out]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=600)
            codes.append(proc.returncode)
            sys.stdout.write("%s run %d (load %s, %.0fs, rc=%d): %s" % (
                name, i + 1, loads[-1], time.monotonic() - t0, proc.returncode, proc.stdout))
            if proc.returncode not in (0, 1):
                sys.stdout.write(proc.stderr[-2000:])
            sys.stdout.flush()
            if out.exists():
                reports.append(json.loads(out.read_text()))
        row = ["%s (%d runs, load %s, rc %s)" % (name, len(reports), "/".join(loads), ",".join(map(str, codes)))]
        for label, path in figures:
            row.append("%s %s" % (label, fmt(median([dig(r, path) for r in reports]))))
        table.append(row)
    print("\nmedians:")
    for row in table:
        print("- " + row[0] + ": " + "; ".join(row[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
