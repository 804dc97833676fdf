"""Which store a ``--db`` value opens: a PostgreSQL URL (``postgresql://`` or
``postgres://``) opens a ``PostgresStore``, anything else is an SQLite file.

psycopg is imported only for a PostgreSQL URL (after the process's monkey-patching, so
that it waits green), and a failure to open either store becomes ``CannotOpen`` with a
one-line message, the URL's password left out.
"""

from __future__ import annotations

import re
import sqlite3
import urllib.parse

from jobmesh.store.base import NewerSchema, StorageFault, Store, first_line
from jobmesh.store.sqlite import SQLiteStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


class CannotOpen(Exception):
    """The store could not be opened; the message says why in one line."""


def is_postgres_url(db: str) -> bool:
    return db.lower().startswith(POSTGRES_SCHEMES)


_USER_PASSWORD = re.compile(r"^([a-zA-Z]+://[^:@/]*:)([^@/]*)@")
_PARAMETER_PASSWORD = re.compile(r"([?&]password=)([^&]*)")


def shown(db: str) -> str:
    """``db`` as logs may show it: a URL's password replaced by ``***``."""
    if not is_postgres_url(db):
        return db
    db = _USER_PASSWORD.sub(r"\1***@", db)
    return _PARAMETER_PASSWORD.sub(r"\1***", db)


def scrubbed(text: str, db: str) -> str:
    """``text`` (a driver's message, which may quote the URL it could not parse) without
    the passwords of ``db``."""
    if not is_postgres_url(db):
        return text
    text = text.replace(db, shown(db))
    for pattern in (_USER_PASSWORD, _PARAMETER_PASSWORD):
        for match in pattern.finditer(db):
            password = match.group(2)
            for form in {password, urllib.parse.unquote(password)}:
                if form:
                    text = text.replace(form, "***")
    return text


def open_store(db: str, synchronous: str = "FULL", session_timeout_millis: int | None = None) -> Store:
    """The store ``db`` names; raises ``CannotOpen``. ``synchronous`` is SQLite's;
    ``session_timeout_millis`` PostgreSQL's (``PostgresStore``; None: its default)."""
    if is_postgres_url(db):
        try:
            import psycopg

            from jobmesh.store.postgres import PostgresStore
        except ImportError as exc:
            raise CannotOpen("--db=%s needs the psycopg package: pip install 'jobmesh[postgres]' (%s)"
                             % (shown(db), exc)) from None
        try:
            if session_timeout_millis is None:
                return PostgresStore(db)
            return PostgresStore(db, session_timeout_millis)
        except (psycopg.Error, StorageFault, NewerSchema) as exc:
            raise CannotOpen("cannot open the database %s: %s"
                             % (shown(db), scrubbed(first_line(_cause(exc)), db))) from None
    try:
        return SQLiteStore(db, synchronous)
    except (sqlite3.Error, StorageFault, NewerSchema) as exc:
        raise CannotOpen("cannot open the database %s: %s" % (db, first_line(_cause(exc)))) from None


def _cause(exc: BaseException) -> BaseException:
    """A storage fault's driver exception (its words name the problem), else ``exc``."""
    return exc.__cause__ if isinstance(exc, StorageFault) and exc.__cause__ is not None else exc
