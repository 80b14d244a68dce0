"""What-if: the release a policy would get, without side effects (docs/design.md#policies,
docs/design.md#operator-trust).

:func:`dry_run` runs the read-only part of the state machine — find and load the candidates
and the evaluation split, calibrate, look for an existing release of the same request, read
the ledger — and shows only what is derived from the mechanism records: the plan (method,
weights or a mixture's merges and odds), ε under each bound, the ledger's cap, and the expected
utility by the records' noise proxy (:func:`~dpmerge.accounting.choice.expected_utility`). It
evaluates nothing on validation or test rows: an operator who picked a target or a method from
such accuracies would make a data-dependent choice no ε and no ledger covers. The accuracy
minimum is checked when the policy is applied, on the released model. Nothing is drawn (a draw
is a release step that costs privacy and must stay secret). It writes no version, alias, ledger
entry or audit record; only this host's caches (candidate files, evaluation splits, PLDs) may
be filled, as any run would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from dpmerge.accounting.choice import expected_utility
from dpmerge.accounting.delta import delta_check_for
from dpmerge.errors import InfeasibleTargetError
from dpmerge.formatting import epsilon_text, number_text, within_text
from dpmerge.policies import Policy
from dpmerge.policy_merge.calibration import PolicyPlan, calibrate_policy
from dpmerge.policy_merge.candidates import (
    CandidatePool,
    find_candidates,
    load_candidates,
    refuse_fixed_seeds,
)
from dpmerge.policy_merge.evaluation_data import load_evaluation_data
from dpmerge.policy_merge.ledger import ledger_entry, ledger_summary
from dpmerge.policy_merge.promotion import find_release, unmet
from dpmerge.policy_merge.release import merge_request
from dpmerge.registry import RegisteredCandidate
from dpmerge.state import CountedRelease
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.serving import read_state
from dpmerge.vocabulary import Method, OnNoncompliant, Tuning
from dpmerge.workspace import Workspace, remove_tree

PRIVATE_TUNING_NOTE = (
    "tune: private — a run chooses the release among auto's and a grid of LC weights by a "
    "private selection on validation accuracy (its selection_epsilon on the validation rows); "
    "a dry run spends nothing and shows auto's release (docs/design.md#private-tuning)"
)


class Verdict(StrEnum):
    """What applying the policy now would do."""

    WOULD_PROMOTE = "would_promote"
    WOULD_BE_UNCHANGED = "would_be_unchanged"  # the alias already names this release
    WOULD_NOT_PROMOTE = "would_not_promote"  # a gate would fail
    INFEASIBLE = "infeasible"


@dataclass(frozen=True)
class Gate:
    """One promotion gate: whether it would pass (``None``: it depends on the RS draw)."""

    name: str
    passes: bool | None
    detail: str


@dataclass(frozen=True)
class DryRun:
    """The release a policy would get (see the module docstring). JSON-safe; no RS draw."""

    policy: str
    verdict: Verdict
    alias: str
    target_epsilon: float
    target_delta: float
    merged_model: str
    alias_version: str | None = None
    method: str | None = None
    candidates: tuple[str, ...] = ()
    parents: tuple[str, ...] = ()
    weights: tuple[float, ...] | None = None  # RS: π; LC: λ; the mixture: see rungs
    rungs: tuple[dict[str, Any], ...] = ()  # the mixture's merges: probability, weights, ε
    epsilon: float | None = None
    accountant: str | None = None
    bound: str | None = None
    generic_epsilon: float | None = None
    structured_epsilon: float | None = None
    expected_utility: float | None = None  # the records' noise proxy, never an accuracy
    existing_version: str | None = None
    gates: tuple[Gate, ...] = ()
    reachable_epsilon_range: tuple[float, float] | None = None
    reasons: tuple[str, ...] = ()
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # δ against the dataset size (a warning, or why unchecked)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        data["dry_run"] = True
        return data

    def _shares(self, weights: Any) -> str:
        return ", ".join(
            f"{name} v{version} {weight:.4f}"
            for name, version, weight in zip(self.candidates, self.parents, weights, strict=False)
            if weight > 0
        )

    def summary(self) -> str:
        """One line for people."""
        head = f"policy {self.policy} (dry run): {self.verdict.value.replace('_', ' ')}"
        if self.verdict == Verdict.INFEASIBLE:
            return f"{head} — {'; '.join((*self.reasons, *self.notes))}"
        shown = self._shares(self.weights or ())
        if self.rungs:
            shown = "; ".join(
                f"merge {j + 1} with probability {r['probability']:.4f} "
                f"({self._shares(r['weights'])})"
                for j, r in enumerate(self.rungs)
            )
        line = (
            f"{head} — {str(self.method).upper()} of {shown}: "
            f"{within_text(self.epsilon, self.target_epsilon)} "
            f"({self.accountant}, {self.bound} bound, δ = {self.target_delta:g})"
        )
        if self.bound != "generic" and self.generic_epsilon is not None:
            line += f", generic bound ε = {epsilon_text(self.generic_epsilon)}"
        if self.structured_epsilon is not None and self.bound != "structured":
            line += f", structured bound ε = {epsilon_text(self.structured_epsilon)}"
        line += f"; expected noise-proxy utility {number_text(self.expected_utility)}"
        if self.existing_version:
            line += f"; reuses {self.merged_model} v{self.existing_version}"
        failing = [g.detail for g in self.gates if g.passes is not True]
        line += f"; gates: {'; '.join(failing)}" if failing else "; every gate passes"
        return "; ".join((line, *self.notes))


def dry_run(version: PolicyVersion, workspace: Workspace) -> DryRun:
    """What :func:`~dpmerge.policy_merge.apply_policy` would release for policy ``version``
    (a version not stored yet: what storing it would do) now."""
    policy = version.policy
    registry = workspace.registry()
    pool = find_candidates(registry, policy.dataset, policy.model, workspace.state())
    alias = read_state(workspace.state(), pool.dataset).alias(pool.merged_model, str(policy.alias))
    alias_now = alias.serving if alias else None
    base = dict(
        policy=policy.name,
        alias=str(policy.alias),
        target_epsilon=policy.target_epsilon,
        target_delta=policy.target_delta,
        merged_model=pool.merged_model,
        alias_version=alias_now,
    )
    scratch = workspace.scratch()
    try:
        candidates = load_candidates(
            registry, pool, scratch, cache_dir=workspace.cache_dir / "candidates"
        )
        refuse_fixed_seeds(candidates)  # what a real run refuses, the dry run refuses too
        records = [c.model_dir.record for c in candidates]
        delta_check = delta_check_for(records, policy.target_delta)  # δ ≥ 1/n: refused
        base["notes"] = tuple(n for n in (delta_check.warning, delta_check.note) if n)
        if policy.tune == Tuning.PRIVATE:  # the selection is made, and spends, only in a run
            base["notes"] = (*base["notes"], PRIVATE_TUNING_NOTE)
        first = records[0]
        data = load_evaluation_data(  # by the internal fingerprint, as a real run does
            first.dataset,
            getattr(first, "dataset_size", None),
            root=policy.data_root,
            cache_dir=workspace.cache_dir,
        )
        try:
            plan = calibrate_policy(policy, candidates, data)
        except InfeasibleTargetError as error:
            action = _unmet_action(policy, alias)
            low, high = error.reachable_epsilon_range
            return DryRun(
                verdict=Verdict.INFEASIBLE,
                reachable_epsilon_range=(float(low), float(high)),
                reasons=(str(error), action),
                **base,
            )
        return _planned(version, workspace, pool, candidates, plan, base)
    finally:
        remove_tree(scratch)


def _unmet_action(policy: Policy, alias: Any) -> str:
    """What a run that serves nothing new would do to the alias (the serving invariant)."""
    serving = alias.serving if alias else None
    if serving is None:
        return f"alias {policy.alias!r} would serve nothing"
    failing = unmet(alias.guarantee, policy)
    if not failing:
        return f"alias {policy.alias!r} would keep v{serving}, which meets the policy"
    if policy.on_noncompliant == OnNoncompliant.KEEP:
        return f"alias {policy.alias!r} would KEEP v{serving}, flagged non-compliant"
    return f"alias {policy.alias!r} would be revoked (v{serving}: {'; '.join(failing)})"


def _planned(
    version: PolicyVersion,
    workspace: Workspace,
    pool: CandidatePool,
    candidates: list[RegisteredCandidate],
    plan: PolicyPlan,
    base: dict[str, Any],
) -> DryRun:
    policy = version.policy
    calibration, report = plan.calibration, plan.calibration.report
    report_dict = report.to_dict()
    records = [c.model_dir.record for c in candidates if c.model_dir.record is not None]
    request = merge_request(policy, pool, candidates, plan)
    existing = find_release(workspace, request)
    entry = ledger_entry(request, candidates, plan, version)
    gates = [
        Gate("epsilon", report.epsilon <= policy.target_epsilon, "ε within the target"),
        Gate("delta", report.delta <= policy.target_delta, "δ within the target"),
        Gate(
            "accuracy",
            None,
            f"the accuracy minimum {policy.min_accuracy:g} is checked on the released model when "
            "the policy is applied (a dry run evaluates no validation or test rows)",
        ),
        _ledger_gate(policy, workspace, entry),
    ]
    if any(g.passes is False for g in gates):
        verdict = Verdict.WOULD_NOT_PROMOTE
    elif existing is not None and existing.version == base["alias_version"]:
        verdict = Verdict.WOULD_BE_UNCHANGED
    else:
        verdict = Verdict.WOULD_PROMOTE
    return DryRun(
        verdict=verdict,
        method=plan.method,
        candidates=tuple(report.names),
        parents=request.parents,
        weights=None if plan.method == Method.MIXTURE else tuple(report.weights),
        rungs=tuple(
            {k: r[k] for k in ("probability", "weights", "members", "epsilon")}
            for r in report_dict.get("rungs") or ()
        ),
        epsilon=report.epsilon,
        accountant=report.gating.accountant,
        bound=report.gating.kind,
        generic_epsilon=report.generic.epsilon if report.generic else None,
        structured_epsilon=report.structured.epsilon
        if report.structured and report.structured.available
        else None,
        expected_utility=expected_utility(calibration, records),
        existing_version=existing.version if existing else None,
        gates=tuple(gates),
        reachable_epsilon_range=calibration.reachable_epsilon_range,
        compared=plan.compared,
        **base,
    )


def _ledger_gate(policy: Policy, workspace: Workspace, entry: CountedRelease) -> Gate:
    """The ledger's cap, read only (checked as a promotion checks it; nothing is written)."""
    cap = policy.cumulative_epsilon_cap
    summary = ledger_summary(workspace, entry, cap)
    if summary.refusal is not None:
        return Gate("ledger", False, summary.refusal)
    shown = f"cumulative ε = {epsilon_text(summary.epsilon)}" + (
        f" ≤ cap {cap:g}" if cap is not None else " (no cap)"
    )
    return Gate("ledger", True, shown)
