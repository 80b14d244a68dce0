"""One candidate's ε, and the noise multiplier that meets a target
(docs/design.md#accounting-primitives)."""

from __future__ import annotations

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
    """Smallest noise multiplier (within ``rel_tol``) whose certified PLD ε ≤ target.

    Bisection at the coarse discretisation brackets the answer; bisection at the fine one then
    locates it, so the returned σ spends the target up to ``rel_tol`` (the coarse grid alone
    overstates small ε and would leave up to a few percent of the target unspent). The
    returned σ is the noisier end of the final bracket: certified at the fine discretisation,
    never less noise than the target allows.
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
    while fine(high) > target_epsilon:  # the fine bracket: fine(low) > target ≥ fine(high)
        low, high = high, high * (1 + COARSE_BRACKET)
    while low > 0.05 and fine(low) <= target_epsilon:
        low, high = low / (1 + COARSE_BRACKET), low
    while high / low - 1 > rel_tol:
        mid = (low * high) ** 0.5
        low, high = (low, mid) if fine(mid) <= target_epsilon else (mid, high)
    return high
