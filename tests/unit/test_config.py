"""Config builders on real docopt dicts: defaults are CONTRACT.md's, bad values raise ConfigError."""

from __future__ import annotations

import os

import pytest

from jobmesh.cli import parse
from jobmesh.config import (
    CoordinatorConfig, WorkerConfig, coordinator_config, worker_config,
)
from jobmesh.addresses import Address
from jobmesh.errors import ConfigError, JobmeshError


def coord(*argv):
    command, args = parse(["coordinator", *argv])
    assert command == "coordinator"
    return coordinator_config(args)


def worker(*argv):
    command, args = parse(["worker", *argv])
    assert command == "worker"
    return worker_config(args)


def test_coordinator_defaults_are_the_contracts():
    cfg = coord()
    assert isinstance(cfg, CoordinatorConfig)
    assert cfg.bind == "127.0.0.1"
    assert cfg.worker_port == 7070
    assert cfg.client_port == 7071
    assert cfg.periodic_port is None          # off unless given
    assert cfg.db == "jobmesh.db"
    assert cfg.heartbeat_timeout_millis == 6000
    assert cfg.task_timeout_millis == 600_000
    assert cfg.max_active_jobs == 100_000
    assert cfg.aging_step_millis == 60_000
    assert cfg.retry_base_millis == 1000
    assert cfg.retry_cap_millis == 30_000
    assert cfg.default_max_attempts == 3
    assert cfg.sweep_interval_millis == 500


def test_docopt_defaults_equal_dataclass_defaults():
    # The usage text and the dataclass must not drift apart.
    cfg = coord()
    assert cfg.db_synchronous == CoordinatorConfig().db_synchronous
    assert cfg == CoordinatorConfig()


def test_coordinator_flags_are_applied():
    cfg = coord("--bind=0.0.0.0", "--worker-port=0", "--client-port=0", "--periodic-port=0", "--db=/tmp/x.db",
                "--heartbeat-timeout-millis=600", "--task-timeout-millis=300", "--max-active-jobs=3",
                "--aging-step-millis=200", "--retry-base-millis=20", "--retry-cap-millis=200",
                "--default-max-attempts=5", "--sweep-interval-millis=20", "--db-synchronous=normal",
                "--log-level=debug", "--insecure")
    assert cfg == CoordinatorConfig(
        bind="0.0.0.0", worker_port=0, client_port=0, periodic_port=0, db="/tmp/x.db",
        heartbeat_timeout_millis=600, task_timeout_millis=300, max_active_jobs=3, aging_step_millis=200,
        retry_base_millis=20, retry_cap_millis=200, default_max_attempts=5, sweep_interval_millis=20,
        db_synchronous="NORMAL", log_level="DEBUG", insecure=True,
    )


def test_periodic_port_given():
    assert coord("--periodic-port=5000").periodic_port == 5000


def test_periodic_rsa_keys_go_together_and_with_the_periodic_port():
    cfg = coord("--periodic-port=0", "--periodic-key=s.pem", "--periodic-authorized-keys=peers")
    assert (cfg.periodic_key, cfg.periodic_authorized_keys) == ("s.pem", "peers")
    assert coord().periodic_key is None and coord().periodic_authorized_keys is None
    for argv, message in [
        (["--periodic-port=0", "--periodic-key=s.pem"], "go together"),
        (["--periodic-port=0", "--periodic-authorized-keys=peers"], "go together"),
        (["--periodic-key=s.pem", "--periodic-authorized-keys=peers"], "--periodic-key needs --periodic-port"),
        (["--periodic-port=0", "--periodic-key=", "--periodic-authorized-keys=p"], "--periodic-key must name a file"),
    ]:
        with pytest.raises(ConfigError, match=message):
            coord(*argv)


def test_up_passes_the_periodic_keys_on():
    from jobmesh.up import coordinator_argv

    command, args = parse(["up", "--periodic-port=0", "--periodic-key=s.pem", "--periodic-authorized-keys=peers"])
    argv = coordinator_argv(coordinator_config(args))
    assert "--periodic-key=%s" % os.path.abspath("s.pem") in argv
    assert "--periodic-authorized-keys=%s" % os.path.abspath("peers") in argv
    assert not any("periodic-key" in a for a in coordinator_argv(coord()))


def test_config_is_frozen():
    cfg = coord()
    with pytest.raises(Exception):
        cfg.worker_port = 1  # type: ignore[misc]


INT_FLAGS = [
    "--worker-port", "--client-port", "--periodic-port", "--heartbeat-timeout-millis", "--task-timeout-millis",
    "--max-active-jobs", "--aging-step-millis", "--retry-base-millis", "--retry-cap-millis",
    "--default-max-attempts", "--sweep-interval-millis",
]
BAD_INTS = ["abc", "1.5", "", "0x10", "ten"]


# An empty --periodic-port means "off" in config.py; the contract says nothing, so that one pair is left out.
@pytest.mark.parametrize("flag,value", [(f, v) for f in INT_FLAGS for v in BAD_INTS
                                        if (f, v) != ("--periodic-port", "")])
def test_bad_ints_raise_config_error(flag, value):
    with pytest.raises(ConfigError) as info:
        coord("%s=%s" % (flag, value))
    # The message names the flag, so the CLI can tell the user which one.
    assert flag in str(info.value)


@pytest.mark.parametrize("argv", [
    ["--worker-port=65536"], ["--client-port=-1"], ["--periodic-port=70000"],
    ["--heartbeat-timeout-millis=0"], ["--task-timeout-millis=0"], ["--max-active-jobs=0"],
    ["--aging-step-millis=0"], ["--default-max-attempts=0"], ["--sweep-interval-millis=0"],
    ["--retry-base-millis=-1"], ["--retry-base-millis=100", "--retry-cap-millis=50"],
    ["--db-synchronous=SOMETIMES"], ["--log-level=LOUD"], ["--db="], ["--bind="],
])
def test_out_of_range_values_raise_config_error(argv):
    with pytest.raises(ConfigError):
        coord(*argv)


def test_config_error_is_a_jobmesh_error():
    assert issubclass(ConfigError, JobmeshError)


def test_up_uses_the_coordinator_options():
    command, args = parse(["up", "--workers=3", "--worker-port=0", "--max-active-jobs=9"])
    assert command == "up"
    assert args["--workers"] == "3"
    cfg = coordinator_config(args)
    assert (cfg.worker_port, cfg.max_active_jobs) == (0, 9)


def test_worker_defaults_are_the_contracts():
    cfg = worker()
    assert isinstance(cfg, WorkerConfig)
    assert cfg.coordinators == (Address("127.0.0.1", 7070),)
    assert cfg.capacity == 4
    assert cfg.heartbeat_interval_millis == 2000
    assert cfg.worker_id  # a generated id


def test_worker_generated_ids_differ():
    assert worker().worker_id != worker().worker_id


def test_worker_flags_are_applied():
    cfg = worker("--coordinator=10.0.0.5:9000", "--id=w-7", "--capacity=1024", "--heartbeat-interval-millis=50")
    assert (cfg.coordinators, cfg.worker_id, cfg.capacity,
            cfg.heartbeat_interval_millis) == ((Address("10.0.0.5", 9000),), "w-7", 1024, 50)


@pytest.mark.parametrize("argv", [
    ["--capacity=0"], ["--capacity=1025"], ["--capacity=four"], ["--heartbeat-interval-millis=0"],
    ["--heartbeat-interval-millis=x"], ["--coordinator=localhost"], ["--coordinator=:7070"],
    ["--coordinator=host:port"], ["--coordinator=host:0"], ["--coordinator=host:65536"], ["--id= "],
])
def test_bad_worker_values_raise_config_error(argv):
    with pytest.raises(ConfigError):
        worker(*argv)


def test_worker_capacity_edges():
    assert worker("--capacity=1").capacity == 1
    assert worker("--capacity=1024").capacity == 1024


def test_a_worker_takes_a_list_of_coordinators_and_a_connect_timeout():
    cfg = worker("--coordinator=10.0.0.5:9000, [::1]:9001", "--connect-timeout-millis=250")
    assert cfg.coordinators == (Address("10.0.0.5", 9000), Address("::1", 9001))
    assert cfg.connect_timeout_millis == 250
    assert worker().connect_timeout_millis == 1000


def test_lease_grace_is_off_by_default_and_validated():
    assert coord().lease_grace_millis == 0
    assert coord("--lease-grace-millis=6000").lease_grace_millis == 6000
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(ConfigError, match="--lease-grace-millis"):
            coord("--lease-grace-millis=%s" % bad)


def test_on_postgresql_the_lease_grace_defaults_to_the_heartbeat_timeout():
    # a standby that takes over keeps the running work of the leader it replaces
    url = "--db=postgresql://jobmesh@db.example:5432/jobs"
    assert coord(url, "--heartbeat-timeout-millis=2500").lease_grace_millis == 2500
    assert coord(url, "--lease-grace-millis=0").lease_grace_millis == 0
    assert coord("--db=jobs.db", "--heartbeat-timeout-millis=2500").lease_grace_millis == 0


def test_the_db_session_timeout_is_a_flag_up_passes_on():
    from jobmesh.up import coordinator_argv

    assert coord().db_session_timeout_millis == 5000
    cfg = coord("--db-session-timeout-millis=800")
    assert cfg.db_session_timeout_millis == 800 and "--db-session-timeout-millis=800" in coordinator_argv(cfg)
    with pytest.raises(ConfigError, match="--db-session-timeout-millis"):
        coord("--db-session-timeout-millis=10")


def test_the_periodic_forget_idle_time_is_a_flag_up_passes_on():
    from jobmesh.up import coordinator_argv, up_coordinator_config

    assert coord().periodic_forget_idle_millis == 3_600_000
    cfg = up_coordinator_config(parse(["up", "--periodic-forget-idle-millis=250"])[1])
    assert cfg.periodic_forget_idle_millis == 250 and "--periodic-forget-idle-millis=250" in coordinator_argv(cfg)
    with pytest.raises(ConfigError, match="--periodic-forget-idle-millis"):
        coord("--periodic-forget-idle-millis=-1")


def test_db_synchronous_is_sqlites_full_unless_given_and_up_passes_it_on_sqlite_only():
    from jobmesh.up import coordinator_argv

    assert coord().db_synchronous == "FULL" and "--db-synchronous=FULL" in coordinator_argv(coord())
    url = "--db=postgresql://jobmesh@db.example:5432/jobs"
    assert not [a for a in coordinator_argv(coord(url)) if a.startswith("--db-synchronous")]
    with pytest.raises(ConfigError, match="--db-synchronous .*PostgreSQL"):
        coord(url, "--db-synchronous=FULL")


def test_up_gives_its_coordinator_the_heartbeat_timeout_as_lease_grace_unless_told():
    from jobmesh.up import coordinator_argv, up_coordinator_config

    cfg = up_coordinator_config(parse(["up", "--heartbeat-timeout-millis=1500"])[1])
    assert cfg.lease_grace_millis == 1500 and "--lease-grace-millis=1500" in coordinator_argv(cfg)
    assert up_coordinator_config(parse(["up", "--lease-grace-millis=0"])[1]).lease_grace_millis == 0
    assert up_coordinator_config(parse(["up"])[1]).lease_grace_millis == 6000


def test_up_gives_its_coordinator_a_database_password_in_the_environment_never_on_its_command_line():
    from jobmesh.cli import settings
    from jobmesh.up import coordinator_argv, coordinator_environment, up_coordinator_config

    url = "postgresql://jobs:very-secret@db.example:5432/jobs"
    cfg = up_coordinator_config(parse(["up", "--db=" + url])[1])
    argv = coordinator_argv(cfg)
    assert not any("secret" in arg for arg in argv)
    child = argv[argv.index("coordinator"):]
    args, _sources = settings("coordinator", child, parse(child)[1], coordinator_environment(cfg))
    assert coordinator_config(args).db == url  # what the coordinator up starts reads
    plain = up_coordinator_config(parse(["up", "--db=postgresql://jobs@db.example/jobs"])[1])
    assert "--db=postgresql://jobs@db.example/jobs" in coordinator_argv(plain)


def test_keep_running_defaults_to_30_seconds_and_is_validated():
    assert worker().keep_running_millis == 30_000 == WorkerConfig().keep_running_millis
    assert worker("--keep-running-millis=0").keep_running_millis == 0
    with pytest.raises(ConfigError, match="--keep-running-millis"):
        worker("--keep-running-millis=-5")
