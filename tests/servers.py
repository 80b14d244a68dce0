"""Real servers on loopback for integration tests, started through ``devstack``.

``running_stack(state_dir, prefect=False)`` gives S3 (SeaweedFS), PostgreSQL and an MLflow
server (its auth app; artifacts proxied to ``s3://dpmerge/mlartifacts``); ``prefect=True`` adds
the Prefect server, the ``cpu`` and ``gpu`` process pools and one worker each. Ports are picked
free on 127.0.0.1, so tests never collide with a developer's own stack on the default ports.
Every stack of a test session gets the same generated credentials (:func:`session_secrets`), so
one role's environment (:func:`credentials_env`) works against each of them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import devstack
from devstack import credentials
from dpmerge.vocabulary import StackRole

ROLE_SECRETS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AWS_ACCESS_KEY_ID")
ROLE_SECRETS += ("AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "DPMERGE_MLFLOW_READERS")


@cache
def session_secrets() -> Path:
    """A secrets directory generated once per test session (0700, removed at exit)."""
    home = Path(tempfile.mkdtemp(prefix="dpmerge-test-secrets-"))
    atexit.register(shutil.rmtree, home, True)
    credentials.ensure(home)
    credentials.workflow_key(home)
    return credentials.secrets_dir(home)


def seed_secrets(state_dir: Path) -> None:
    """Give a new stack the session's credentials (an existing stack keeps its own)."""
    target = credentials.secrets_dir(state_dir)
    if not target.exists():
        shutil.copytree(session_secrets(), target)


@contextmanager
def running_stack(
    state_dir: Path, *, prefect: bool, **fields: Any
) -> Iterator[devstack.StackConfig]:
    """Start a stack on free ports and stop it (workers first) on exit, even after a failure."""
    config = devstack.StackConfig.on_free_ports(state_dir, prefect=prefect, **fields)
    seed_secrets(config.state_dir)
    try:
        devstack.up(config)
        yield config
    finally:
        devstack.down(config)


def credentials_env(config: devstack.StackConfig, role: StackRole) -> dict[str, str]:
    """``role``'s credentials without any server address (the same for every session stack)."""
    env = config.client_env(role)
    return {k: v for k, v in env.items() if k in ROLE_SECRETS}


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block and restore the previous values after."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def workflow_prefect(config: devstack.StackConfig) -> Iterator[None]:
    """Prefect's client settings of the workflow role for the block (its API and auth string;
    Prefect reads the environment once, so setting variables later is not enough)."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    auth = config.client_env(StackRole.WORKFLOW)["PREFECT_API_AUTH_STRING"]
    with temporary_settings(
        {PREFECT_API_URL: config.prefect_api_url, PREFECT_API_AUTH_STRING: auth}
    ):
        yield
