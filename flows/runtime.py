"""Where flows run: the embedded default or a configured Prefect server, and policy events.

Embedded (no ``PREFECT_API_URL``): flows run in this process on Prefect's temporary API,
with ``PREFECT_HOME`` under the state directory (default ``./.dpmerge/prefect``, so a later
``PREFECT_HOME=.dpmerge/prefect prefect server start`` shows the runs) and MLflow on
``.dpmerge/mlflow.db`` with artifacts in ``.dpmerge/mlartifacts``. The environment must be set
before Prefect is imported: call :func:`configure_embedded` first, import flows after.

With a server (``PREFECT_API_URL`` set, e.g. ``eval "$(dpmerge stack env)"``), a policy change
is an event, ``dpmerge.policy.updated`` on resource ``dpmerge.policy.<name>`` with
``Policy.event_payload()`` as payload; the ``merge-on-policy`` deployment's trigger turns it into
a flow run (deployments/prefect.yaml).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpmerge.environment import QUIET, TELEMETRY_OFF, probe
from dpmerge.errors import DPMergeError
from dpmerge.keys import KEY_ENV
from dpmerge.locate import LocalStack, command, embedded_tracking_uri, resolve_home

EVENT = "dpmerge.policy.updated"
EPHEMERAL_SERVER = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
"""Prefect's temporary API migrates a fresh database on start; its default 20 s limit is too
short on a loaded two-core machine (seen in CI: "Timed out while attempting to connect")."""


SECRET_BLOCK_ENV = "DPMERGE_SECRET_BLOCK"


class ServerError(DPMergeError):
    """The configured Prefect server cannot be reached."""


def load_workflow_secret() -> None:
    """Fill ``$DPMERGE_SECRET_KEY`` from the Prefect Secret block named by
    ``$DPMERGE_SECRET_BLOCK`` (e.g. created with ``prefect block create secret``, or
    ``Secret(value=…).save("dpmerge-key")``), unless the key is already set. Flows call this
    first, so every worker that registers or merges candidates uses the same key
    (``dpmerge.keys``, docs/design.md#security)."""
    name = os.environ.get(SECRET_BLOCK_ENV)
    if not name or os.environ.get(KEY_ENV):
        return
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError as error:
        raise ServerError(f"Prefect Secret block {name!r} ({SECRET_BLOCK_ENV}): {error}") from None
    os.environ[KEY_ENV] = str(value)


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


def emit_policy_event(
    payload: dict[str, Any], resource_id: str, name: str, *, url: str | None = None
) -> str:
    """Send ``dpmerge.policy.updated`` for one policy to the server at ``url`` (default
    ``$PREFECT_API_URL``) and wait for the server's acknowledgement; returns the event id."""
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient
    from prefect.utilities.asyncutils import run_coro_as_sync

    url = url or server_url()
    if url is None:
        raise ServerError("PREFECT_API_URL is not set: no server to send the event to")
    check_server(url)
    event = Event(
        event=EVENT,
        resource={"prefect.resource.id": resource_id, "prefect.resource.name": name},
        payload=payload,
    )

    async def send() -> None:
        async with PrefectEventsClient(api_url=url, checkpoint_every=1) as events:
            await events.emit(event)

    try:
        run_coro_as_sync(send())
    except Exception as error:
        raise ServerError(f"sending {EVENT} to {url} failed: {error}") from None
    return str(event.id)


def find_policy_run(event_id: str, prefect_api: Any) -> Any | None:
    """The ``merge-on-policy`` flow run created for ``event_id`` (its ``event_id`` parameter),
    or ``None`` while the trigger has not created it."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.merge import FLOW_NAME

    runs = prefect_api.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        limit=200,
    )
    for run in runs:
        if str(run.parameters.get("event_id")) == event_id:
            return run
    return None


@dataclass(frozen=True)
class PolicyRun:
    """A finished (or last seen) run for a policy event, the outcome document its artifact
    carries (``None`` if it has none) and how long it ran (``None`` until it ended)."""

    id: str | None
    state: str | None
    message: str | None
    outcome: dict[str, Any] | None
    seconds: float | None = None


def wait_for_policy_run(
    event_id: str, timeout_s: float, poll_s: float = 0.5, *, url: str | None = None
) -> PolicyRun:
    """Wait until the run for ``event_id`` reaches a final state; returns it with its outcome
    (or the last seen run; ``id`` ``None`` if none was created in time). ``url`` defaults to
    ``$PREFECT_API_URL``."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.merge import outcome_from_markdown

    url = url or server_url()
    if url is None:
        raise ServerError("PREFECT_API_URL is not set: no server to ask")
    deadline = time.monotonic() + timeout_s
    run = None
    with SyncPrefectClient(url) as prefect_api:
        while time.monotonic() < deadline:
            run = find_policy_run(event_id, prefect_api)
            if run is not None and run.state is not None and run.state.is_final():
                break
            time.sleep(poll_s)
        if run is None:
            return PolicyRun(None, None, "no run created in time", None)
        outcome = None
        if run.state is not None and run.state.is_final():
            artifacts = prefect_api.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
            )
            for artifact in artifacts:
                outcome = outcome_from_markdown(str(artifact.data or "")) or outcome
    state = run.state
    seconds = None
    if run.start_time is not None and run.end_time is not None:
        seconds = (run.end_time - run.start_time).total_seconds()
    return PolicyRun(
        str(run.id),
        state.name if state else None,
        state.message if state else None,
        outcome,
        seconds,
    )
