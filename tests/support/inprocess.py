"""A real coordinator inside the test process, for tests that need one of their own but
no process of their own.

``InProcessCoordinator`` runs ``Coordinator`` (``jobmesh/coordinator/shell/runtime.py``,
the code ``jobmesh coordinator`` runs) on 127.0.0.1, port 0, with a temp SQLite file and
the same FAST_FLAGS as ``CoordinatorProc``, under a gevent hub of its own on a thread of
its own. The test process stays unpatched: the coordinator's sockets, timers and
database thread are gevent's own objects, which run on that hub, while the test talks to
it with blocking stdlib sockets (``RawConn``, ``Client``, ``ScriptedWorker``) from its
own thread, exactly as it talks to a coordinator process. (A gevent server on the test's
own thread would deadlock against a blocking client: nothing runs its hub while the
client waits.)

Only the hub's thread touches the coordinator: ``call(fn)`` runs ``fn(coordinator)``
there and returns its value. ``log()`` is what this coordinator logged (INFO and up),
from its thread only, so several may run side by side. What a process would add is not
here: monkey-patching (the coordinator names gevent's sockets, timers and thread pool
itself, so its code runs the same unpatched), signals, the CLI's arguments and logging
set-up, exit codes, a crash of its own, and the release of whatever a failed start had
opened; tests of those start a ``CoordinatorProc``.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from jobmesh.config import CoordinatorConfig
from tests.support.processes import FAST_FLAGS, LISTENING, listening_addresses

START_SECONDS = 15.0
STOP_SECONDS = 15.0

_threads = itertools.count(1)
_levels_lock = threading.Lock()
_running = 0  # hosts started and not stopped: while any runs, the "jobmesh" logger passes INFO
_saved_level = logging.NOTSET


def _raise_log_level() -> None:
    global _running, _saved_level
    with _levels_lock:
        if _running == 0:
            logger = logging.getLogger("jobmesh")
            _saved_level = logger.level
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        _running += 1


def _restore_log_level() -> None:
    global _running
    with _levels_lock:
        _running -= 1
        if _running == 0:
            logging.getLogger("jobmesh").setLevel(_saved_level)


class _ThreadLog(logging.Handler):
    """The lines one thread logs, formatted as the coordinator's text log is."""

    def __init__(self, thread_name: str) -> None:
        super().__init__(logging.INFO)
        self.thread_name = thread_name
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == self.thread_name:
            self.lines.append(self.format(record))


class InProcessCoordinator:
    """A coordinator on a hub thread of the test process, shaped like ``CoordinatorProc``
    (``worker_addr``, ``client_addr``, ``client_target``, ``running()``), so a test or a
    helper takes either."""

    def __init__(self, tmp_path: Path, name: str = "inproc", **flags: Any) -> None:
        self.tmp_path = Path(tmp_path)
        self.name = name
        settings = {k.replace("-", "_"): v for k, v in FAST_FLAGS.items()}
        settings.update(flags)
        settings.setdefault("db", str(self.tmp_path / ("%s.db" % name)))
        self.config = CoordinatorConfig(**dict(settings, worker_port=0, client_port=0))
        self.coordinator: Any = None  # the runtime's Coordinator, once started (touch it only through call)
        self.worker_addr: tuple[str, int] | None = None
        self.client_addr: tuple[str, int] | None = None
        self.periodic_addr: tuple[str, int] | None = None
        self.metrics_addr: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None
        self._hub: Any = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._log: _ThreadLog | None = None
        self._lines: list[str] = []

    # ---- start and stop ---------------------------------------------------------------

    def start(self, timeout: float = START_SECONDS) -> "InProcessCoordinator":
        """Start the coordinator and return once it listens; raises what its start raised."""
        assert self._thread is None or not self._thread.is_alive(), "already running"
        self._started.clear()
        self._failure = None
        _raise_log_level()
        thread_name = "coordinator-%s-%d" % (self.name, next(_threads))
        self._log = _ThreadLog(thread_name)
        self._lines = self._log.lines
        logging.getLogger("jobmesh").addHandler(self._log)
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise AssertionError("the in-process coordinator did not start within %.0f s" % timeout)
        if self._failure is not None:
            self._thread.join(STOP_SECONDS)
            self._detach()
            raise self._failure
        return self

    def _serve(self) -> None:
        """The hub thread: start the coordinator, then run its hub until it has stopped."""
        import gevent

        from jobmesh.coordinator.shell.runtime import Coordinator

        hub = gevent.get_hub()
        try:
            coordinator = Coordinator(self.config)
            m = LISTENING.search(coordinator.start() or "")
            assert m is not None, "no listening line"
            self.worker_addr, self.client_addr, self.periodic_addr, self.metrics_addr = listening_addresses(m)
            self.coordinator = coordinator
            self._hub = hub
        except BaseException as exc:
            self._failure = exc
            self._started.set()
            hub.destroy(destroy_loop=True)
            return
        self._started.set()
        coordinator.stopped.wait()
        hub.destroy(destroy_loop=True)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop it as SIGTERM would (``Coordinator.stop``) and wait for its thread; idempotent."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive() and self._hub is not None:
            import gevent

            self._hub.loop.run_callback_threadsafe(gevent.spawn, self.coordinator.stop)
            thread.join(timeout)
            if thread.is_alive():
                raise AssertionError("the in-process coordinator did not stop within %.0f s" % timeout)
        self._detach()
        self._hub = None
        self._thread = None

    def _detach(self) -> None:
        if self._log is not None:
            logging.getLogger("jobmesh").removeHandler(self._log)
            _restore_log_level()
            self._log = None
        gc.unfreeze()  # the coordinator froze what was alive at its start (the test process's too)

    cleanup = stop

    # ---- what a test asks --------------------------------------------------------------

    def running(self) -> bool:
        """True while it serves: started, not stopped, its core alive."""
        thread = self._thread
        return (thread is not None and thread.is_alive() and self.coordinator is not None
                and not self.coordinator.stopped.is_set())

    def call(self, fn: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        """``fn(coordinator)`` run in a greenlet on the hub's thread; its value, or what it raised."""
        assert self._hub is not None, "not running"
        import gevent

        done = threading.Event()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn(self.coordinator)
            except BaseException as exc:  # handed to the caller
                outcome["error"] = exc
            finally:
                done.set()

        self._hub.loop.run_callback_threadsafe(gevent.spawn, run)
        if not done.wait(timeout):
            raise AssertionError("the coordinator's hub did not run a call within %.0f s" % timeout)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def log(self) -> str:
        """What it has logged since its last start (INFO and up), one line per record."""
        return "\n".join(self._lines)

    @property
    def client_target(self) -> str:
        assert self.client_addr is not None
        return "%s:%d" % self.client_addr

    @property
    def worker_target(self) -> str:
        assert self.worker_addr is not None
        return "%s:%d" % self.worker_addr
