"""Task types with ``@task`` options for the tests: copied into a worker's directory as
``jm_task_options.py`` and loaded beside ``jm_user_tasks`` (tests/user_tasks_module.py).
The test process never imports it."""

from jobmesh.worker import task


@task("ONCE", max_attempts=1)
def once(payload):
    raise RuntimeError("once is enough")


@task("HASTY", timeout=0.3, max_attempts=1)
def hasty(payload, ctx):
    """Runs ``seconds`` (or until cancelled): past its type's 300 ms deadline unless the job says otherwise."""
    cancelled = ctx.cancelled.wait(payload["seconds"])
    return {"cancelled": cancelled}


@task("PATIENT", max_attempts=2, retry_backoff=(1.5, 1.5))
def patient(payload, ctx):
    if ctx.attempt < 2:
        raise RuntimeError("not yet")
    return {"attempt": ctx.attempt}
