"""The stack's secrets: generated at the first ``up``, kept 0600 in ``STATE/secrets/`` (a 0700
directory), never printed except by ``dpmerge stack env`` (docs/stack.md#roles-and-permissions).

One JSON file holds every password and key: PostgreSQL's superuser and the database roles, the
MLflow auth app's admin and one MLflow user per :class:`~dpmerge.vocabulary.StackRole`, one S3
identity for the stack itself (``admin``), the MLflow server's artifact proxy (``mlflow``), the
workflow and the operator (a consumer has none), and the Prefect API's auth string. The
workflow's HMAC key (``dpmerge.keys``) is a file of its own beside it, which the workflow's
processes read (``$DPMERGE_SECRET_KEY_FILE``); ``stack env`` prints its path, never the key.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from devstack.config import StackError
from dpmerge.vocabulary import StackRole

SECRETS_DIR = "secrets"
CREDENTIALS_FILE = "credentials.json"
KEY_FILE = "workflow.key"
DATABASE_ROLES = ("mlflow", "prefect")
S3_IDENTITIES = ("admin", "mlflow", StackRole.WORKFLOW.value, StackRole.OPERATOR.value)
MLFLOW_ADMIN = "admin"


@dataclass(frozen=True)
class S3Key:
    access_key_id: str
    secret_access_key: str


@dataclass(frozen=True)
class Credentials:
    """Every secret of one stack."""

    postgres_superuser: str
    database: dict[str, str]  # database role -> password
    mlflow_admin: str
    mlflow_session: str  # the auth app's Flask secret (sessions, CSRF)
    mlflow_users: dict[str, str]  # StackRole value -> password
    s3: dict[str, S3Key]  # identity -> key
    prefect_auth: str

    @classmethod
    def generate(cls) -> Credentials:
        return cls(
            postgres_superuser=_token(),
            database={role: _token() for role in DATABASE_ROLES},
            mlflow_admin=_token(),
            mlflow_session=secrets.token_hex(32),
            mlflow_users={role.value: _token() for role in StackRole},
            s3={
                name: S3Key(f"{name}-{secrets.token_hex(8)}", secrets.token_urlsafe(30))
                for name in S3_IDENTITIES
            },
            prefect_auth=f"workflow:{_token()}",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Credentials:
        return cls(
            postgres_superuser=str(data["postgres_superuser"]),
            database={str(k): str(v) for k, v in data["database"].items()},
            mlflow_admin=str(data["mlflow_admin"]),
            mlflow_session=str(data["mlflow_session"]),
            mlflow_users={str(k): str(v) for k, v in data["mlflow_users"].items()},
            s3={str(k): S3Key(**v) for k, v in data["s3"].items()},
            prefect_auth=str(data["prefect_auth"]),
        )


def _token() -> str:
    return secrets.token_urlsafe(24)


def secrets_dir(state_dir: Path) -> Path:
    return state_dir / SECRETS_DIR


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600, never wider in between)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as sink:
        sink.write(text)
    temporary.replace(path)


def load(state_dir: Path) -> Credentials | None:
    """The stack's credentials, or None before its first ``up``."""
    path = secrets_dir(state_dir) / CREDENTIALS_FILE
    if not path.is_file():
        return None
    if path.stat().st_mode & 0o077:
        raise StackError(f"{path} is readable by others; chmod 600 it (it holds the stack's keys)")
    try:
        return Credentials.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise StackError(f"{path} is not the stack's credentials ({error})") from None


def require(state_dir: Path) -> Credentials:
    found = load(state_dir)
    if found is None:
        raise StackError(
            f"no stack credentials in {secrets_dir(state_dir)}: start the stack first "
            "(`dpmerge stack up`)"
        )
    return found


def ensure(state_dir: Path) -> Credentials:
    """The stack's credentials, generated and saved on the first call."""
    found = load(state_dir)
    if found is not None:
        return found
    created = Credentials.generate()
    write_private(
        secrets_dir(state_dir) / CREDENTIALS_FILE, json.dumps(asdict(created), indent=2) + "\n"
    )
    return created


def workflow_key_file(state_dir: Path) -> Path:
    """The file of the workflow's key: ``STATE/secrets/workflow.key`` (0600)."""
    return secrets_dir(state_dir) / KEY_FILE


def workflow_key(state_dir: Path) -> str:
    """The workflow's HMAC key (64 hex digits), generated on first use."""
    path = workflow_key_file(state_dir)
    if not path.is_file():
        write_private(path, secrets.token_hex(32) + "\n")
    return path.read_text().strip()
