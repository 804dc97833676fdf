"""The whole package is typed: ``python -m mypy jobmesh`` with the configuration in
setup.cfg (every function annotated; gevent, which has no type information, is the one
library whose imports are unchecked) reports nothing; and a user's code on the asyncio
client, and a task module with a workflow built from its functions' ``.s``, are checked
against their types."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_is_mypy_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    # From the repository root, so that mypy reads setup.cfg; the incremental cache (the one
    # a plain ``mypy`` run there uses too) keeps a run after small changes to a few seconds.
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(ROOT / ".mypy_cache"), "jobmesh"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("Success:") and not proc.stderr, \
        proc.stdout + proc.stderr


USER_CODE = '''
import asyncio

from jobmesh.aio import AsyncClient
from jobmesh.client import CoordinatorClient, chain, chord, group, step
from jobmesh.worker import TaskContext, task


async def main() -> None:
    async with AsyncClient("127.0.0.1:7071", token="t", tls_ca="ca.pem") as client:
        job_id: str = await client.submit("SHA256", {"text": "a"}, priority="HIGH", delay=3, timeout_millis=5)
        job: dict[str, object] = await client.wait(job_id, timeout=3)
        cancelled, snapshot = await client.cancel(job_id)
        jobs, cursor = await client.list_jobs(limit=10)
        async for item in client.iter_jobs(state="FAILED"):
            print(item["jobId"], job, cancelled, snapshot, jobs, cursor)
        await client.submit("SHA256", [1])  # wrong: a payload is a dict
        count: int = await client.status(job_id)  # wrong: a snapshot is a dict
        client.status(job_id).upper()  # wrong: not awaited


@task("RESIZE")
def resize(payload: dict[str, object]) -> dict[str, object]:
    return payload


@task("ALBUM")
def album(payload: dict[str, object], ctx: TaskContext) -> dict[str, object]:
    return {"pages": len(ctx.parents)}


def workflows(images: list[str]) -> None:
    with CoordinatorClient("127.0.0.1:7071") as client:
        shape = chain(group(resize.s(image=i) for i in images), chord(group(resize.s(), resize.s()), album.s()))
        workflow_id, job_ids = client.submit_workflow(shape | step("ALBUM", {"n": 1}).set(priority="HIGH"))
        done: dict[str, object] = client.wait_workflow(workflow_id, timeout=5)
        print(job_ids["ALBUM.0"], done, resize({"image": "a"}), resize.s({"image": "b"}).set(ref="b"))
        client.submit_workflow({"ref": "a"})  # wrong: a shape, or a list of job objects
        resize.s(["a.png"])  # wrong: a payload is a dict
        resize("a.png")  # wrong: the function keeps its own signature


async def async_workflows() -> None:
    async with AsyncClient("127.0.0.1:7071") as client:
        workflow_id, _ = await client.submit_workflow([{"ref": "a", "taskType": "ALBUM", "payload": {}}], name="x")
        await client.cancel_workflow(workflow_id)
        await client.submit_workflow(album)  # wrong: a task function is not a step; album.s() is
'''


def test_a_users_asyncio_code_is_checked_against_the_clients_types(tmp_path) -> None:
    """``jobmesh.aio`` as a user's mypy --strict sees it (the package found on MYPYPATH, as
    an installed copy with its py.typed marker would be): the README's example and correct
    calls pass, wrong ones are reported where they are."""
    pytest.importorskip("mypy", reason="mypy is in the dev extra: pip install -e '.[dev]'")
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From asyncio"):]
    (tmp_path / "readme_example.py").write_text(section.split("```python\n")[1].split("```")[0])
    (tmp_path / "user_code.py").write_text(USER_CODE)
    env = dict(os.environ, MYPYPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(tmp_path / ".mypy_cache"), "readme_example.py", "user_code.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    wrong = [n for n, line in enumerate(USER_CODE.splitlines(), 1) if "# wrong" in line]
    reported = sorted({int(line.split(":")[1]) for line in proc.stdout.splitlines() if ": error:" in line
                       and line.startswith("user_code.py:")})
    assert reported == wrong and "readme_example.py" not in proc.stdout and not proc.stderr, proc.stdout + proc.stderr
    assert (ROOT / "jobmesh" / "py.typed").exists()
