"""Process entry for ``jobmesh`` and ``python -m jobmesh``.

gevent's monkey-patching happens here, first, before any other import, exactly once
per process (docs/ARCHITECTURE.md, "Greenlets and patching"). No library module patches.
``ssl`` is patched with the rest before anything imports it, so TLS contexts made later
are gevent's and a handshake or read waits only in its own greenlet.
"""

from gevent import monkey

monkey.patch_all()

import sys  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from jobmesh.cli import main as cli_main

    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
