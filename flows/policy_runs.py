"""Policy runs side by side: one policy at a time, different policies in parallel, and a run
whose policy already has a later event waiting or applied ends at once as ``Superseded``
(docs/workflow.md#throughput).

* **Per-policy lock**: a Prefect global concurrency limit ``dpmerge-policy-<name>`` of 1 slot,
  created on first use. Runs of different policies never wait for each other; two runs of one
  policy never overlap (the alias's check-then-move and the ledger's read-modify-write stay
  serialised per policy).
* **Coalescing**: before taking the lock, and again once it holds it, a run looks for a run of
  the same deployment for the same policy with a *later* event time that is scheduled, running
  or completed (not rejected, failed or itself superseded). If there is one, its own event is
  stale: it changes nothing. The registry's event-time tag remains the guarantee (an older
  event never moves the alias back); this only skips the work early.

Only for deployed runs: an in-process run (``dpmerge policy set`` without a server) has no
deployment and takes neither step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from dpmerge.errors import DPMergeError
from dpmerge.policies import policy_from_dict
from dpmerge.policy_merge import parse_time

LOCK_PREFIX = "dpmerge-policy-"
LOCK_TIMEOUT_S = 900.0
RECENT_RUNS = 200
CLOCK_MARGIN = timedelta(minutes=10)
"""A later event's run was created after that event, so after ours: only runs expected to
start after our event time (less a margin for the sender's clock) are read."""
LIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.COMPLETED]


def lock_name(policy: str) -> str:
    return f"{LOCK_PREFIX}{policy}"


@contextmanager
def policy_lock(policy: str) -> Iterator[None]:
    """Hold the policy's one slot for the block (see the module docstring)."""
    name = lock_name(policy)
    with get_client(sync_client=True) as prefect_api:
        try:
            prefect_api.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:  # create it; two runs may race to, one wins
            with suppress(ObjectAlreadyExists):
                prefect_api.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )
    with concurrency(name, occupy=1, timeout_seconds=LOCK_TIMEOUT_S, strict=True):
        yield


def later_event(
    deployment_id: Any, flow_run_id: Any, policy: str, occurred: datetime
) -> str | None:
    """The event time of a live run of this deployment for ``policy`` whose event is later
    than ``occurred`` (its own run excluded), else ``None``."""
    with get_client(sync_client=True) as prefect_api:
        runs = prefect_api.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=LIVE_STATES)),
                expected_start_time=FlowRunFilterExpectedStartTime(after_=occurred - CLOCK_MARGIN),
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=RECENT_RUNS,
        )
    latest = None
    for run in runs:
        if str(run.id) == str(flow_run_id):
            continue
        when = _event_time(run.parameters, policy)
        if when is not None and when > occurred and (latest is None or when > latest):
            latest = when
    return latest.isoformat() if latest is not None else None


def _event_time(parameters: dict[str, Any], policy: str) -> datetime | None:
    """The event time of a run's parameters when they are a valid event for ``policy``: the
    server's received time (the sender's time only for events sent without one)."""
    stamp = parameters.get("received") or parameters.get("occurred")
    if not stamp:
        return None
    try:
        if policy_from_dict(parameters.get("payload") or {}).name != policy:
            return None
        return parse_time(stamp)
    except (DPMergeError, ValueError, TypeError):
        return None
