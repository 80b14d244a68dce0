"""Calibration for a policy (step 3): ``method: auto`` calibrates RS and LC and keeps the better
expected validation accuracy (ties go to LC)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.records import Candidate
from dpmerge.errors import RefusalError
from dpmerge.evaluation import MergeAccuracy
from dpmerge.policies import Policy
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate


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


def calibrate_policy(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: EvaluationData
) -> PolicyPlan:
    """Calibrate ``policy``'s method (``auto``: RS and LC, the better expected validation
    accuracy wins; ties go to LC) at (ε*, δ*) with the policy's gating bound for LC."""
    records: list[Candidate] = []
    for c in candidates:
        if c.model_dir.record is None:
            raise RefusalError(f"{c.name} v{c.version} is not a candidate")
        records.append(c.model_dir.record)
    merges = _merges(candidates)
    k = len(candidates)
    one_hot = [tuple(1.0 if n == i else 0.0 for n in range(k)) for i in range(k)]
    utilities = [merges.accuracy(w, data.validation) for w in one_hot]
    methods = ("lc", "rs") if policy.method == "auto" else (policy.method,)
    results: dict[str, Calibration] = {}
    compared: dict[str, dict[str, Any]] = {}
    for method in methods:
        result = calibrate(
            records,
            method,  # type: ignore[arg-type]
            policy.target_epsilon,
            policy.target_delta,
            gating_bound=policy.gating_bound if method == "lc" else "generic",
            utilities=utilities if method == "rs" else None,
            merge_utility=(lambda w: merges.accuracy(w, data.validation))
            if method == "lc"
            else None,
        )
        results[method] = result
        compared[method] = {
            "epsilon": result.epsilon,
            "bound": result.report.gating.kind,
            "expected_validation_accuracy": result.utility,
            "utility_kind": result.utility_kind,
        }
    best = max(
        methods,
        key=lambda m: (
            -math.inf if results[m].utility is None else results[m].utility,
            m == "lc",
        ),
    )
    return PolicyPlan(results[best], compared)
