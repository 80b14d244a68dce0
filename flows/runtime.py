"""Where flows run: the embedded default or a configured Prefect server.

Embedded (no ``PREFECT_API_URL``): flows run in this process on Prefect's temporary API,
with ``PREFECT_HOME`` under the state directory (default ``./.dpmerge/prefect``, so a later
``PREFECT_HOME=.dpmerge/prefect prefect server start`` shows the runs) and MLflow on
``.dpmerge/mlflow.db`` with artifacts in ``.dpmerge/mlartifacts``. The environment must be set
before Prefect is imported: call :func:`configure_embedded` first, import flows after.

With a stack (its release-state store in S3), a policy change is a stored policy version that
the dispatcher turns into a flow run of the ``merge-on-policy`` deployment
(``flows/dispatch.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from dpmerge.environment import QUIET, TELEMETRY_OFF, probe
from dpmerge.errors import OutageError
from dpmerge.locate import LocalStack, command, embedded_tracking_uri, resolve_home

EPHEMERAL_SERVER = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
"""Prefect's temporary API migrates a fresh database on start; its default 20 s limit is too
short on a loaded two-core machine (seen in CI: "Timed out while attempting to connect")."""


class ServerError(OutageError):
    """The configured Prefect server cannot be reached."""


def server_url() -> str | None:
    return os.environ.get("PREFECT_API_URL") or None


def adopt_running_stack() -> LocalStack | None:
    """With neither ``PREFECT_API_URL`` nor ``MLFLOW_TRACKING_URI`` set, point this process at
    a running local stack (its ``stack.json``): its client environment (Prefect, MLflow, S3) is
    set in ``os.environ`` and the stack returned; otherwise nothing changes (``None``)."""
    if server_url() or os.environ.get("MLFLOW_TRACKING_URI"):
        return None
    found = LocalStack.find()
    if found is None or not found.running or found.prefect_api_url is None:
        return None
    from devstack import StackConfig  # the stack's own account of its client settings

    config = StackConfig.load(found.state_dir)
    if config is None:
        return None
    os.environ.update(config.client_env())
    return found


def configure_embedded(home: str | Path | None = None, *, force: bool = False) -> dict[str, str]:
    """Set the embedded defaults in ``os.environ`` (before Prefect or MLflow are imported) and
    return what was set. Existing settings win unless ``force`` (the demo: everything under
    ``home``, whatever the shell says)."""
    home_path = resolve_home(home)
    home_path.mkdir(parents=True, exist_ok=True)
    wanted = {
        "DPMERGE_HOME": str(home_path),
        "MLFLOW_TRACKING_URI": embedded_tracking_uri(home_path),
        "PREFECT_HOME": str(home_path / "prefect"),
        **TELEMETRY_OFF,
        **QUIET,
        **EPHEMERAL_SERVER,
    }
    if force:
        for key in ("PREFECT_API_URL", "DPMERGE_S3_ENDPOINT_URL", "DPMERGE_S3_BUCKET"):
            os.environ.pop(key, None)
    applied = {}
    for key, value in wanted.items():
        if force or key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def check_server(url: str, timeout_s: float = 5.0) -> None:
    health = probe(f"{url.rstrip('/')}/health", timeout_s=timeout_s)
    if health.status is None:
        raise ServerError(
            f"Prefect server {url} unreachable ({health.error}); start it "
            f"(`{command('stack', 'up')}`) or unset PREFECT_API_URL to run in-process"
        )
    if health.body is not True:
        raise ServerError(f"Prefect server {url} is not healthy (health: {health.body!r})")
