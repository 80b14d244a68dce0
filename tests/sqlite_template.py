"""One MLflow migration per test process for the many embedded registries the suite creates.

MLflow builds a new SQLite database by creating its first tables and running every Alembic
migration after them: about a second of CPU, and the suite creates well over a hundred embedded
registries (a fresh ``mlflow.db`` per test). :func:`install` keeps the product's code path — the
tracking and registry stores still find an empty database and call MLflow's
``_initialize_tables`` — but that call, for a SQLite file, copies a template into it with
SQLite's backup API. The template is MLflow's own migration, run once in this process on an
in-memory database (no file to lose), so every database gets the same tables, indexes and
Alembic version; the rows that depend on the database's place (the default experiment and its
artifact location) are written afterwards by the store, as for any new database. Databases of
other dialects (the stacks' PostgreSQL) migrate as before, and so does every registry a
subprocess creates (``dpmerge demo``, the CLI tests): the full path stays covered.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

_LOCK = threading.Lock()
_TEMPLATE: list[sqlite3.Connection] = []


def install() -> None:
    """Route MLflow's table creation for SQLite files through the template (idempotent)."""
    import mlflow.store.db.utils as db_utils
    import mlflow.store.model_registry.sqlalchemy_store as registry_store

    original = getattr(db_utils._initialize_tables, "__wrapped__", db_utils._initialize_tables)

    def initialize(engine: Any) -> None:
        if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
            original(engine)
            return
        raw = engine.raw_connection()
        try:
            with _LOCK:
                _template(original).backup(raw.driver_connection)
        finally:
            raw.close()

    initialize.__wrapped__ = original  # type: ignore[attr-defined]
    db_utils._initialize_tables = initialize
    registry_store._initialize_tables = initialize  # imported by name there


def _template(original: Any) -> sqlite3.Connection:
    """The migrated template of this process, made by MLflow on first use; the caller holds
    the lock."""
    if not _TEMPLATE:
        import sqlalchemy
        from sqlalchemy.pool import StaticPool

        engine = sqlalchemy.create_engine("sqlite://", poolclass=StaticPool)  # one connection
        try:
            original(engine)
            memory = sqlite3.connect(":memory:", check_same_thread=False)
            raw = engine.raw_connection()
            try:
                raw.driver_connection.backup(memory)
            finally:
                raw.close()
        finally:
            engine.dispose()
        _TEMPLATE.append(memory)
    return _TEMPLATE[0]
