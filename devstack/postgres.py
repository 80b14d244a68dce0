"""The stack's PostgreSQL: a cluster of its own in ``STATE/postgres`` (Debian's server binaries),
one database and one role per service (docs/stack.md#postgresql).

``initdb`` runs at the first ``up`` (superuser ``postgres``, scram-sha-256 for every connection,
the generated password from ``STATE/secrets``); the server listens on 127.0.0.1 only and has no
Unix socket. PostgreSQL refuses to run as root, so as root both run inside a user namespace
(``unshare --user``, uid 1000 inside mapped to root outside: the files stay root's, in the state
directory, and nothing else changes); ``unshare`` execs the server, so supervisord signals
PostgreSQL itself. Its stop signal is SIGINT (fast shutdown).

After the server answers, :func:`bootstrap` creates the roles ``mlflow`` and ``prefect`` and the
databases ``mlflow`` (the tracking and registry store), ``mlflow_auth`` (MLflow's auth app) and
``prefect``, each owned by its role (idempotent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql

from devstack.config import LOOPBACK, StackConfig, StackError
from devstack.credentials import Credentials, secrets_dir, write_private

SUPERUSER = "postgres"
DATABASES = {"mlflow": "mlflow", "mlflow_auth": "mlflow", "prefect": "prefect"}
"""database -> owning role"""
NAMESPACE_UID = "1000"
CONNECT_TIMEOUT_S = 5


def binaries() -> Path:
    """The newest installed PostgreSQL's ``bin`` directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3])
    )
    if not found:
        raise StackError(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres): run "
            "scripts/setup.sh (apt-get install postgresql), or use `--database sqlite`"
        )
    return found[-1].parent


def as_server_user(argv: list[str]) -> list[str]:
    """``argv`` as PostgreSQL accepts it: directly, or as root inside a user namespace."""
    if os.geteuid() != 0:
        return argv
    unshare = shutil.which("unshare")
    if unshare is None:
        raise StackError(
            "PostgreSQL refuses to run as root and `unshare` (util-linux) is not installed to "
            "run it in a user namespace: install util-linux, run the stack as another user, or "
            "use `--database sqlite`"
        )
    namespace = f"--map-user={NAMESPACE_UID}", f"--map-group={NAMESPACE_UID}"
    return [unshare, "--user", *namespace, *argv]


def server_argv(config: StackConfig) -> list[str]:
    return as_server_user(
        [
            str(binaries() / "postgres"),
            *("-D", str(config.postgres_dir)),
            *("-h", LOOPBACK, "-p", str(config.postgres_port)),
            *("-c", "unix_socket_directories="),
            *("-c", "max_connections=200"),
        ]
    )


def initdb(config: StackConfig, credentials: Credentials) -> None:
    """Create the cluster on the first ``up`` (a cluster already there is kept)."""
    if (config.postgres_dir / "PG_VERSION").is_file():
        return
    config.postgres_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    password_file = secrets_dir(config.state_dir) / "initdb.pw"
    write_private(password_file, credentials.postgres_superuser)
    try:
        done = subprocess.run(
            as_server_user(
                [
                    str(binaries() / "initdb"),
                    *("-D", str(config.postgres_dir)),
                    *("-U", SUPERUSER, "--pwfile", str(password_file)),
                    *("--auth", "scram-sha-256", "-E", "UTF8", "--no-locale"),
                ]
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        password_file.unlink(missing_ok=True)
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise StackError(f"initdb {config.postgres_dir} failed: {last[0]}")


def url(config: StackConfig, role: str, password: str, database: str, driver: str) -> str:
    return f"postgresql+{driver}://{role}:{password}@{LOOPBACK}:{config.postgres_port}/{database}"


@contextmanager
def _connect(
    config: StackConfig, password: str, database: str = SUPERUSER
) -> Iterator[psycopg.Connection]:
    """A superuser connection; PostgreSQL's errors become :class:`StackError` (one line)."""
    try:
        with psycopg.connect(
            host=LOOPBACK,
            port=config.postgres_port,
            user=SUPERUSER,
            password=password,
            dbname=database,
            connect_timeout=CONNECT_TIMEOUT_S,
            autocommit=True,
        ) as connection:
            yield connection
    except psycopg.Error as error:
        reason = " ".join(f"{error}".splitlines())  # one line, never classified
        raise StackError(
            f"PostgreSQL at {LOOPBACK}:{config.postgres_port} ({database}): {reason}"
        ) from None


def ready(config: StackConfig, credentials: Credentials) -> bool:
    try:
        with _connect(config, credentials.postgres_superuser) as connection:
            connection.execute("SELECT 1")
    except StackError:
        return False
    return True


def bootstrap(config: StackConfig, credentials: Credentials) -> None:
    """Create the services' roles and databases, each role with its generated password."""
    with _connect(config, credentials.postgres_superuser) as connection:
        for role, password in credentials.database.items():
            exists = connection.execute(
                "SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)
            ).fetchone()
            verb = "ALTER" if exists else "CREATE"
            connection.execute(
                sql.SQL(verb + " ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(password)
                )
            )
        for database, owner in DATABASES.items():
            if not connection.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
            ).fetchone():
                connection.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(database), sql.Identifier(owner)
                    )
                )
            connection.execute(
                sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(database))
            )


def has_registry(config: StackConfig, credentials: Credentials) -> bool:
    """Whether MLflow's database holds a registry (its migrations ran)."""
    with _connect(config, credentials.postgres_superuser, "mlflow") as connection:
        found = connection.execute(
            "SELECT 1 FROM information_schema.tables WHERE table_name = 'alembic_version'"
        ).fetchone()
    return found is not None
