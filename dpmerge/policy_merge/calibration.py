"""Calibration for a policy (step 3): ``method: auto`` calibrates RS and LC and keeps the better
expected validation accuracy (ties go to LC)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.records import Candidate
from dpmerge.artifacts import ModelSpec
from dpmerge.data import Split
from dpmerge.errors import RefusalError
from dpmerge.evaluation import evaluate
from dpmerge.policies import Policy
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate


class _Merges:
    """Accuracy of in-memory LC merges of the candidates, cached by weights."""

    def __init__(self, candidates: Sequence[RegisteredCandidate]) -> None:
        specs = {c.model_dir.spec for c in candidates}
        if len(specs) != 1:
            raise RefusalError("the candidates do not share one architecture")
        self.spec: ModelSpec = specs.pop()
        self.states = [c.model_dir.weights for c in candidates]
        self._cache: dict[tuple[tuple[float, ...], int], float] = {}

    def state(self, weights: Sequence[float]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for state, weight in zip(self.states, weights, strict=True):
            if weight == 0:
                continue
            for key, tensor in state.items():
                value = tensor.double() * weight
                merged[key] = merged[key] + value if key in merged else value
        reference = self.states[0]
        return {k: v.to(reference[k].dtype) for k, v in merged.items()}

    def accuracy(self, weights: Sequence[float], split: Split) -> float:
        key = (tuple(round(float(w), 12) for w in weights), id(split))
        if key not in self._cache:
            scores = evaluate((self.spec, self.state(weights)), split)
            self._cache[key] = float(scores["accuracy"])
        return self._cache[key]


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
    merges = _Merges(candidates)
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
