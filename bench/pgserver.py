"""A throwaway PostgreSQL server for tests and benchmarks (Debian's ``postgresql`` package).

``PostgresServer().start()`` runs ``initdb`` on a temporary directory and starts the
server on a free loopback port, its socket directory inside the temporary directory, with
trust authentication on loopback only. ``initdb`` refuses to run as root, so as root the
directory is handed to the ``postgres`` user and every server command runs as that user
(``runuser``). ``stop()`` stops the server (``pg_ctl stop``, then its pid) and removes the
directory. ``database()`` gives a fresh empty database (``CREATE DATABASE``), or a fresh
schema of one shared database (``schema()``): measured, CREATE DATABASE takes about
100 ms and CREATE SCHEMA under 1 ms, so the tests use schemas (the store's tables and its
leadership lock are per schema) and the benchmarks a database.

Standard library only (psycopg when it is there): the unpatched test process and the load
generator both import it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

USER = "postgres"  # the database superuser, and the system user the server runs as under root


def find_bin_dir() -> str | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb and pg_ctl, or None."""
    found = []
    for path in glob.glob("/usr/lib/postgresql/*/bin"):
        version = Path(path).parent.name
        if os.access(os.path.join(path, "initdb"), os.X_OK) and os.access(os.path.join(path, "pg_ctl"), os.X_OK):
            found.append((int(version) if version.isdigit() else 0, path))
    return max(found)[1] if found else None


def missing_reason() -> str | None:
    """Why no server can be started here (None: one can)."""
    if find_bin_dir() is None:
        return "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return "running as root and there is no %r user to run initdb as" % USER
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerFailed(Exception):
    """The server did not start; the message quotes its log."""


class PostgresServer:
    """One server on a free loopback port. ``durable=False`` (tests) turns fsync off: a
    killed coordinator loses nothing either way, only a machine crash would."""

    def __init__(self, durable: bool = True) -> None:
        self.durable = durable
        self.bin_dir = find_bin_dir()
        self.dir: Path | None = None
        self.port = 0
        self._count = 0
        self._shared: str | None = None  # the database schema() makes schemas in

    @property
    def data(self) -> Path:
        assert self.dir is not None
        return self.dir / "data"

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "server.log"

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        assert self.bin_dir is not None
        command = [os.path.join(self.bin_dir, argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", USER, "--"] + command
        return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                              cwd="/")

    def start(self, timeout: float = 60) -> "PostgresServer":
        reason = missing_reason()
        if reason is not None:
            raise ServerFailed(reason)
        self.dir = Path(tempfile.mkdtemp(prefix="jobmesh-pg-"))
        os.chmod(self.dir, 0o700)
        if os.geteuid() == 0:
            user = pwd.getpwnam(USER)
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        done = self._run("initdb", "-D", str(self.data), "-U", USER, "-A", "trust", "-E", "UTF8", "--locale=C",
                         *(() if self.durable else ("--no-sync",)))
        if done.returncode != 0:
            raise ServerFailed("initdb failed: %s" % (done.stderr.strip() or done.stdout.strip()))
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\n"
                       "max_connections = 200\nshared_buffers = 128MB\n" % self.dir)
            if not self.durable:
                conf.write("fsync = off\nfull_page_writes = off\n")
        with open(self.data / "pg_hba.conf", "w") as hba:  # loopback only, no password
            hba.write("local all all trust\nhost all all 127.0.0.1/32 trust\n")
        for _ in range(5):  # a port found free may be taken before the server binds it
            self.port = free_port()
            done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", "-p %d" % self.port,
                             "-w", "-t", str(int(timeout)), "start", timeout=timeout + 10)
            if done.returncode == 0:
                break
        else:
            raise ServerFailed("pg_ctl start failed: %s" % self.log_tail())
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise ServerFailed("the server does not accept connections: %s" % self.log_tail())

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return "(no log)"

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def url(self, dbname: str = "postgres", schema: str | None = None) -> str:
        """A libpq URL of a database (and a schema: the search path, through ``options``)."""
        url = "postgresql://%s@127.0.0.1:%d/%s" % (USER, self.port, dbname)
        if schema is not None:
            url += "?options=" + urllib.parse.quote("-csearch_path=%s" % schema)
        return url

    def sql(self, statement: str, dbname: str = "postgres") -> str:
        """Run one statement as the superuser (through psycopg when it is installed, else
        psql); returns its rows, one a line, columns joined by ``|``."""
        try:
            import psycopg
        except ImportError:
            done = self._run("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                             "-p", str(self.port), "-U", USER, "-d", dbname, "-c", statement)
            if done.returncode != 0:
                raise ServerFailed("psql failed: %s" % done.stderr.strip())
            return done.stdout.strip()
        with psycopg.connect(self.url(dbname), autocommit=True) as conn:
            cursor = conn.execute(statement.encode())
            rows = cursor.fetchall() if cursor.description is not None else []
        return "\n".join("|".join("" if v is None else str(v) for v in row) for row in rows)

    def database(self, prefix: str = "jobmesh") -> str:
        """The URL of a new empty database."""
        self._count += 1
        name = "%s_%d" % (prefix, self._count)
        self.sql("CREATE DATABASE %s" % name)
        return self.url(name)

    def schema(self, prefix: str = "t") -> str:
        """The URL of a new empty schema of one database shared by every schema()."""
        if self._shared is None:
            self._shared = "jobmesh_schemas"
            self.sql("CREATE DATABASE %s" % self._shared)
        self._count += 1
        name = "%s_%d" % (prefix, self._count)
        self.sql("CREATE SCHEMA %s" % name, self._shared)
        return self.url(self._shared, name)

    def restart(self, timeout: float = 60) -> None:
        """``pg_ctl restart -m fast``: every session ends; the server comes back on the same port."""
        done = self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", "-p %d" % self.port,
                         "-m", "fast", "-w", "-t", str(int(timeout)), "restart", timeout=timeout + 10)
        if done.returncode != 0:
            raise ServerFailed("pg_ctl restart failed: %s" % self.log_tail())
        self._wait_ready(timeout)

    def stop(self) -> None:
        """Stop the server (fast shutdown, then its pid) and remove its directory."""
        if self.dir is None:
            return
        pid = self.pid()
        if pid is not None:
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop", timeout=40)
            except subprocess.TimeoutExpired:
                pass
            if self.pid() is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
