"""The result of a calibration (docs/design.md#calibration): the chosen merge, its certified
privacy report, and how it was found."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpmerge.accounting.bounds import PrivacyReport, finite_or_none
from dpmerge.errors import InfeasibleTargetError
from dpmerge.vocabulary import BoundKind, GatingBound, Method

MergeUtility = Callable[[tuple[float, ...]], float]
"""Validation accuracy of the LC merge with these weights (data disjoint from training)."""

COARSE_MARGIN = 0.02
"""A coarse-grid (1e-3) ε above the target by more than this is not worth certifying. The
coarse ε exceeded the fine one by ≤ 3e-3 in every case measured; the margin only steers:
nothing is declared feasible without a fine certification."""

LP_SLACK = 1e-5
"""Relative slack on δ* in the selection programmes, so the certified ε (which adds a 1e-7
safety margin) still meets the target exactly at the constraint."""


@dataclass(frozen=True)
class MergeMixture:
    """Release one of two LC merges, drawn secretly (docs/design.md#calibration: RS between two
    subset merges under the generic gate). ``weights[j]`` is drawn with ``probabilities[j]``."""

    names: tuple[str, ...]
    """The candidates' names, in the order of each weight vector."""
    weights: tuple[tuple[float, ...], tuple[float, ...]]
    probabilities: tuple[float, float]
    utilities: tuple[float, float]

    @property
    def expected_utility(self) -> float:
        return sum(p * u for p, u in zip(self.probabilities, self.utilities, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "merges": [
                {
                    "probability": p,
                    "weights": list(w),
                    "members": [n for n, x in zip(self.names, w, strict=True) if x > 0],
                    "utility": u,
                }
                for w, p, u in zip(self.weights, self.probabilities, self.utilities, strict=True)
            ]
        }


@dataclass(frozen=True)
class Calibration:
    """The chosen merge for a target, with its certified privacy report.

    ``weights`` are the RS probabilities or LC weights; for a :class:`MergeMixture` (one of two
    LC merges drawn secretly) they are ``None`` and ``mixture`` says which merges."""

    method: Method
    target_epsilon: float
    delta: float
    weights: tuple[float, ...] | None
    report: PrivacyReport
    reachable_epsilon_range: tuple[float, float]
    utility: float | None
    utility_kind: str
    search: dict[str, Any] = field(default_factory=dict)
    mixture: MergeMixture | None = None

    @property
    def epsilon(self) -> float:
        return self.report.epsilon

    def to_dict(self) -> dict[str, Any]:
        data = self.report.to_dict()
        low, high = self.reachable_epsilon_range
        data.update(
            feasible=True,
            target_epsilon=self.target_epsilon,
            reachable_epsilon_range=[finite_or_none(low), finite_or_none(high)],
            utility=self.utility,
            utility_kind=self.utility_kind,
            search=self.search,
        )
        if self.mixture is not None:
            data["weights"] = None
            data["mixture"] = self.mixture.to_dict()
        return data


def infeasible_document(
    error: InfeasibleTargetError, method: Method | str, bound: GatingBound | str
) -> dict[str, Any]:
    """JSON for an infeasible target (the CLI prints it with ``--json``)."""
    low, high = error.reachable_epsilon_range
    return {
        "method": str(method),
        "bound": str(BoundKind.SELECTION if method == Method.RS else bound),
        "feasible": False,
        "target_epsilon": error.target_epsilon,
        "delta": error.delta,
        "reachable_epsilon_range": [finite_or_none(low), finite_or_none(high)],
        "reason": str(error),
        "weights": None,
        "epsilon_pld": None,
        "epsilon_rdp": None,
    }
