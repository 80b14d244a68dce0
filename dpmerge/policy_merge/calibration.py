"""Calibration for a policy (step 3, docs/design.md#calibration).

Every choice is data-independent by default: RS probabilities come from the noise proxy −σ_i²,
the generic gate's subsets and the mixture's rungs and odds from the merged-noise proxy, LC
weights are the subset's inverse-variance weights, and ``method: auto`` calibrates RS, LC and the
mixture and keeps the release with the best expected noise-proxy utility
(:func:`dpmerge.accounting.choice.choose_method`). A policy that sets ``tune_weights`` lets
validation accuracy tune the LC weights within the chosen subset (each rung's, for the mixture)
under the generic gate, where every weighting has the same bound; the validation rows are then
not protected, and the card says so. A choice *between* methods, subsets or candidates steered by
validation accuracy depends on every candidate consulted, which no bound over the released ones
covers: private tuning (``tune: private``, :mod:`dpmerge.policy_merge.tuning`) makes it with a
differentially private selection and states the consulted candidates' bound."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.choice import PREFERENCE, choose_method
from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.accounting.private_selection import Selection
from dpmerge.accounting.records import Candidate
from dpmerge.errors import RefusalError
from dpmerge.evaluation import MergeAccuracy
from dpmerge.policies import Policy
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate
from dpmerge.vocabulary import GatingBound, Method, PolicyMethod


def merge_accuracy(candidates: Sequence[RegisteredCandidate]) -> MergeAccuracy:
    """Accuracy of LC merges of the candidates, with the released merge's arithmetic."""
    specs = {c.model_dir.spec for c in candidates}
    if len(specs) != 1:
        raise RefusalError("the candidates do not share one architecture")
    return MergeAccuracy(specs.pop(), [c.model_dir.weights_file for c in candidates])


@dataclass(frozen=True)
class PolicyPlan:
    """The chosen calibration and how the methods compared (their expected noise-proxy
    utilities, read off the records; a refused method says why); ``offered``: each method's
    calibration; under private tuning, what the selection spent on the validation rows
    (``selection``) and every candidate it consulted (``consulted``, counted in the ledger);
    ``evaluation``: what the release's test-accuracy estimate will spend on the test rows (the
    policy's ``evaluation_epsilon`` on the test split), so the ledger's cap sees it before the
    estimate is drawn."""

    calibration: Calibration
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)
    reason: str | None = None
    offered: dict[str, Calibration] = field(default_factory=dict)
    selection: Selection | None = None
    consulted: tuple[str, ...] = ()
    evaluation: Evaluation | None = None

    @property
    def method(self) -> str:
        return self.calibration.method


def calibrate_policy(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: EvaluationData
) -> PolicyPlan:
    """Calibrate ``policy``'s method at (ε*, δ*) with the policy's gating bound for LC
    (``auto``: RS, LC and the mixture, chosen by :func:`choose_method`; see the module
    docstring)."""
    records: list[Candidate] = []
    for c in candidates:
        if c.model_dir.record is None:
            raise RefusalError(f"{c.name} v{c.version} is not a candidate")
        records.append(c.model_dir.record)
    merges = merge_accuracy(candidates) if policy.tune_weights else None
    methods = PREFERENCE if policy.method == PolicyMethod.AUTO else (Method(policy.method),)
    results: dict[str, Calibration] = {}
    compared: dict[str, dict[str, Any]] = {}
    for method in methods:
        tuned = merges is not None and method != Method.RS
        try:
            result = calibrate(
                records,
                method,
                policy.target_epsilon,
                policy.target_delta,
                gating_bound=policy.gating_bound if method == Method.LC else GatingBound.GENERIC,
                merge_utility=(lambda w: merges.accuracy(w, data.validation)) if tuned else None,  # type: ignore[union-attr]
            )
        except RefusalError as refusal:
            if len(methods) == 1:
                raise
            compared[str(method)] = {"refused": str(refusal)}
            continue
        results[str(method)] = result
        compared[str(method)] = {"epsilon": result.epsilon, "bound": str(result.report.gating.kind)}
    if not results:
        raise RefusalError("; ".join(c["refused"] for c in compared.values()))
    choice = choose_method(results, records)
    for method, utility in choice.utilities.items():
        compared[method]["expected_utility"] = utility
    reason = choice.reason if len(methods) > 1 else None
    evaluation = Evaluation(policy.evaluation_epsilon, len(data.test))
    return PolicyPlan(choice.calibration, compared, reason, offered=results, evaluation=evaluation)
