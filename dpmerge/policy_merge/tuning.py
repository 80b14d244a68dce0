"""Private tuning for a policy (``tune: private``, docs/design.md#private-tuning): after the
data-independent calibration, the release is chosen among ``auto``'s and a grid of LC weights
(:func:`dpmerge.accounting.tuning.tuning_plan`) by the exponential mechanism on validation
counts, drawn once and kept (:func:`dpmerge.policy_merge.draws.stored_selection`): a rerun
reuses the choice and never draws again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dpmerge.accounting.tuning import option_counts, tuned_release, tuning_plan
from dpmerge.policies import Policy
from dpmerge.policy_merge.calibration import PolicyPlan, merge_accuracy
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.draws import selection_key, stored_selection
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate
from dpmerge.vocabulary import Method, Tuning
from dpmerge.workspace import Workspace


def select_privately(
    workspace: Workspace,
    policy: Policy,
    pool: CandidatePool,
    candidates: Sequence[RegisteredCandidate],
    plan: PolicyPlan,
    data: EvaluationData,
) -> PolicyPlan:
    """``plan`` unchanged unless the policy says ``tune: private`` (and LC is feasible), else
    the plan of the privately selected release (see the module docstring)."""
    lc = plan.offered.get(str(Method.LC))
    if policy.tune != Tuning.PRIVATE or lc is None:
        return plan
    records = [c.model_dir.record for c in candidates if c.model_dir.record is not None]
    tuning = tuning_plan(records, plan.calibration, lc)
    merges, n = merge_accuracy(candidates), len(data.validation)
    counts = option_counts(tuning, lambda w: merges.accuracy(w, data.validation), n)
    labels = [option.label for option in tuning.options]
    key = selection_key(
        {
            "model": pool.registered_model,
            "parents": [c.version for c in candidates],
            "target": [policy.target_epsilon, policy.target_delta],
            "options": labels,
            "validation_rows": n,
        }
    )
    index, selection = stored_selection(workspace, key, labels, counts, n, policy.selection_epsilon)
    calibration = tuned_release(tuning, index, records)
    reason = (
        f"private tuning chose {labels[index]} among {len(labels)} merges (exponential "
        f"mechanism on validation accuracy, ε = {selection.epsilon:g} on the validation rows)"
    )
    return replace(
        plan,
        calibration=calibration,
        reason=reason,
        selection=selection,
        consulted=tuning.consulted,
    )
