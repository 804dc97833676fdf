"""Settings from the environment and a --config file, in real processes."""

from __future__ import annotations

import json

from tests.support.cli import run_cli
from tests.support.waiting import wait_until


def test_up_reads_its_config_file_and_its_children_do_not(start_up, tmp_path, monkeypatch):
    # Given a config file with keys of up's own (workers, capacity) beside coordinator ones,
    # named by JOBMESH_CONFIG: a worker reading it would refuse 'workers' and exit.
    conf = tmp_path / "up.toml"
    conf.write_text("workers = 1\ncapacity = 3\nretry-base-millis = 10\n")
    monkeypatch.setenv("JOBMESH_CONFIG", str(conf))
    up = start_up()
    target = "%s:%d" % up.client_addr

    def one_worker():
        out = run_cli("workers", "--json", coordinator=target)
        workers = json.loads(out.stdout) if out.returncode == 0 else []
        return workers if len(workers) == 1 else None

    workers = wait_until(one_worker, timeout=30, interval=0.2, message="up's one worker")
    assert workers[0]["capacity"] == 3
    assert "unknown key" not in up.log()
