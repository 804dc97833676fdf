"""The systems ``bench/peers.py`` compares, each driven through its own Python client.

Every system runs the same no-op task, which returns the wall-clock time it ran at
(``time.time()``: one float, about what jobmesh's built-in ``SLEEP 0`` returns), and
stores that result where its users would read it:

- ``jobmesh``: the built-in ``SLEEP`` with ``durationMillis`` 0 on ``jobmesh worker``
  processes; the job's ``updatedAtMillis`` (the coordinator's clock when the result was
  recorded) is its completion time.
- ``celery``: a Celery app on Redis with the Redis result backend; defaults otherwise
  (acks early, prefetch multiplier 4); ``celery worker -P prefork -c W``.
- ``celery-late``: the same with ``task_acks_late`` and a prefetch multiplier of 1, the
  settings Celery's documentation gives for tasks that must survive a worker's crash.
- ``rq``: RQ's default ``Worker`` (forks a work horse per job), W ``rq worker`` processes.
- ``rq-simple``: RQ's ``SimpleWorker`` (runs jobs in the worker process itself).
- ``dramatiq``: ``RedisBroker`` with the ``Results`` middleware on a Redis result
  backend; ``dramatiq --processes W`` with its default 8 threads each.
- ``huey``: ``RedisHuey`` (results stored by default); ``huey_consumer -w W -k process``.

A client builds its system's app on the URL it is given. A worker command names its app
as ``bench.peer_apps:NAME``, built on first use (module ``__getattr__``) from the Redis URL
in ``$BENCH_PEER_URL``; so importing this module needs none of the peers' packages.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

URL_ENV = "BENCH_PEER_URL"
QUEUE = "default"
BIN = Path(sys.executable).parent  # the peers' console scripts sit beside this interpreter


def noop() -> float:
    """The task every peer runs (RQ imports it by this module path)."""
    return time.time()


# ---- the peers' apps, built on first use ------------------------------------------------------


def _url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        raise RuntimeError("$%s (the Redis URL) is not set" % URL_ENV)
    return url


def _celery(url: str, acks_late: bool) -> Any:
    from celery import Celery

    app = Celery("bench_peers", broker=url, backend=url, set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, broker_connection_retry_on_startup=True, worker_hijack_root_logger=True)
    if acks_late:
        app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1)
    app.task(name="bench.noop")(noop)
    return app


def _dramatiq(url: str) -> Any:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.results import Results
    from dramatiq.results.backends import RedisBackend

    broker = RedisBroker(url=url)
    backend = RedisBackend(url=url)
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)
    actor = dramatiq.actor(noop, actor_name="noop", queue_name=QUEUE, store_results=True, broker=broker)
    return broker, backend, actor


def _huey(url: str) -> Any:
    from huey import RedisHuey

    huey = RedisHuey("bench", url=url)
    return huey, huey.task()(noop)


# What the worker commands name: built once per worker process, on $BENCH_PEER_URL.
_BUILDERS: dict[str, Callable[[str], Any]] = {
    "celery_app": lambda url: _celery(url, False),
    "celery_late_app": lambda url: _celery(url, True),
    "dramatiq_broker": lambda url: _dramatiq(url)[0],
    "huey_app": lambda url: _huey(url)[0],
}
_BUILT: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name not in _BUILDERS:
        raise AttributeError(name)
    if name not in _BUILT:
        _BUILT[name] = _BUILDERS[name](_url())
    return _BUILT[name]


# ---- the client side: submit, read a result, count what is queued ---------------------------


class Client:
    """One system's client in the bench's client process: ``submit()`` returns a handle,
    ``done_at(handle)`` the completion time once the result is in (None before),
    ``queued()`` how many jobs wait in its queue. One object is shared by every greenlet
    of the process (each peer's client is made for that), except jobmesh's, whose
    connection serves one caller at a time: ``per_greenlet`` says to make one each."""

    per_greenlet = False

    def submit(self) -> Any:
        raise NotImplementedError

    def done_at(self, handle: Any) -> float | None:
        raise NotImplementedError

    def queued(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JobmeshClient(Client):
    per_greenlet = True

    def __init__(self, address: str) -> None:
        from jobmesh.client.api import CoordinatorClient

        self.client = CoordinatorClient(address)

    def submit(self) -> Any:
        return self.client.submit("SLEEP", {"durationMillis": 0})

    def done_at(self, handle: Any) -> float | None:
        job = self.client.status(handle)
        return job["updatedAtMillis"] / 1000.0 if job["state"] == "COMPLETED" else None

    def queued(self) -> int:
        return sum(self.client.stats().jobs.values())

    def close(self) -> None:
        self.client.close()


class CeleryClient(Client):
    def __init__(self, url: str, acks_late: bool) -> None:
        self.app = _celery(url, acks_late)
        self.task = self.app.tasks["bench.noop"]

    def submit(self) -> Any:
        return self.task.apply_async().id

    def done_at(self, handle: Any) -> float | None:
        meta = self.app.backend.get_task_meta(handle, cache=False)
        return meta["result"] if meta["status"] == "SUCCESS" else None

    def queued(self) -> int:
        with self.app.connection_for_write() as conn:
            return conn.default_channel.queue_declare(queue=QUEUE, passive=True).message_count

    def close(self) -> None:
        self.app.close()


class RqClient(Client):
    def __init__(self, url: str) -> None:
        from redis import Redis
        from rq import Queue

        self.queue = Queue(QUEUE, connection=Redis.from_url(url))

    def submit(self) -> Any:
        return self.queue.enqueue(noop)

    def done_at(self, handle: Any) -> float | None:
        return handle.return_value(refresh=True)

    def queued(self) -> int:
        return self.queue.count


class DramatiqClient(Client):
    def __init__(self, url: str) -> None:
        self.broker, self.backend, self.actor = _dramatiq(url)

    def submit(self) -> Any:
        return self.actor.send()

    def done_at(self, handle: Any) -> float | None:
        from dramatiq.results import ResultMissing

        try:
            return handle.get_result(backend=self.backend)
        except ResultMissing:
            return None

    def queued(self) -> int:
        return int(self.broker.do_qsize(QUEUE))


class HueyClient(Client):
    def __init__(self, url: str) -> None:
        self.huey, self.task = _huey(url)

    def submit(self) -> Any:
        return self.task()

    def done_at(self, handle: Any) -> float | None:
        return handle.get(preserve=True)

    def queued(self) -> int:
        return int(self.huey.pending_count())


# ---- what the bench needs to know of each system ----------------------------------------------


class System:
    """``package``: what must be importable (None: nothing beyond jobmesh); ``workers``:
    the worker command lines for W worker processes on a Redis URL; ``ready(url,
    children, W)``: whether those commands (``bench.procs.Child``) take jobs with all W
    processes up. Every worker logs at WARNING, as the bench runs jobmesh's: a log line
    per job would cost a system CPU per job that the bench does not mean to measure."""

    def __init__(self, name: str, package: str | None, client: Callable[[str], Client],
                 workers: Callable[[int, str], list[list[str]]], ready: Callable[[str, list[Any], int], bool],
                 forks_per_job: bool = False) -> None:
        self.name = name
        self.package = package
        self.client = client
        self.workers = workers
        self.ready = ready
        self.forks_per_job = forks_per_job

    def missing(self) -> str | None:
        """Why this system cannot run here (None: it can)."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return "the Python package %r is not installed (pip install -e '.[peers]')" % self.package
        return None


def _script(name: str) -> str:
    return str(BIN / name)


def _forked(url: str, children: list[Any], w: int) -> bool:
    """A prefork command (one parent) has forked its W worker processes."""
    try:
        with open("/proc/%d/task/%d/children" % (children[0].pid, children[0].pid)) as f:
            return len(f.read().split()) >= w
    except OSError:
        return False


def _jobmesh_registered(url: str, children: list[Any], w: int) -> bool:
    from jobmesh.client.api import CoordinatorClient

    with CoordinatorClient(url) as client:
        return client.stats().workers >= w


def _rq_registered(url: str, children: list[Any], w: int) -> bool:
    from redis import Redis
    from rq import Worker

    with Redis.from_url(url) as conn:
        return Worker.count(connection=conn) >= w


def _dramatiq_ready(url: str, children: list[Any], w: int) -> bool:
    """Each of its worker processes logs this line (at INFO, its default level, which logs
    nothing per job)."""
    return sum(Path(c.err_path).read_text(errors="replace").count("is ready for action") for c in children) >= w


def _celery_workers(app: str) -> Callable[[int, str], list[list[str]]]:
    return lambda w, url: [[_script("celery"), "-A", "bench.peer_apps:%s" % app, "worker", "-P", "prefork", "-c", str(w),
                            "-Q", QUEUE, "--loglevel=WARNING"]]


def _rq_workers(worker_class: str | None) -> Callable[[int, str], list[list[str]]]:
    extra = ["-w", worker_class] if worker_class else []
    return lambda w, url: [[_script("rq"), "worker", "--url", url, "--logging_level", "WARNING", *extra, QUEUE]
                           for _ in range(w)]


SYSTEMS = {s.name: s for s in [
    System("jobmesh", None, JobmeshClient, lambda w, url: [], _jobmesh_registered),  # bench/peers.py starts them
    System("celery", "celery", lambda url: CeleryClient(url, False), _celery_workers("celery_app"), _forked),
    System("celery-late", "celery", lambda url: CeleryClient(url, True), _celery_workers("celery_late_app"), _forked),
    System("rq", "rq", RqClient, _rq_workers(None), _rq_registered, forks_per_job=True),
    System("rq-simple", "rq", RqClient, _rq_workers("rq.worker.SimpleWorker"), _rq_registered),
    System("dramatiq", "dramatiq", DramatiqClient,
           lambda w, url: [[_script("dramatiq"), "bench.peer_apps:dramatiq_broker", "--processes", str(w)]],
           _dramatiq_ready),
    System("huey", "huey", HueyClient,
           lambda w, url: [[_script("huey_consumer"), "bench.peer_apps.huey_app", "-w", str(w), "-k", "process", "-q"]],
           _forked),
]}
