"""The result of a calibration (docs/design.md#calibration): the chosen merge, its certified
privacy report, and how it was found."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpmerge.accounting.bounds import MixtureRung, PrivacyReport, finite_or_none
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
class Calibration:
    """The chosen merge for a target, with its certified privacy report.

    ``weights`` are the RS probabilities or LC weights; for a mixture (one of two LC merges
    drawn secretly) they are ``None`` and ``rungs`` holds each merge's odds, weights and
    generic bound."""

    method: Method
    target_epsilon: float
    delta: float
    weights: tuple[float, ...] | None
    report: PrivacyReport
    reachable_epsilon_range: tuple[float, float]
    utility: float | None
    utility_kind: str
    search: dict[str, Any] = field(default_factory=dict)

    @property
    def epsilon(self) -> float:
        return self.report.epsilon

    @property
    def rungs(self) -> tuple[MixtureRung, ...]:
        """A mixture's LC merges (empty for RS and LC)."""
        return self.report.rungs

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
        return data


def infeasible_document(
    error: InfeasibleTargetError, method: Method | str, bound: GatingBound | str
) -> dict[str, Any]:
    """JSON for an infeasible target (the CLI prints it with ``--json``)."""
    low, high = error.reachable_epsilon_range
    kinds = {Method.RS: BoundKind.SELECTION, Method.MIXTURE: BoundKind.MIXTURE}
    return {
        "method": str(method),
        "bound": str(kinds.get(Method(method), bound)),
        "feasible": False,
        "target_epsilon": error.target_epsilon,
        "delta": error.delta,
        "reachable_epsilon_range": [finite_or_none(low), finite_or_none(high)],
        "required_noise_multiplier": error.required_noise_multiplier,
        "reason": str(error),
        "weights": None,
        "epsilon_pld": None,
        "epsilon_rdp": None,
    }
