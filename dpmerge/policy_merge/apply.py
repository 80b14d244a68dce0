"""The policy state machine: one run of one stored policy version, from the registered
candidates to the alias (docs/design.md#release-state, docs/design.md#workflow).

::

    prepare ──── another policy owns the alias, a record fails verification, a fixed-seed
       │         candidate: refused (an error; nothing changed)
       │     ─── a later version of the policy exists or changed the alias ──▶ superseded
    calibrate ── no merge meets the target ──────────────────────────────┐
       │                                                                  │
    plan_release ── a ready, signed version of the same release: reuse ─┐ │
       │        ─── the ledger cap refuses it (nothing merged or drawn) ─┼─┤
    merge (RS: the draw stored for the release) ─▶ count ─▶ register ───┤ │
                                                   (cap: refused) ──────┼─┤
                                                                        ▼ │
    serve ── the release is its signed files, then the gates, then ────┐  │
       │     count-and-point in one conditional write (a later         │  │
       │     version: superseded; not its files: refused; a gate, ─────┼──┤
       │     quarantine, cap: not promoted)                            │  │
       ▼                                                               │  ▼
    project (MLflow alias := the serving pointer) ◀──── promoted /   enforce: the alias keeps a
                                                        unchanged    release only if it meets
                                                                     this version, else revoked
                                                                     (or kept, flagged) → project

Every step boundary is safe to crash at: a release is counted before anything of it is
published (registration), the pointer and the ledger change in one write, the MLflow alias
only follows the pointer, and an RS draw is stored before it is used. A rerun of the same
version converges (tests/test_crash_recovery.py kills a real process at each boundary).

The steps are injectable (:class:`PolicySteps`): by default the library functions; the
``merge-on-policy`` flow passes Prefect tasks that wrap them (retries, logging), and tests wrap
them to observe, break or kill one. Nothing here imports Prefect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dpmerge.errors import InfeasibleTargetError, InputError, RefusalError
from dpmerge.policies import Policy
from dpmerge.policy_merge import calibration, ledger, preparation, promotion, release
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.policy_merge.ledger import LedgerSummary, evaluated, ledger_entry
from dpmerge.policy_merge.outcome import PolicyOutcome, Status
from dpmerge.policy_merge.preparation import Prepared, ReleasePlan, start_export_warmup
from dpmerge.policy_merge.promotion import (
    Enforced,
    Projection,
    Registered,
    ServeResult,
    superseded_reason,
)
from dpmerge.policy_merge.release import MergeRequest, Release, merge_request, spend_note
from dpmerge.policy_merge.tuning import select_privately
from dpmerge.registry import RegisteredCandidate
from dpmerge.state import CountedRelease, SupersededError
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.releases import keep_selection
from dpmerge.vocabulary import Method
from dpmerge.workspace import Workspace, remove_tree

Candidates = Sequence[RegisteredCandidate]


@dataclass(frozen=True)
class PolicySteps:
    """The steps :func:`apply_policy` calls, each with its library function's signature."""

    prepare: Callable[[Workspace, PolicyVersion, Path], Prepared] = preparation.prepare
    calibrate: Callable[[Policy, Candidates, EvaluationData], PolicyPlan] = (
        calibration.calibrate_policy
    )
    plan_release: Callable[[Workspace, MergeRequest, CountedRelease, Policy], ReleasePlan] = (
        preparation.plan_release
    )
    merge: Callable[
        [Workspace, MergeRequest, Candidates, PolicyPlan, EvaluationData, Path], Release
    ] = release.merge_release
    count: Callable[[Workspace, CountedRelease, float | None], LedgerSummary] = ledger.count_release
    register: Callable[[Workspace, MergeRequest, Release, LedgerSummary], Registered] = (
        promotion.register_release
    )
    serve: Callable[
        [Workspace, PolicyVersion, Registered, CountedRelease, str | None], ServeResult
    ] = promotion.serve_release
    enforce: Callable[
        [Workspace, PolicyVersion, CandidatePool, Sequence[str], str | None], Enforced
    ] = promotion.enforce
    project: Callable[[Workspace, CandidatePool, str], Projection] = promotion.project
    read_card: Callable[[Workspace, str, str], str] = promotion.read_card


LIBRARY_STEPS = PolicySteps()


@dataclass(frozen=True)
class PolicyResult:
    """What applying a policy version did, and the privacy card of its release ("" when no
    release was reached: superseded before merging, or infeasible)."""

    outcome: PolicyOutcome
    card: str = ""
    dataset: str | None = None  # the candidates' published dataset identifier


def apply_policy(
    version: PolicyVersion,
    workspace: Workspace,
    *,
    run: str | None = None,
    steps: PolicySteps = LIBRARY_STEPS,
) -> PolicyResult:
    """Apply stored policy ``version`` (``run``: the flow run or process doing it, recorded on
    the alias) in a private scratch directory that is removed afterwards."""
    if workspace.workflow_key() is None:
        raise InputError(
            "applying a policy needs the workflow's key; operators change policies with "
            "`dpmerge policy set`, and the workflow's runs apply them"
        )
    workdir = workspace.scratch()
    try:
        return _Run(version, workspace, workdir, run, steps).apply()
    finally:
        remove_tree(workdir)


@dataclass
class _Run:
    version: PolicyVersion
    workspace: Workspace
    workdir: Path
    run: str | None
    steps: PolicySteps

    @property
    def policy(self) -> Policy:
        return self.version.policy

    def outcome(self, status: Status, **fields: Any) -> PolicyOutcome:
        return PolicyOutcome.of(self.version, status, **fields)

    def apply(self) -> PolicyResult:
        steps = self.steps
        # the first torch.export in a process costs seconds (the registry stores pt2 models):
        # warm it up while the candidates and the split are fetched, finish before the
        # CPU-bound calibration and the registration
        warmup = start_export_warmup()
        try:
            prepared = steps.prepare(self.workspace, self.version, self.workdir / "candidates")
        finally:
            warmup.join()
        pool = prepared.pool
        if prepared.superseded_by is not None or prepared.data is None:
            reason = superseded_reason(prepared.superseded_by or 0, self.policy)
            outcome = self.outcome(
                Status.SUPERSEDED, merged_model=pool.merged_model, reasons=(reason,)
            )
            return PolicyResult(outcome, dataset=pool.dataset)
        candidates, data = prepared.candidates, prepared.data
        try:
            plan = steps.calibrate(self.policy, candidates, data)
        except InfeasibleTargetError as error:
            low, high = error.reachable_epsilon_range
            return self.unmet(
                pool,
                Status.INFEASIBLE,
                (str(error),),
                {"reachable_epsilon_range": (float(low), float(high))},
            )
        plan = select_privately(self.workspace, self.policy, pool, candidates, plan, data)
        request = merge_request(self.policy, pool, candidates, plan)
        entry = ledger_entry(request, candidates, plan, self.version)
        report = plan.calibration.report
        note = spend_note(plan.calibration, self.policy.target_epsilon)
        facts: dict[str, Any] = dict(
            merged_model=pool.merged_model,
            method=plan.method,
            weights=None if plan.method == Method.MIXTURE else tuple(report.weights),
            rungs=tuple(
                {k: r[k] for k in ("probability", "members", "weights")}
                for r in report.to_dict().get("rungs") or ()
            ),
            epsilon=report.epsilon,
            accountant=report.gating.accountant,
            bound=report.gating.kind,
            candidates=tuple(report.names),
            reachable_epsilon_range=plan.calibration.reachable_epsilon_range,
            compared=plan.compared,
            notes=(*prepared.notes, *((note,) if note else ())),
        )
        planned = steps.plan_release(self.workspace, request, entry, self.policy)
        if planned.refused:  # known before merging: nothing is merged, drawn or registered
            return self.unmet(pool, Status.NOT_PROMOTED, planned.refused, facts)
        if plan.selection is not None:  # kept for `ledger rebuild` before the ledger counts it
            keep_selection(
                self.workspace.state(), request.content_hash, plan.selection, plan.consulted
            )
        registered = planned.existing
        if registered is None:
            merged = steps.merge(self.workspace, request, candidates, plan, data, self.workdir)
            merged = replace(merged, internal_notes=prepared.notes)  # δ on the internal card
            entry = evaluated(entry, merged.metrics)  # the test rows' spending is counted too
            try:
                counted = steps.count(self.workspace, entry, self.policy.cumulative_epsilon_cap)
            except RefusalError as refusal:  # a concurrent release took the room: unpublished
                return self.unmet(pool, Status.NOT_PROMOTED, (str(refusal),), facts)
            registered = steps.register(self.workspace, request, merged, counted)
        facts |= dict(
            merged_model=registered.name,
            version=registered.version,
            reused=registered.reused,
            test_accuracy=registered.accuracy,
        )
        served = steps.serve(self.workspace, self.version, registered, entry, self.run)
        card = steps.read_card(self.workspace, registered.name, registered.version)
        if served.status == Status.SUPERSEDED:
            outcome = self.outcome(Status.SUPERSEDED, reasons=served.reasons, **facts)
            return PolicyResult(outcome, dataset=pool.dataset)
        if served.status in (Status.NOT_PROMOTED, Status.REFUSED):
            return self.unmet(pool, served.status, served.reasons, facts, card)
        projection = steps.project(self.workspace, pool, str(self.policy.alias))
        outcome = self.outcome(
            served.status,
            serving="serving",
            serving_version=projection.after,
            previous_version=served.previous,
            cumulative_epsilon=served.cumulative_epsilon,
            **facts,
        )
        return PolicyResult(outcome, card, pool.dataset)

    def unmet(
        self,
        pool: CandidatePool,
        status: Status,
        reasons: Sequence[str],
        facts: dict[str, Any],
        card: str = "",
    ) -> PolicyResult:
        """The run could not serve a compliant new release: keep the serving invariant
        (:func:`~dpmerge.policy_merge.promotion.enforce`) and say what the alias serves now."""
        facts = {"merged_model": pool.merged_model, **facts}
        try:
            enforced = self.steps.enforce(self.workspace, self.version, pool, reasons, self.run)
        except SupersededError as later:
            outcome = self.outcome(
                Status.SUPERSEDED,
                reasons=(*reasons, superseded_reason(later.later, self.policy)),
                **facts,
            )
            return PolicyResult(outcome, card, pool.dataset)
        projection = self.steps.project(self.workspace, pool, str(self.policy.alias))
        alias = enforced.alias
        outcome = self.outcome(
            status,
            serving=alias.state.value if alias else None,
            serving_version=projection.after,
            revoked_version=projection.before if projection.after is None else None,
            reasons=(*reasons, enforced.action),
            **facts,
        )
        return PolicyResult(outcome, card, pool.dataset)
