"""RS calibration (docs/design.md#random-selection, docs/design.md#calibration): the linear
programme max Σ π_i·u_i s.t. Σ π_i·δ_i(ε*) ≤ δ* over the simplex. Its optimum is a vertex: one
candidate, or two mixed so that the constraint is tight."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.account import account
from dpmerge.accounting.calibrated import LP_SLACK, Calibration
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.weights import subset_utility
from dpmerge.errors import RefusalError, UnsupportedError
from dpmerge.vocabulary import Method

MAX_GUARD_STEPS = 20
RS_PROXY_KIND = "noise proxy: −σ²/T (docs/design.md#calibration)"


def best_two_point_mixture(
    utilities: Sequence[float], costs: Sequence[float], budget: float
) -> tuple[float, ...] | None:
    """Vertex enumeration of max Σπ_i·u_i s.t. Σπ_i·cost_i ≤ budget, π on the simplex.

    The optimum of this LP is a vertex: one item with cost ≤ budget, or two items mixed so the
    constraint is tight. ``None`` when no item fits the budget.
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


def _utilities(
    candidates: Sequence[Candidate], epsilons: Sequence[float]
) -> tuple[list[float], str]:
    """The programme's data-independent utilities, read off the records: −σ_i²/T_i (less
    noise per step of training is better), or the ε spent for label-only candidates. Never
    accuracies: π steered by them would depend on every candidate consulted
    (docs/design.md#calibration)."""
    if all(isinstance(c, MechanismRecord) for c in candidates):
        # −σ²/T (less noise per step of training is better), the utility of a one-run merge.
        return [subset_utility([c]) for c in candidates], RS_PROXY_KIND  # type: ignore[list-item]
    finite = [e for e in epsilons if math.isfinite(e)]
    ceiling = max(finite) if finite else 0.0
    return [min(e, ceiling) for e in epsilons], "ε spent (label-only candidates)"


def calibrate_rs(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
) -> Calibration:
    """The RS programme under PLD (every candidate has a PLD), else under RDP, certified."""
    u, utility_kind = _utilities(candidates, epsilons)
    try:
        plds = [pld_mod.candidate_pld(c, pld_mod.FINE_DISCRETISATION) for c in candidates]
        costs = [float(profiles.delta_for_epsilon(p, target)[0]) for p in plds]
        pi = best_two_point_mixture(u, costs, delta * (1 - LP_SLACK))
        constraint = "PLD: Σ π_i·δ_i(ε*) ≤ δ*"
    except UnsupportedError:  # an RDP-only label or a PLD beyond the grid: RDP, per order
        try:
            curves = [rdp_mod.candidate_rdp(c) for c in candidates]
        except UnsupportedError:
            raise RefusalError(
                "RS needs every candidate's PLD or every candidate's RDP curve"
            ) from None
        pi = rs_programme_rdp(curves, u, target, delta)
        constraint = "RDP: Σ π_i·exp((α−1)·ε_i(α)) ≤ exp((α−1)·budget(α)), best order"
    safest = int(np.argmin(epsilons))
    if pi is None:  # only when float rounding puts every candidate on the boundary
        pi = tuple(1.0 if n == safest else 0.0 for n in range(len(candidates)))
    report = account(candidates, Method.RS, pi, delta)
    for _ in range(MAX_GUARD_STEPS):  # guard: shift mass to the most private candidate
        if report.epsilon <= target:
            break
        pi = tuple(p * 0.99 + (0.01 if n == safest else 0.0) for n, p in enumerate(pi))
        report = account(candidates, Method.RS, pi, delta)
    else:
        pi = tuple(1.0 if n == safest else 0.0 for n in range(len(candidates)))
        report = account(candidates, Method.RS, pi, delta)
    return Calibration(
        method=Method.RS,
        target_epsilon=target,
        delta=delta,
        weights=pi,
        report=report,
        reachable_epsilon_range=(min(epsilons), max(epsilons)),
        utility=float(np.dot(pi, u)),
        utility_kind=utility_kind,
        search={"programme": constraint, "mixes": sum(p > 0 for p in pi)},
    )
