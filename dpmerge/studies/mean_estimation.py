"""Mean estimation (docs/design.md#mean-estimation, docs/design.md#studies): the best RS and LC
mean-squared error at each target.

Candidate i releases μ̂ + N(0, σ_i²Δ²I). Per coordinate, in units of Δ² and without clipping
bias: MSE_LC = Σ λ_i²σ_i² and MSE_RS = Σ π_i σ_i². LC is exactly the Gaussian mechanism with
σ_LC = sqrt(Σλ²σ²), which reaches every value in [(Σσ_i⁻²)^−½, max σ_i]; so the best LC at a
target is σ_LC = max(σ*(target), (Σσ_i⁻²)^−½) when σ*(target) ≤ max σ_i, else infeasible.
The best RS solves the linear programme of docs/design.md#random-selection with utilities −σ_i².
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import Accountant
from dpmerge.accounting.calibrated import LP_SLACK
from dpmerge.accounting.gaussian import gaussian_delta, gaussian_noise_for_epsilon
from dpmerge.accounting.rs_calibration import best_two_point_mixture, rs_programme_rdp
from dpmerge.errors import RecordError

MAX_SIGMA = 1e4
"""Beyond this the Gaussian profile underflows; such noise releases nothing anyway."""
MAX_TARGET = 1e3


def best_lc_mse(
    sigmas: Sequence[float], target: float, delta: float, accountant: Accountant
) -> float | None:
    needed = gaussian_noise_for_epsilon(target, delta, accountant)
    if needed > max(sigmas):
        return None
    floor = 1.0 / math.sqrt(sum(s**-2 for s in sigmas))
    return max(needed, floor) ** 2


def best_rs_weights(
    sigmas: Sequence[float], target: float, delta: float, accountant: Accountant
) -> tuple[float, ...] | None:
    """π of the best RS under the mixture bound (the linear programme), None if infeasible."""
    utilities = [-(s**2) for s in sigmas]
    if accountant == "pld":
        costs = [gaussian_delta(s, target) for s in sigmas]
        return best_two_point_mixture(utilities, costs, delta * (1 - LP_SLACK))
    return rs_programme_rdp([rdp_mod.gaussian_rdp(s) for s in sigmas], utilities, target, delta)


def best_rs_mse(
    sigmas: Sequence[float], target: float, delta: float, accountant: Accountant
) -> float | None:
    pi = best_rs_weights(sigmas, target, delta, accountant)
    return None if pi is None else float(np.dot(pi, [s**2 for s in sigmas]))


def lc_weights_for_mse(sigmas: Sequence[float], mse: float) -> tuple[float, ...]:
    """λ on the simplex with Σλ_i²σ_i² = ``mse``: along λ(u) = (1−u)·inverse-variance + u·(one-
    hot on the largest σ), whose variance rises from the floor (Σσ_i⁻²)⁻¹ to max σ² in u."""
    s = np.asarray(sigmas, float)
    ivw = s**-2 / np.sum(s**-2)
    corner = (s == s.max()).astype(float) / np.sum(s == s.max())

    def variance(u: float) -> float:
        lam = (1 - u) * ivw + u * corner
        return float(np.sum(lam**2 * s**2))

    if not variance(0.0) * (1 - 1e-9) <= mse <= variance(1.0) * (1 + 1e-9):
        raise RecordError(f"MSE {mse} outside the LC range [{variance(0.0)}, {variance(1.0)}]")
    low, high = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if variance(mid) < mse else (low, mid)
    return tuple(float(v) for v in (1 - high) * ivw + high * corner)
