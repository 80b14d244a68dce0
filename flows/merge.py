"""``merge-on-policy``: a policy changed → load candidates, calibrate, merge, evaluate,
register, promote (or revoke per ``on_infeasible``). No training. The state machine is the
library's ``dpmerge.policy_merge.apply_policy``; this flow runs its steps as Prefect tasks
(``tasks.policy.STEPS``) and turns the outcome into the run's state.

Triggered by the event ``dpmerge.policy.updated`` (deployments/prefect.yaml: one parameter per
``Policy.event_payload()`` key, plus the event's resource id, id, the sender's time and the
server's received time), or called in-process by ``dpmerge policy set|apply`` when no Prefect
server is configured. Alias changes are ordered by the received time; an event dated in the
future beyond the clock-skew allowance is refused (docs/design.md#security).

Outcomes. ``promoted`` / ``unchanged`` (the alias already named this release): the run
completes. ``superseded`` (a later policy event already set the alias): completes, touching
nothing. ``not_promoted`` (a gate failed: ε, δ, accuracy, ledger cap): the version stays
registered without the alias and the run **fails** with the reasons. ``infeasible``: nothing is
registered, the alias is revoked (or kept, ``on_infeasible: keep``) and the run **fails** with
the reachable ε range. A bad policy (e.g. a negative target) fails before anything is read.
"""

from __future__ import annotations

import re
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from dpmerge import policy_merge as pm
from dpmerge.policies import Policy, PolicyError, policy_from_dict
from dpmerge.policy_merge import Status
from flows.runtime import load_workflow_secret
from tasks import policy as steps

FLOW_NAME = "merge-on-policy"
DEPLOYMENT = f"{FLOW_NAME}/cpu"


def _policy(fields: dict[str, Any], resource_id: str | None) -> Policy:
    policy = policy_from_dict(fields)
    if resource_id and resource_id != policy.resource_id:
        raise PolicyError(
            f"event resource {resource_id!r} does not match policy {policy.name!r} "
            f"(expected {policy.resource_id!r})"
        )
    return policy


def _summary(outcome: pm.PolicyOutcome, card: str) -> str:
    lines = [
        f"# Policy `{outcome.policy}`: {outcome.status}",
        "",
        f"Target (ε*, δ*) = ({outcome.target_epsilon:g}, {outcome.target_delta:g}); "
        f"alias `{outcome.alias}`.",
        "",
    ]
    if outcome.version:
        lines += [
            f"Release: `{outcome.merged_model}` v{outcome.version} "
            f"({'reused' if outcome.reused else 'new'}), method {outcome.method}, "
            f"ε = {outcome.epsilon} ({outcome.accountant}, {outcome.bound} bound), "
            f"test accuracy {outcome.test_accuracy}.",
            "",
        ]
    if outcome.reasons:
        lines += ["Reasons:", "", *(f"- {r}" for r in outcome.reasons), ""]
    if card:
        lines += ["---", "", card]
    return "\n".join(lines)


def _artifact(outcome: pm.PolicyOutcome, card: str) -> None:
    key = re.sub(r"[^a-z0-9-]", "-", f"policy-{outcome.policy}".lower())
    create_markdown_artifact(
        markdown=_summary(outcome, card),
        key=key,
        description=f"dpmerge policy {outcome.policy}: {outcome.status}",
    )


@flow(name=FLOW_NAME, flow_run_name="policy-{name}", persist_result=False)
def merge_on_policy(
    name: str,
    target_epsilon: float,
    target_delta: float,
    dataset: str,
    model: str,
    method: str = "auto",
    gating_bound: str = "generic",
    min_accuracy: float = 0.0,
    alias: str | None = None,
    on_infeasible: str = "revoke",
    cumulative_epsilon_cap: float | None = None,
    resource_id: str | None = None,
    event_id: str | None = None,
    occurred: str | None = None,
    received: str | None = None,
) -> dict[str, Any]:
    """Apply one policy (the fields of :class:`dpmerge.policies.Policy`). ``resource_id``,
    ``event_id``, ``occurred`` (the sender's time) and ``received`` (the server's) come from the
    triggering event: the resource must name this policy, ``received`` orders events (an older
    one never moves the alias back), and an ``occurred`` later than ``received`` by more than
    the clock-skew allowance is refused."""
    logger = get_run_logger()
    load_workflow_secret()
    policy = _policy(
        {
            "name": name,
            "target_epsilon": target_epsilon,
            "target_delta": target_delta,
            "dataset": dataset,
            "model": model,
            "method": method,
            "gating_bound": gating_bound,
            "min_accuracy": min_accuracy,
            "alias": alias,
            "on_infeasible": on_infeasible,
            "cumulative_epsilon_cap": cumulative_epsilon_cap,
        },
        resource_id,
    )
    when = pm.order_time(occurred, received)
    workspace = pm.Workspace.from_env()
    workspace.use_caches()
    logger.info(
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
    applied = pm.apply_policy(policy, workspace, when, steps=steps.STEPS)
    outcome = applied.outcome
    _artifact(outcome, applied.card)
    result = outcome.to_dict()
    if outcome.status == Status.INFEASIBLE:
        raise pm.PolicyInfeasibleError(
            f"policy {policy.name!r}: " + "; ".join(outcome.reasons), result
        )
    if outcome.status == Status.NOT_PROMOTED:
        raise pm.PolicyNotMetError(
            f"policy {policy.name!r}: {outcome.merged_model} v{outcome.version} registered but "
            "not promoted: " + "; ".join(outcome.reasons),
            result,
        )
    return result
