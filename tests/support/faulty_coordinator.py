"""``python tests/support/faulty_coordinator.py ARGS``: ``python -m jobmesh ARGS`` whose stores
fail on demand (tests/support/faulty_store.py: the file ``JOBMESH_TEST_STORAGE_FAULT_FILE``
names says how). Patched first, as jobmesh/__main__.py does."""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: ``tests`` importable

from jobmesh.cli import main  # noqa: E402
from tests.support.faulty_store import install  # noqa: E402

if __name__ == "__main__":
    install()
    sys.exit(main(sys.argv[1:]))
