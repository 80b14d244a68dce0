"""Tasks of the policy merge: one per step of ``dpmerge.policy_merge``, each with its library
function's signature, so that :data:`STEPS` runs ``dpmerge.policy_merge.apply_policy`` as
Prefect tasks.

Nothing here logs or returns the RS draw: :func:`merge` hands on a
:class:`~dpmerge.policy_merge.Release` (public facts only); the draw is stored for its release
in the access-restricted audit record, before it is used. Nothing here logs a candidate's
accuracy (beside the release's it would name an RS draw, docs/design.md#rs-secrecy).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prefect import get_run_logger, task

from dpmerge import policy_merge as pm
from dpmerge.errors import InfeasibleTargetError
from dpmerge.formatting import epsilon_text, number_text
from dpmerge.policies import Policy
from dpmerge.policy_merge import Status
from dpmerge.registry import RegisteredCandidate
from dpmerge.state import CountedRelease
from dpmerge.state.policies import PolicyVersion
from tasks.common import LOCAL, REMOTE


@task(name="find-candidates", **REMOTE)
def find_candidates(workspace: pm.Workspace, dataset: str, model: str) -> pm.CandidatePool:
    pool = pm.find_candidates(workspace.registry(), dataset, model, workspace.state())
    get_run_logger().info(
        "%d ready candidates in %s (versions %s)",
        len(pool.versions),
        pool.registered_model,
        ", ".join(pool.versions),
    )
    return pool


@task(name="prepare", **REMOTE)
def prepare(workspace: pm.Workspace, version: PolicyVersion, dest: Path) -> pm.Prepared:
    """Find and load the candidates and the evaluation split (or stop: superseded)."""
    prepared = pm.prepare(workspace, version, dest)
    logger = get_run_logger()
    pool = prepared.pool
    if prepared.superseded_by is not None:
        logger.warning(
            "version %d of policy %s exists: version %d changes nothing",
            prepared.superseded_by,
            version.name,
            version.version,
        )
    else:
        logger.info(
            "%d ready candidates in %s (versions %s); %d validation and %d test rows",
            len(pool.versions),
            pool.registered_model,
            ", ".join(pool.versions),
            len(prepared.data.validation) if prepared.data else 0,
            len(prepared.data.test) if prepared.data else 0,
        )
    return prepared


@task(name="plan-release", **REMOTE)
def plan_release(
    workspace: pm.Workspace, request: pm.MergeRequest, entry: CountedRelease, policy: Policy
) -> pm.ReleasePlan:
    """An existing, signed version of this release (reused, no new merge or draw), else the
    ledger bound for the new release's card (or the cap's refusal, before any merge)."""
    planned = pm.plan_release(workspace, request, entry, policy)
    if planned.existing is not None:
        get_run_logger().info(
            "release %s already registered as %s v%s: reusing it (no new merge)",
            request.content_hash[:12],
            planned.existing.name,
            planned.existing.version,
        )
    if planned.refused:
        get_run_logger().warning("not merged: %s", "; ".join(planned.refused))
    return planned


@task(name="load-candidates", **REMOTE)
def load_candidates(
    workspace: pm.Workspace, pool: pm.CandidatePool, dest: str
) -> list[RegisteredCandidate]:
    return pm.load_candidates(
        workspace.registry(),
        pool,
        Path(dest) / "candidates",
        cache_dir=workspace.cache_dir / "candidates",
    )


@task(name="load-evaluation-data", **LOCAL)
def load_evaluation_data(
    workspace: pm.Workspace, fingerprint: str, train_rows: int | None, root: str | None = None
) -> pm.EvaluationData:
    data = pm.load_evaluation_data(
        fingerprint, train_rows, root=root, cache_dir=workspace.cache_dir
    )
    get_run_logger().info(
        "data %s: %d validation and %d test rows",
        data.name,
        len(data.validation),
        len(data.test),
    )
    return data


@task(name="calibrate", **LOCAL)
def _calibrate(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: pm.EvaluationData
) -> pm.PolicyPlan | InfeasibleTargetError:
    try:
        plan = pm.calibrate_policy(policy, candidates, data)
    except InfeasibleTargetError as infeasible:
        get_run_logger().warning("policy %s: %s", policy.name, infeasible)
        return infeasible
    report = plan.calibration.report
    get_run_logger().info(
        "calibrated %s: ε = %s (%s, %s bound) ≤ target %g at δ = %g; %s",
        plan.method,
        epsilon_text(report.epsilon),
        report.gating.accountant,
        report.gating.kind,
        policy.target_epsilon,
        policy.target_delta,
        plan.reason or "the policy's method",
    )
    return plan


def calibrate(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: pm.EvaluationData
) -> pm.PolicyPlan:
    """The calibrate step (``calibrate_policy``'s contract): the task's plan, or its
    infeasible target raised here, outside the task, so that the task run completes — an
    infeasible target is an outcome of the policy, not a failed task with a traceback."""
    result = _calibrate(policy, candidates, data)
    if isinstance(result, InfeasibleTargetError):
        raise result
    return result


@task(name="merge", **LOCAL)
def merge(
    workspace: pm.Workspace,
    request: pm.MergeRequest,
    candidates: Sequence[RegisteredCandidate],
    plan: pm.PolicyPlan,
    data: pm.EvaluationData,
    workdir: Path,
) -> pm.Release:
    release = pm.merge_release(workspace, request, candidates, plan, data, workdir)
    get_run_logger().info(
        "merged by %s: test accuracy %s",
        release.method,
        number_text(release.metrics["test_accuracy"]),
    )
    return release


@task(name="count-release", **REMOTE)
def count(workspace: pm.Workspace, entry: CountedRelease, cap: float | None) -> pm.LedgerSummary:
    """Count the release in the ledger before anything of it is published."""
    summary = pm.count_release(workspace, entry, cap)
    get_run_logger().info(
        "release %s counted: cumulative ε = %s (%s, δ = %g) over %d release(s)",
        entry.release_id[:12],
        epsilon_text(summary.epsilon),
        summary.accountant,
        summary.delta,
        summary.releases,
    )
    return summary


@task(name="register-merged", **REMOTE)
def register(
    workspace: pm.Workspace,
    request: pm.MergeRequest,
    release: pm.Release,
    ledger: pm.LedgerSummary,
) -> pm.Registered:
    registered = pm.register_release(workspace, request, release, ledger)
    get_run_logger().info(
        "registered %s v%s (%s)",
        registered.name,
        registered.version,
        "reused" if registered.reused else "new",
    )
    return registered


@task(name="serve", **REMOTE)
def serve(
    workspace: pm.Workspace,
    version: PolicyVersion,
    registered: pm.Registered,
    entry: CountedRelease,
    run: str | None,
) -> pm.ServeResult:
    """The gates, then count-and-point in one conditional write of the state store."""
    result = pm.serve_release(workspace, version, registered, entry, run)
    logger = get_run_logger()
    alias = version.policy.alias
    if result.status in (Status.PROMOTED, Status.UNCHANGED):
        logger.info(
            "%r serves %s v%s (%s; was %s)",
            alias,
            registered.name,
            registered.version,
            result.status,
            result.previous,
        )
    else:
        logger.warning(
            "%s v%s %s: %s", registered.name, registered.version, result.status, result.reasons
        )
    return result


@task(name="enforce", **REMOTE)
def enforce(
    workspace: pm.Workspace,
    version: PolicyVersion,
    pool: pm.CandidatePool,
    reasons: Sequence[str],
    run: str | None,
) -> pm.Enforced:
    """The serving invariant when nothing new is served: keep, revoke or flag the alias."""
    enforced = pm.enforce(workspace, version, pool, reasons, run)
    get_run_logger().warning("policy %s v%d: %s", version.name, version.version, enforced.action)
    return enforced


@task(name="project-alias", **REMOTE)
def project(workspace: pm.Workspace, pool: pm.CandidatePool, alias: str) -> pm.Projection:
    """The MLflow alias follows the serving pointer."""
    projection = pm.project(workspace, pool, alias)
    get_run_logger().info("MLflow alias %r: %s → %s", alias, projection.before, projection.after)
    return projection


@task(name="read-card", **REMOTE)
def read_card(workspace: pm.Workspace, name: str, version: str) -> str:
    """The version's privacy card (its description, the card's Markdown)."""
    return pm.read_card(workspace, name, version)


STEPS = pm.PolicySteps(
    prepare=prepare,
    calibrate=calibrate,
    plan_release=plan_release,
    merge=merge,
    count=count,
    register=register,
    serve=serve,
    enforce=enforce,
    project=project,
    read_card=read_card,
)
"""The policy state machine's steps as tasks: ``apply_policy(..., steps=STEPS)``."""
