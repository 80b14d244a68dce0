"""The Gaussian mechanism with sensitivity 1 (mean estimation, docs/design.md#mean-estimation).

Candidate i releases μ̂ + N(0, σ_i²Δ²I); an LC with Σλ = 1 is exactly a Gaussian mechanism with
noise multiplier σ_LC = sqrt(Σ λ_i²σ_i²). Its privacy profile is known in closed form (Balle &
Wang 2018, eq. 6; the Gaussian's PLD is itself Gaussian), so "PLD" here is the exact profile,
computed by dp_accounting's ``gaussian_mechanism``; RDP is α/(2σ²). Calibrations round σ up.
"""

from __future__ import annotations

import math

from dp_accounting import gaussian_mechanism
from scipy.stats import norm

from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import Accountant


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
    """Exact δ(ε) = Φ(1/(2σ) − εσ) − e^ε·Φ(−1/(2σ) − εσ), evaluated in log space."""
    t = epsilon * noise_multiplier + 1 / (2 * noise_multiplier)
    x = norm.logcdf(1 / noise_multiplier - t)
    y = epsilon + norm.logcdf(-t)
    return math.exp(x + math.log1p(-math.exp(y - x))) if y < x else 0.0


def gaussian_epsilon(noise_multiplier: float, delta: float, accountant: Accountant) -> float:
    if accountant == "pld":
        return float(gaussian_mechanism.get_epsilon_gaussian(noise_multiplier, delta))
    return rdp_mod.epsilon_from_rdp(rdp_mod.gaussian_rdp(noise_multiplier), delta)[0]


def gaussian_noise_for_epsilon(
    target_epsilon: float, delta: float, accountant: Accountant, rel_tol: float = 1e-9
) -> float:
    """Smallest σ (to ``rel_tol``, rounded up) whose ε ≤ target under ``accountant``."""
    low, high = 1e-2, 1.0
    while gaussian_epsilon(high, delta, accountant) > target_epsilon:
        low, high = high, high * 2
    while low > 1e-6 and gaussian_epsilon(low, delta, accountant) <= target_epsilon:
        low, high = low / 2, low
    while high / low - 1 > rel_tol:
        mid = (low * high) ** 0.5
        if gaussian_epsilon(mid, delta, accountant) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high
