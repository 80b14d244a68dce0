"""One candidate's ε, and the noise multiplier that meets a target
(docs/design.md#accounting-primitives)."""

from __future__ import annotations

import math
from functools import lru_cache

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import PairBound, bound_from_curves
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.errors import RecordError, RefusalError
from dpmerge.vocabulary import BoundKind

MAX_CALIBRATED_NOISE = 1e4
COARSE_BRACKET = 0.02
"""Relative width of the coarse bracket handed to the fine search (the coarse and fine grids'
σ roots differed by under 2 % in every case measured; the fine search widens it if not)."""


@lru_cache(maxsize=2048)
def candidate_bound(
    candidate: Candidate, delta: float, discretisation: float = pld_mod.FINE_DISCRETISATION
) -> PairBound:
    """ε of one candidate under PLD and RDP at ``delta`` (kind ``candidate``)."""
    assumptions: tuple[str, ...] = ()
    if not isinstance(candidate, MechanismRecord):
        assumptions = (f"privacy label of {candidate.name!r} taken as given (training unknown)",)
    return bound_from_curves(
        BoundKind.CANDIDATE,
        delta,
        pld=lambda: profiles.epsilon_for_delta(
            pld_mod.candidate_pld(candidate, discretisation), delta
        ),
        rdp=lambda: rdp_mod.candidate_rdp(candidate),
        discretisation=discretisation,
        assumptions=assumptions,
    )


def dpsgd_epsilon_pld(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> float:
    """PLD ε of ``steps`` Poisson-subsampled Gaussian steps (pessimistic, connect-the-dots)."""
    return profiles.epsilon_for_delta(
        pld_mod.subsampled_gaussian_pld(noise_multiplier, sample_rate, steps, discretisation),
        delta,
    )


@lru_cache(maxsize=256)
def noise_multiplier_for_epsilon(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, rel_tol: float = 1e-4
) -> float:
    """A noise multiplier whose certified PLD ε ≤ target and spends the target to within
    ``rel_tol`` (in σ, or in ε).

    Bisection at the coarse discretisation brackets the answer; regula falsi at the fine one
    then locates it (the coarse grid alone overstates small ε and would leave up to a few
    percent of the target unspent). The returned σ is the noisier end of the final bracket:
    certified at the fine discretisation, never less noise than the target allows.
    """
    if not target_epsilon > 0:
        raise RecordError(f"target ε must be positive, got {target_epsilon}")

    def coarse(sigma: float) -> float:
        return dpsgd_epsilon_pld(sigma, sample_rate, steps, delta, pld_mod.COARSE_DISCRETISATION)

    def fine(sigma: float) -> float:
        return dpsgd_epsilon_pld(sigma, sample_rate, steps, delta)

    low, high = 0.3, 1.0
    while coarse(high) > target_epsilon:
        low, high = high, high * 2
        if high > MAX_CALIBRATED_NOISE:
            raise RefusalError(
                f"no noise multiplier below {MAX_CALIBRATED_NOISE:g} reaches ε = "
                f"{target_epsilon} at δ = {delta:g} with q = {sample_rate:g} and {steps} steps"
            )
    while low > 0.05 and coarse(low) <= target_epsilon:
        low, high = low / 2, low
    while high / low - 1 > COARSE_BRACKET:
        mid = (low * high) ** 0.5
        low, high = (low, mid) if coarse(mid) <= target_epsilon else (mid, high)
    # The fine bracket: fine(low) > target ≥ fine(high), then regula falsi (Illinois) on
    # log ε against log σ, where ε(σ) is smooth and decreasing: a few fine evaluations.
    e_high, step = fine(high), 1 + COARSE_BRACKET
    while e_high > target_epsilon:
        low, high, step = high, high * step, step**2
        e_high = fine(high)
    e_low, step = fine(low), 1 + COARSE_BRACKET
    while low > 0.05 and e_low <= target_epsilon:
        high, e_high, low, step = low, e_low, low / step, step**2
        e_low = fine(low)
    goal, side = math.log(target_epsilon), 0
    while high / low - 1 > rel_tol and target_epsilon - e_high > rel_tol * target_epsilon:
        f_low, f_high = math.log(e_low) - goal, math.log(e_high) - goal
        share = f_low / (f_low - f_high) if f_low != f_high else 0.5
        mid = math.exp(math.log(low) + min(max(share, 0.01), 0.99) * math.log(high / low))
        e_mid = fine(mid)
        if e_mid <= target_epsilon:
            high, e_high = mid, e_mid
            e_low = math.exp(goal + (math.log(e_low) - goal) / 2) if side == -1 else e_low
            side = -1
        else:
            low, e_low = mid, e_mid
            e_high = math.exp(goal + (math.log(e_high) - goal) / 2) if side == 1 else e_high
            side = 1
    return high
