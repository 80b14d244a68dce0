"""Calibration for a policy (step 3, docs/design.md#calibration).

Every choice that reaches beyond the released candidates is data-independent: RS probabilities
come from the noise proxy −σ_i², the generic gate's subset from the merged-noise proxy, and
``method: auto`` keeps the method whose release has the smaller noise proxy (ties go to LC: no
secret draw). Validation accuracy only tunes the LC weights within the chosen subset (generic
gate), where every weighting has the same bound. A choice steered by the candidates' validation
accuracies would depend on every candidate consulted, which no bound over the released ones
covers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.weights import inverse_variance_weights, merged_noise_proxy
from dpmerge.errors import RefusalError
from dpmerge.evaluation import MergeAccuracy
from dpmerge.policies import Policy
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate
from dpmerge.vocabulary import GatingBound, Method, PolicyMethod


def _merges(candidates: Sequence[RegisteredCandidate]) -> MergeAccuracy:
    """Accuracy of LC merges of the candidates, with the released merge's arithmetic."""
    specs = {c.model_dir.spec for c in candidates}
    if len(specs) != 1:
        raise RefusalError("the candidates do not share one architecture")
    return MergeAccuracy(specs.pop(), [c.model_dir.weights_file for c in candidates])


@dataclass(frozen=True)
class PolicyPlan:
    """The chosen calibration and how the methods compared (internal statistics: they are
    computed from every candidate, so they stay out of the public card)."""

    calibration: Calibration
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.calibration.method


def _noise_proxy(calibration: Calibration, records: Sequence[Candidate]) -> float | None:
    """The release's noise variance relative to its signal, from the records alone: RS
    Σπ_i·σ_i², LC Σc_i²σ_i²/(Σc_i)² at the subset's inverse-variance weights (the weights the
    proxy chose, before any tuning). ``None`` with label-only candidates (no σ)."""
    weights = calibration.weights or ()
    used = [(w, r) for w, r in zip(weights, records, strict=True) if w > 0]
    if not used or not all(isinstance(r, MechanismRecord) for _, r in used):
        return None
    if calibration.method == Method.RS:
        return math.fsum(w * r.noise_multiplier**2 for w, r in used)  # type: ignore[union-attr]
    members = [r for _, r in used]
    return merged_noise_proxy(members, inverse_variance_weights(members))  # type: ignore[arg-type]


def calibrate_policy(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: EvaluationData
) -> PolicyPlan:
    """Calibrate ``policy``'s method at (ε*, δ*) with the policy's gating bound for LC
    (``auto``: RS and LC, the smaller noise proxy wins; see the module docstring)."""
    records: list[Candidate] = []
    for c in candidates:
        if c.model_dir.record is None:
            raise RefusalError(f"{c.name} v{c.version} is not a candidate")
        records.append(c.model_dir.record)
    merges = _merges(candidates)
    methods = (Method.LC, Method.RS) if policy.method == PolicyMethod.AUTO else (policy.method,)
    results: dict[str, Calibration] = {}
    compared: dict[str, dict[str, Any]] = {}
    for method in methods:
        tunable = method == Method.LC and policy.gating_bound == GatingBound.GENERIC
        try:
            result = calibrate(
                records,
                method,
                policy.target_epsilon,
                policy.target_delta,
                gating_bound=policy.gating_bound if method == Method.LC else GatingBound.GENERIC,
                merge_utility=(lambda w: merges.accuracy(w, data.validation)) if tunable else None,
            )
        except RefusalError as refusal:
            if len(methods) == 1:
                raise
            compared[str(method)] = {"refused": str(refusal)}
            continue
        results[str(method)] = result
        compared[str(method)] = {
            "epsilon": result.epsilon,
            "bound": str(result.report.gating.kind),
            "noise_proxy": _noise_proxy(result, records),
        }
    if not results:
        raise RefusalError("; ".join(c["refused"] for c in compared.values()))

    def rank(method: str) -> tuple[float, bool]:
        proxy = compared[method]["noise_proxy"]
        return (math.inf if proxy is None else proxy, method != Method.LC)

    return PolicyPlan(results[min(results, key=rank)], compared)
