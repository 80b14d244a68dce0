"""Calibration to a target (ε*, δ*): the feasible merge with the best utility (SPEC §6).

* RS: the linear programme max Σ π_i·u_i s.t. Σ π_i·δ_i(ε*) ≤ δ* over the simplex (SPEC §4).
* LC gated by the generic bound (the default): the best subset whose composition meets the
  target, weighted inverse-variance (SPEC §5.1).
* LC gated by the structured bound (opt-in): the search of ``structured_search``.

Utility is validation accuracy when the caller knows it (``utilities`` per candidate for RS,
``merge_utility(weights)`` for LC), otherwise the merged-noise proxy of SPEC §6. The returned ε
is certified at the fine discretisation and never exceeds the target; it may be below the
target only where spending more would not improve the merge. Below the most private
candidate's ε nothing is feasible: ``InfeasibleTargetError`` carries the reachable range.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.account import GatingBound, Method, account, check_delta
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.lc import (
    composed_pld,
    inverse_variance_weights,
    merged_noise_proxy,
    release_units,
)
from dpmerge.accounting.records import Candidate, MechanismRecord, require_same_dataset
from dpmerge.errors import InfeasibleTargetError, RecordError, RefusalError

MergeUtility = Callable[[tuple[float, ...]], float]

COARSE_MARGIN = 0.02
"""A coarse-grid ε above the target by more than this is not worth certifying. The coarse
(1e-3) ε exceeded the fine one by ≤ 3e-3 in every case measured (notes: accounting-probe §1);
the margin only steers: nothing is declared feasible without a fine certification."""

LP_SLACK = 1e-5
"""Relative slack on δ* in the RS programme, so the certified ε (which adds a 1e-7 safety
margin) still meets the target exactly at the constraint."""

MAX_EXHAUSTIVE_SUBSETS = 10
"""Enumerate every subset up to this many candidates (1023 subsets); greedy beyond (SPEC §6)."""


@dataclass(frozen=True)
class Calibration:
    """The chosen merge for a target, with its certified privacy report."""

    method: Method
    target_epsilon: float
    delta: float
    weights: tuple[float, ...]
    report: PrivacyReport
    reachable_epsilon_range: tuple[float, float]
    utility: float | None
    utility_kind: str
    search: dict[str, Any] = field(default_factory=dict)

    @property
    def epsilon(self) -> float:
        return self.report.epsilon

    def to_dict(self) -> dict[str, Any]:
        data = self.report.to_dict()
        data.update(
            feasible=True,
            target_epsilon=self.target_epsilon,
            reachable_epsilon_range=list(self.reachable_epsilon_range),
            utility=self.utility,
            utility_kind=self.utility_kind,
            search=self.search,
        )
        return data


def infeasible_document(error: InfeasibleTargetError, method: str, bound: str) -> dict[str, Any]:
    """JSON for an infeasible target (the CLI prints it with ``--json``)."""
    return {
        "method": method,
        "bound": "selection" if method == "rs" else bound,
        "feasible": False,
        "target_epsilon": error.target_epsilon,
        "delta": error.delta,
        "reachable_epsilon_range": list(error.reachable_epsilon_range),
        "reason": str(error),
        "weights": None,
        "epsilon_pld": None,
        "epsilon_rdp": None,
    }


def calibrate(
    candidates: Sequence[Candidate],
    method: Method,
    target_epsilon: float,
    delta: float,
    *,
    gating_bound: GatingBound = "generic",
    utilities: Sequence[float] | None = None,
    merge_utility: MergeUtility | None = None,
    map_segments: bool = False,
) -> Calibration:
    """The best-utility merge whose gating ε meets ``target_epsilon`` at ``delta`` (SPEC §6).

    ``map_segments`` (structured LC only) also reports every feasible segment of the chosen
    path (see ``structured_search``)."""
    if not candidates:
        raise RecordError("no candidates")
    require_same_dataset(candidates)
    delta = check_delta(delta)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise RecordError(f"target ε must be a positive number, got {target_epsilon}")
    if utilities is not None and len(utilities) != len(candidates):
        raise RecordError(f"{len(utilities)} utilities for {len(candidates)} candidates")
    epsilons = [candidate_bound(c, delta).epsilon for c in candidates]
    most_private = min(epsilons)
    if target_epsilon < most_private:
        raise InfeasibleTargetError(
            f"target ε = {target_epsilon:g} at δ = {delta:g} is below the most private "
            f"candidate's ε = {most_private:.4f}; no merge of these candidates reaches it",
            target_epsilon=target_epsilon,
            delta=delta,
            reachable_epsilon_range=(most_private, max(epsilons)),
        )
    if method == "rs":
        return _calibrate_rs(candidates, target_epsilon, delta, epsilons, utilities)
    if method != "lc":
        raise RecordError(f"method must be 'rs' or 'lc', got {method!r}")
    if gating_bound == "generic":
        return _calibrate_lc_generic(candidates, target_epsilon, delta, epsilons, merge_utility)
    if gating_bound == "structured":
        from dpmerge.accounting.structured_search import calibrate_structured

        return calibrate_structured(
            candidates, target_epsilon, delta, epsilons, merge_utility, map_segments=map_segments
        )
    raise RecordError(f"gating bound must be 'generic' or 'structured', got {gating_bound!r}")


# --------------------------------------------------------------------------------------------
# RS (SPEC §4)


def _rs_utilities(
    candidates: Sequence[Candidate], epsilons: Sequence[float], utilities: Sequence[float] | None
) -> tuple[list[float], str]:
    if utilities is not None:
        return [float(u) for u in utilities], "expected validation accuracy"
    if all(isinstance(c, MechanismRecord) for c in candidates):
        # −σ² (less noise is better); ties go to the candidate that spent more (more steps).
        proxy = [
            -(c.noise_multiplier**2) + 1e-9 * e for c, e in zip(candidates, epsilons, strict=True)
        ]  # type: ignore[union-attr]
        return proxy, "noise proxy: −σ² (no utilities given)"
    return list(epsilons), "candidate ε (label-only candidates, no utilities given)"


def best_two_point_mixture(
    utilities: Sequence[float], costs: Sequence[float], budget: float
) -> tuple[float, ...] | None:
    """Vertex enumeration of max Σπ_i·u_i s.t. Σπ_i·cost_i ≤ budget, π on the simplex.

    The optimum of this LP is a vertex: one candidate with cost ≤ budget, or two candidates
    mixed so the constraint is tight. ``None`` when no candidate fits the budget.
    """
    k = len(utilities)
    best: tuple[float, tuple[float, ...]] | None = None
    for j in range(k):
        if costs[j] > budget:
            continue
        pure = tuple(1.0 if n == j else 0.0 for n in range(k))
        if best is None or utilities[j] > best[0]:
            best = (utilities[j], pure)
        for i in range(k):
            if costs[i] <= budget or utilities[i] <= utilities[j]:
                continue
            share = (budget - costs[j]) / (costs[i] - costs[j])
            value = share * utilities[i] + (1 - share) * utilities[j]
            if value > best[0]:
                pi = [0.0] * k
                pi[i], pi[j] = share, 1.0 - share
                best = (value, tuple(pi))
    return None if best is None else best[1]


def _calibrate_rs(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    utilities: Sequence[float] | None,
) -> Calibration:
    u, utility_kind = _rs_utilities(candidates, epsilons, utilities)
    try:
        plds = [pld_mod.candidate_pld(c, pld_mod.FINE_DISCRETISATION) for c in candidates]
        costs = [float(profiles.delta_for_epsilon(p, target)[0]) for p in plds]
        pi = best_two_point_mixture(u, costs, delta * (1 - LP_SLACK))
        constraint = "PLD: Σ π_i·δ_i(ε*) ≤ δ*"
    except ValueError:  # an RDP-only label: the programme under RDP instead, order by order
        pi = _rs_programme_rdp(candidates, u, target, delta)
        constraint = "RDP: Σ π_i·exp((α−1)·ε_i(α)) ≤ exp((α−1)·budget(α)), best order"
    if pi is None:  # only when float rounding puts every candidate on the boundary
        pi = tuple(1.0 if e == min(epsilons) else 0.0 for e in epsilons)
        pi = tuple(p / sum(pi) for p in pi)
    report = account(candidates, "rs", pi, delta)
    while report.epsilon > target:  # guard: shift mass to the most private candidate
        safest = int(np.argmin(epsilons))
        pi = tuple(p * 0.999 + (0.001 if n == safest else 0.0) for n, p in enumerate(pi))
        report = account(candidates, "rs", pi, delta)
    value = float(np.dot(pi, u))
    return Calibration(
        method="rs",
        target_epsilon=target,
        delta=delta,
        weights=pi,
        report=report,
        reachable_epsilon_range=(min(epsilons), max(epsilons)),
        utility=value,
        utility_kind=utility_kind,
        search={"programme": constraint, "mixes": sum(p > 0 for p in pi)},
    )


def _rs_programme_rdp(
    candidates: Sequence[Candidate], u: Sequence[float], target: float, delta: float
) -> tuple[float, ...] | None:
    curves = [rdp_mod.candidate_rdp(c) for c in candidates]
    if any(curve is None for curve in curves):
        raise RefusalError("RS needs every candidate's PLD or every candidate's RDP curve")
    return rs_programme_rdp(curves, u, target, delta)  # type: ignore[arg-type]


def rs_programme_rdp(
    curves: Sequence[Sequence[float]], u: Sequence[float], target: float, delta: float
) -> tuple[float, ...] | None:
    """The RS programme under RDP. For a fixed order α the constraint "ε_RDP ≤ ε*" reads
    Σ π_i·exp((α−1)·(ε_i(α) − b(α))) ≤ 1 with b(α) = ε* − log(1−1/α) + log(δα)/(α−1): linear
    in π. Solved at every order; the best order's solution is returned."""
    best, best_value = None, -math.inf
    for k, alpha in enumerate(rdp_mod.ORDERS):
        budget = target - math.log1p(-1 / alpha) + math.log(delta * alpha) / (alpha - 1)
        if budget <= 0:
            continue
        costs = [math.exp(min((alpha - 1) * (curve[k] - budget), 700.0)) for curve in curves]
        pi = best_two_point_mixture(u, costs, 1.0 - LP_SLACK)
        if pi is not None and float(np.dot(pi, u)) > best_value:
            best, best_value = pi, float(np.dot(pi, u))
    return best


# --------------------------------------------------------------------------------------------
# LC gated by the generic bound (SPEC §5.1, §6)


def subset_weights(members: Sequence[Candidate]) -> tuple[float, ...]:
    """Inverse-variance weights over a subset; equal weights where a member is label-only."""
    if all(isinstance(m, MechanismRecord) for m in members):
        return inverse_variance_weights(members)  # type: ignore[arg-type]
    return tuple(1.0 / len(members) for _ in members)


def _embed(k: int, members: Sequence[int], values: Sequence[float]) -> tuple[float, ...]:
    weights = [0.0] * k
    for i, v in zip(members, values, strict=True):
        weights[i] = v
    return tuple(weights)


def _candidate_subsets(k: int, epsilons: Sequence[float], target: float) -> list[tuple[int, ...]]:
    """Subsets whose members each meet the target (necessary: composition never falls below a
    member's ε). Exhaustive up to :data:`MAX_EXHAUSTIVE_SUBSETS` candidates."""
    allowed = [i for i in range(k) if epsilons[i] <= target]
    if len(allowed) <= MAX_EXHAUSTIVE_SUBSETS:
        return [s for r in range(1, len(allowed) + 1) for s in itertools.combinations(allowed, r)]
    # Greedy: nested prefixes of the candidates ordered from least to most noisy, plus singles.
    order = sorted(allowed, key=lambda i: -epsilons[i])
    return [(i,) for i in allowed] + [tuple(order[:r]) for r in range(2, len(order) + 1)]


def _calibrate_lc_generic(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
) -> Calibration:
    k = len(candidates)
    all_records = all(isinstance(c, MechanismRecord) for c in candidates)
    usable = [
        i
        for i in range(k)
        if merge_utility is not None or all_records or isinstance(candidates[i], MechanismRecord)
    ]
    skipped = [
        f"{candidates[i].name!r} left out: a label-only candidate has no noise proxy "
        "(pass utilities to merge it)"
        for i in range(k)
        if i not in usable
    ]
    scored = []
    for members in _candidate_subsets(k, epsilons, target):
        if not set(members) <= set(usable):
            continue
        chosen = [candidates[i] for i in members]
        try:
            units = release_units(chosen)
        except RefusalError as refusal:
            skipped.append(str(refusal))
            continue
        weights = _embed(k, members, subset_weights(chosen))
        if merge_utility is not None:
            utility = float(merge_utility(weights))
        elif all(isinstance(c, MechanismRecord) for c in chosen):
            utility = -merged_noise_proxy(chosen, subset_weights(chosen))  # type: ignore[arg-type]
        else:  # every candidate is label-only: spending more is the only signal
            utility = max(epsilons[i] for i in members)
        scored.append((utility, members, units, weights))
    scored.sort(key=lambda item: (-item[0], len(item[1])))
    kind = (
        "validation accuracy"
        if merge_utility is not None
        else "noise proxy: −Σc²σ²/(Σc)² (SPEC §6)"
        if all_records or len(usable) < k
        else "ε spent (label-only candidates, no utilities given)"
    )
    certified = 0
    for utility, members, units, weights in scored:
        coarse = profiles.epsilon_for_delta(
            composed_pld(units, pld_mod.COARSE_DISCRETISATION), delta
        )
        if coarse > target + COARSE_MARGIN:
            continue
        report = account(candidates, "lc", weights, delta, gating_bound="generic")
        certified += 1
        if report.epsilon <= target:
            return Calibration(
                method="lc",
                target_epsilon=target,
                delta=delta,
                weights=weights,
                report=report,
                reachable_epsilon_range=(min(epsilons), _all_candidates_epsilon(candidates, delta)),
                utility=utility,
                utility_kind=kind,
                search={
                    "subsets_considered": len(scored),
                    "fine_certifications": certified,
                    "members": [candidates[i].name for i in members],
                    "skipped": skipped,
                },
            )
    # Nothing usable certified (e.g. only a label-only candidate meets the target): the most
    # private candidate alone always does.
    safest = int(np.argmin(epsilons))
    weights = _embed(k, (safest,), (1.0,))
    return Calibration(
        method="lc",
        target_epsilon=target,
        delta=delta,
        weights=weights,
        report=account(candidates, "lc", weights, delta, gating_bound="generic"),
        reachable_epsilon_range=(min(epsilons), _all_candidates_epsilon(candidates, delta)),
        utility=None,
        utility_kind=kind,
        search={
            "subsets_considered": len(scored),
            "fine_certifications": certified,
            "members": [candidates[safest].name],
            "skipped": skipped,
        },
    )


def _all_candidates_epsilon(candidates: Sequence[Candidate], delta: float) -> float:
    """ε of the joint release of every candidate: the top rung of the generic ladder."""
    try:
        units = release_units(candidates)
        return profiles.epsilon_for_delta(composed_pld(units, pld_mod.COARSE_DISCRETISATION), delta)
    except (RefusalError, ValueError):
        return max(candidate_bound(c, delta).epsilon for c in candidates)
