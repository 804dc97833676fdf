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

The peers' apps are built on first use (module ``__getattr__``), from the Redis URL in
``$BENCH_PEER_URL``, so that importing this module needs none of the peers' packages and
each worker command names its app as ``bench.peer_apps:NAME``.
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


def _celery(acks_late: bool) -> Any:
    from celery import Celery

    app = Celery("bench_peers", broker=_url(), backend=_url(), set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, broker_connection_retry_on_startup=True, worker_hijack_root_logger=True)
    if acks_late:
        app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1)
    app.task(name="bench.noop")(noop)
    return app


def _dramatiq() -> Any:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.results import Results
    from dramatiq.results.backends import RedisBackend

    broker = RedisBroker(url=_url())
    backend = RedisBackend(url=_url())
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)
    actor = dramatiq.actor(noop, actor_name="noop", queue_name=QUEUE, store_results=True, broker=broker)
    return broker, backend, actor


def _huey() -> Any:
    from huey import RedisHuey

    huey = RedisHuey("bench", url=_url())
    return huey, huey.task()(noop)


_BUILDERS: dict[str, Callable[[], Any]] = {
    "celery_app": lambda: _celery(False),
    "celery_late_app": lambda: _celery(True),
    "dramatiq_parts": _dramatiq,
    "dramatiq_broker": lambda: _get("dramatiq_parts")[0],
    "huey_parts": _huey,
    "huey_app": lambda: _get("huey_parts")[0],
}
_BUILT: dict[str, Any] = {}


def _get(name: str) -> Any:
    if name not in _BUILT:
        _BUILT[name] = _BUILDERS[name]()
    return _BUILT[name]


def __getattr__(name: str) -> Any:
    if name in _BUILDERS:
        return _get(name)
    raise AttributeError(name)


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
        os.environ[URL_ENV] = url
        self.app = _get("celery_late_app" if acks_late else "celery_app")
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
        os.environ[URL_ENV] = url
        self.broker, self.backend, self.actor = _get("dramatiq_parts")

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
        os.environ[URL_ENV] = url
        self.huey, self.task = _get("huey_parts")

    def submit(self) -> Any:
        return self.task()

    def done_at(self, handle: Any) -> float | None:
        return handle.get(preserve=True)

    def queued(self) -> int:
        return int(self.huey.pending_count())


# ---- what the bench needs to know of each system ----------------------------------------------


class System:
    """``package``: what must be importable (None: nothing beyond jobmesh); ``workers``
    the worker command lines for W worker processes on a Redis URL; ``ready``: a line each worker
    command logs when it takes jobs, and how many times in all."""

    def __init__(self, name: str, package: str | None, client: Callable[[str], Client],
                 workers: Callable[[int, str], list[list[str]]], ready: str, ready_count: Callable[[int], int],
                 forks_per_job: bool = False) -> None:
        self.name = name
        self.package = package
        self.client = client
        self.workers = workers
        self.ready = ready
        self.ready_count = ready_count
        self.forks_per_job = forks_per_job

    def missing(self) -> str | None:
        """Why this system cannot run here (None: it can)."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return "the Python package %r is not installed (pip install -e '.[peers]')" % self.package
        return None


def _script(name: str) -> str:
    return str(BIN / name)


def _celery_workers(app: str) -> Callable[[int, str], list[list[str]]]:
    return lambda w, url: [[_script("celery"), "-A", "bench.peer_apps:%s" % app, "worker", "-P", "prefork", "-c", str(w),
                       "-Q", QUEUE, "--loglevel=INFO"]]


def _rq_workers(worker_class: str | None) -> Callable[[int, str], list[list[str]]]:
    extra = ["-w", worker_class] if worker_class else []
    return lambda w, url: [[_script("rq"), "worker", "--url", url, *extra, QUEUE] for _ in range(w)]


SYSTEMS = {s.name: s for s in [
    System("jobmesh", None, JobmeshClient, lambda w, url: [], "", lambda w: 0),
    System("celery", "celery", lambda url: CeleryClient(url, False), _celery_workers("celery_app"),
           " ready.", lambda w: 1),
    System("celery-late", "celery", lambda url: CeleryClient(url, True), _celery_workers("celery_late_app"),
           " ready.", lambda w: 1),
    System("rq", "rq", RqClient, _rq_workers(None), "Listening on", lambda w: w, forks_per_job=True),
    System("rq-simple", "rq", RqClient, _rq_workers("rq.worker.SimpleWorker"), "Listening on", lambda w: w),
    System("dramatiq", "dramatiq", DramatiqClient,
           lambda w, url: [[_script("dramatiq"), "bench.peer_apps:dramatiq_broker", "--processes", str(w)]],
           "is ready for action", lambda w: w),
    System("huey", "huey", HueyClient,
           lambda w, url: [[_script("huey_consumer"), "bench.peer_apps.huey_app", "-w", str(w), "-k", "process"]],
           "Huey consumer started", lambda w: 1),
]}
