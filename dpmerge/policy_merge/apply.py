"""The policy state machine: one policy event, from the registered candidates to the alias
(docs/design.md#policies, docs/design.md#workflow).

::

    prepare ──── another policy owns the alias, a record fails verification, a fixed-seed
       │         candidate: refused (an error; nothing changed)
       │     ─── a later event already set the alias ──────────────────────▶ superseded
    calibrate ── no merge meets the target: handle_infeasible ─────────────▶ infeasible
       │                                     (alias revoked or kept; a later event: superseded)
    plan_release ── a ready version of the same release exists: reuse it ──┐
       │        ─── the ledger cap refuses it (nothing merged or drawn) ───┼──▶ not_promoted
    merge (RS: the draw stored for the release) ─▶ register ───────────────┤
                                                                           ▼
    promote ── later event: superseded; ledger cap or a registry gate: not_promoted;
               else promoted (alias moved) or unchanged (it already named this release)

The steps are injectable (:class:`PolicySteps`): by default the library functions; the
``merge-on-policy`` flow passes Prefect tasks that wrap them (retries, logging), and tests can
wrap them to observe or break one. Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dpmerge.errors import InfeasibleTargetError
from dpmerge.policies import Policy
from dpmerge.policy_merge import calibration, preparation, promotion, release
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.policy_merge.outcome import PolicyOutcome, Status
from dpmerge.policy_merge.preparation import Prepared, ReleasePlan, start_export_warmup
from dpmerge.policy_merge.promotion import PromotionResult, Registered, superseded_reason
from dpmerge.policy_merge.release import MergeRequest, Release, merge_request, spend_note
from dpmerge.policy_merge.release_ledger import LedgerEntry, ledger_release
from dpmerge.policy_merge.workspace import Workspace, remove_tree
from dpmerge.registry import RegisteredCandidate

Candidates = Sequence[RegisteredCandidate]


@dataclass(frozen=True)
class PolicySteps:
    """The steps :func:`apply_policy` calls, each with its library function's signature."""

    prepare: Callable[[Workspace, Policy, datetime, Path], Prepared] = preparation.prepare
    calibrate: Callable[[Policy, Candidates, EvaluationData], PolicyPlan] = (
        calibration.calibrate_policy
    )
    handle_infeasible: Callable[
        [Workspace, Policy, CandidatePool, InfeasibleTargetError, datetime], PolicyOutcome
    ] = promotion.handle_infeasible
    plan_release: Callable[[Workspace, MergeRequest, LedgerEntry, Policy], ReleasePlan] = (
        preparation.plan_release
    )
    merge: Callable[
        [Workspace, MergeRequest, Candidates, PolicyPlan, EvaluationData, Path], Release
    ] = release.merge_release
    register: Callable[[Workspace, MergeRequest, Release, dict[str, Any] | None], Registered] = (
        promotion.register_release
    )
    promote: Callable[[Workspace, Policy, Registered, LedgerEntry, datetime], PromotionResult] = (
        promotion.promote_release
    )
    read_card: Callable[[Workspace, str, str], str] = promotion.read_card


LIBRARY_STEPS = PolicySteps()


@dataclass(frozen=True)
class PolicyResult:
    """What applying a policy did, and the privacy card of its release ("" when no release
    was reached: superseded before merging, or infeasible)."""

    outcome: PolicyOutcome
    card: str = ""


def apply_policy(
    policy: Policy,
    workspace: Workspace,
    occurred: datetime | None = None,
    *,
    steps: PolicySteps = LIBRARY_STEPS,
) -> PolicyResult:
    """Apply ``policy`` for an event ordered at ``occurred`` (the server's received time, see
    :func:`~dpmerge.policy_merge.events.order_time`; default now; an older event never moves
    the alias back) in a private scratch directory that is removed afterwards."""
    when = occurred or datetime.now(UTC)
    workdir = workspace.scratch()
    try:
        return _apply(policy, workspace, workdir, when, steps)
    finally:
        remove_tree(workdir)


def _apply(
    policy: Policy, workspace: Workspace, workdir: Path, when: datetime, steps: PolicySteps
) -> PolicyResult:
    # the first torch.export in a process costs seconds (the registry stores pt2 models):
    # warm it up while the candidates and the split are fetched (I/O, no torch.export there),
    # and finish before the CPU-bound calibration and the registration
    warmup = start_export_warmup()
    try:
        prepared = steps.prepare(workspace, policy, when, workdir / "candidates")
    finally:
        warmup.join()
    pool = prepared.pool
    if prepared.superseded_by is not None or prepared.data is None:
        reason = superseded_reason(str(prepared.superseded_by), str(policy.alias))
        superseded = PolicyOutcome.of(
            policy, Status.SUPERSEDED, merged_model=pool.merged_model, reasons=(reason,)
        )
        return PolicyResult(superseded)
    candidates, data = prepared.candidates, prepared.data
    try:
        plan = steps.calibrate(policy, candidates, data)
    except InfeasibleTargetError as error:
        return PolicyResult(steps.handle_infeasible(workspace, policy, pool, error, when))
    request = merge_request(policy, pool, candidates, plan)
    entry = ledger_release(request, candidates, plan)
    planned = steps.plan_release(workspace, request, entry, policy)
    report = plan.calibration.report
    note = spend_note(plan.calibration, policy.target_epsilon)
    release_facts: dict[str, Any] = dict(
        merged_model=pool.merged_model,
        method=plan.method,
        weights=tuple(report.weights),
        epsilon=report.epsilon,
        accountant=report.gating.accountant,
        bound=report.gating.kind,
        candidates=tuple(report.names),
        reachable_epsilon_range=plan.calibration.reachable_epsilon_range,
        compared=plan.compared,
        notes=(note,) if note else (),
    )
    if planned.refused:  # a gate known before merging: nothing is merged, drawn or registered
        refused = PolicyOutcome.of(
            policy, Status.NOT_PROMOTED, reasons=planned.refused, **release_facts
        )
        return PolicyResult(refused)
    registered, metrics = planned.existing, {}
    if registered is None:
        merged = steps.merge(workspace, request, candidates, plan, data, workdir)
        metrics = merged.metrics
        registered = steps.register(workspace, request, merged, planned.ledger)
    promoted = steps.promote(workspace, policy, registered, entry, when)
    outcome = PolicyOutcome.of(
        policy,
        promoted.status,
        **{**release_facts, "merged_model": registered.name},
        version=registered.version,
        previous_version=promoted.previous,
        reused=registered.reused,
        test_accuracy=registered.accuracy,
        validation_accuracy=metrics.get("validation_accuracy"),
        cumulative_epsilon=promoted.cumulative_epsilon,
        reasons=promoted.reasons,
    )
    return PolicyResult(outcome, steps.read_card(workspace, registered.name, registered.version))
