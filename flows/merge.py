"""``merge-on-policy``: a policy changed → load candidates, calibrate, merge, evaluate,
register, promote (or revoke per ``on_infeasible``). No training. The state machine is the
library's ``dpmerge.policy_merge.apply_policy``; this flow runs its steps as Prefect tasks
(``tasks.policy.STEPS``) and turns the outcome into the run's state (docs/workflow.md#outcomes).

Triggered by the event ``dpmerge.policy.updated`` (deployments/prefect.yaml): the whole event
payload is one parameter, ``payload``, validated here, so every event ends as a run — applied,
or ``Rejected`` with one line saying why (a missing or extra key, a string or boolean where a
number belongs, an unknown dataset, an alias another policy owns, an event dated in the future
beyond the clock-skew allowance). Alias changes are ordered by the server's received time,
never the sender's (docs/design.md#security). Also called in-process by ``dpmerge policy
set|apply`` when no Prefect server is configured.

Final states: the state *type* says whether the run worked, its *name* which outcome it
reached (Prefect emits ``prefect.flow-run.<name>``, which automations can match):

| outcome | state | ``dpmerge policy`` exit |
|---|---|---|
| promoted | Completed | 0 |
| unchanged | Completed, named ``Unchanged`` | 0 |
| infeasible | Completed, named ``Infeasible`` (alias revoked or kept) | 3 |
| not promoted | Completed, named ``NotPromoted`` (registered, a gate failed) | 4 |
| superseded | Cancelled, named ``Superseded`` (a later event for the policy) | 5 |
| rejected | Failed, named ``Rejected`` (bad event, nothing read) | 2 |

A traceback (a plain ``Failed``) means a bug or an outage. Every outcome also becomes the
Markdown artifact ``policy-<name>`` with the outcome's JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.schemas.objects import State
from prefect.runtime import deployment as current_deployment
from prefect.runtime import flow_run as current_run
from prefect.states import Cancelled, Completed, Failed

from dpmerge import policy_merge as pm
from dpmerge.documents import cut
from dpmerge.errors import InputError
from dpmerge.policies import Policy, PolicyError, check_registered, policy_from_dict
from dpmerge.policy_merge import PolicyOutcome, Status
from dpmerge.registry.catalog import open_catalog
from dpmerge.registry.errors import AliasOwnershipError
from flows import policy_runs
from flows.runtime import load_workflow_secret
from tasks import policy as steps

FLOW_NAME = "merge-on-policy"
DEPLOYMENT = f"{FLOW_NAME}/{FLOW_NAME}"
REJECTED = "Rejected"
STATES: dict[Status, tuple[Any, str]] = {
    Status.PROMOTED: (Completed, "Completed"),
    Status.UNCHANGED: (Completed, "Unchanged"),
    Status.INFEASIBLE: (Completed, "Infeasible"),
    Status.NOT_PROMOTED: (Completed, "NotPromoted"),
    Status.SUPERSEDED: (Cancelled, "Superseded"),
}
"""Each outcome's final state: its type and name (see the module docstring)."""
STATUS_OF_STATE = {name: status.value for status, (_, name) in STATES.items()} | {
    REJECTED: "rejected"
}
"""The outcome a final state's name stands for (a run without its artifact)."""
OUTCOME_JSON = re.compile(r"```json\n(.*?)\n```", re.DOTALL)


def run_name() -> str:
    """``policy-eu ε*=2``: the policy and its target, from the payload (``?`` where the
    payload lacks them: the run will be rejected)."""
    payload = current_run.parameters.get("payload")
    payload = payload if isinstance(payload, dict) else {}
    name, target = payload.get("name"), payload.get("target_epsilon")
    text = f"policy-{name if isinstance(name, str) and name else '?'}"
    if isinstance(target, float | int) and not isinstance(target, bool) and math.isfinite(target):
        text += f" ε*={target:g}"
    return cut(text, 80)


def policy_for_event(payload: Any, resource_id: str | None) -> Policy:
    """The event's policy; :class:`PolicyError` for a payload that is not a valid policy or
    whose name does not match the event's resource."""
    if not isinstance(payload, dict):
        raise PolicyError(f"the event payload must be a mapping, got {type(payload).__name__}")
    policy = policy_from_dict(payload)
    if resource_id and resource_id != policy.resource_id:
        raise PolicyError(
            f"event resource {cut(resource_id, 80)!r} does not match policy {policy.name!r} "
            f"(expected {policy.resource_id!r})"
        )
    return policy


def _artifact(key_name: str, title: str, lines: list[str], document: dict[str, Any]) -> None:
    key = re.sub(r"[^a-z0-9-]", "-", f"policy-{key_name}".lower())[:100]
    body = [*lines, "", "```json", json.dumps(document, indent=2, default=str), "```"]
    create_markdown_artifact(markdown="\n".join(body), key=key, description=title)


def outcome_from_markdown(markdown: str) -> dict[str, Any] | None:
    """The outcome document an artifact of this flow carries, its last JSON block (``None`` if
    none)."""
    found = OUTCOME_JSON.findall(markdown or "")
    return json.loads(found[-1]) if found else None


def _finish(outcome: PolicyOutcome, card: str = "") -> State:
    """The run's final state for ``outcome``, with its artifact."""
    summary = outcome.summary()
    lines = [f"# Policy `{outcome.policy}`: {outcome.status.value}", "", summary, ""]
    if card:
        lines += ["---", "", card]
    document = outcome.to_dict()
    _artifact(outcome.policy, f"dpmerge policy {outcome.policy}: {outcome.status}", lines, document)
    make, name = STATES[outcome.status]
    logger = get_run_logger()
    (logger.info if outcome.status in (Status.PROMOTED, Status.UNCHANGED) else logger.warning)(
        summary
    )
    return make(name=name, message=summary, data=document)


def _rejected(payload: Any, error: InputError) -> State:
    name = payload.get("name") if isinstance(payload, dict) else None
    key = name if isinstance(name, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", name) else "?"
    message = f"event rejected: {error}"
    document = {"status": "rejected", "policy": key, "reasons": [str(error)]}
    _artifact(
        key if key != "?" else "rejected", "dpmerge policy event rejected", [message], document
    )
    get_run_logger().error(message)
    return Failed(name=REJECTED, message=message, data=document)


def _superseded(policy: Policy, later: str) -> State:
    reason = f"a later event for policy {policy.name} ({later}) is pending or applied"
    return _finish(PolicyOutcome.of(policy, Status.SUPERSEDED, reasons=(reason, "nothing changed")))


@flow(name=FLOW_NAME, flow_run_name=run_name, persist_result=False)
def merge_on_policy(
    payload: dict[str, Any],
    resource_id: str | None = None,
    event_id: str | None = None,
    occurred: str | None = None,
    received: str | None = None,
) -> State:
    """Apply the policy ``payload`` (the fields of :class:`dpmerge.policies.Policy`).
    ``resource_id``, ``event_id``, ``occurred`` (the sender's time) and ``received`` (the
    server's) come from the triggering event: the resource must name this policy, ``received``
    orders events (an older one never moves the alias back), and an ``occurred`` later than
    ``received`` by more than the clock-skew allowance is rejected."""
    try:
        policy = policy_for_event(payload, resource_id)
        when = pm.order_time(occurred, received)
    except InputError as error:
        return _rejected(payload, error)
    except (ValueError, TypeError):
        return _rejected(
            payload, PolicyError(f"event time {cut(str(occurred), 60)!r} is not a time")
        )
    load_workflow_secret()
    workspace = pm.Workspace.from_env()
    try:
        check_registered([policy], open_catalog(workspace.tracking_uri).inventory())
    except PolicyError as error:
        return _rejected(payload, error)
    get_run_logger().info(
        "policy %s (event %s at %s): target (%g, %g), method %s, gate %s; registry %s",
        policy.name,
        event_id or "-",
        when.isoformat(),
        policy.target_epsilon,
        policy.target_delta,
        policy.method,
        policy.gating_bound,
        workspace.tracking_uri,
    )
    deployment_id = current_deployment.id
    if deployment_id is None:  # in-process: no other runs to coalesce with or wait for
        return _apply(policy, workspace, when)
    later = policy_runs.later_event(deployment_id, current_run.id, policy.name, when)
    if later is not None:
        return _superseded(policy, later)
    with policy_runs.policy_lock(policy.name):
        later = policy_runs.later_event(deployment_id, current_run.id, policy.name, when)
        if later is not None:
            return _superseded(policy, later)
        return _apply(policy, workspace, when)


def _apply(policy: Policy, workspace: pm.Workspace, when: Any) -> State:
    workspace.use_caches()
    try:
        applied = pm.apply_policy(policy, workspace, when, steps=steps.STEPS)
    except AliasOwnershipError as error:  # bad input, found before anything is read or changed
        return _rejected({"name": policy.name}, error)
    return _finish(applied.outcome, applied.card)
