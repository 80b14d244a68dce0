"""The exact privacy of RS between Gaussian mechanisms centred on the same mean
(docs/design.md#mean-estimation, #random-selection).

RS over mean-estimation candidates releases X = μ̂ + σ_I·Z with a secret I ~ π: per coordinate
the output is the scale mixture P = Σπ_i N(0, σ_i²) against Q = Σπ_i N(1, σ_i²) for neighbours
(sensitivity 1). The mixture bound δ_RS(ε) = Σπ_i δ_i(ε) (joint convexity) is what an
observer who also learns I faces; the released value alone hides I, so its exact δ(ε) is
smaller. Here it is bracketed numerically:

* **upper (certified)**: the line is cut into bins of width h on [−R, 1 + R] (outside, all mass
  counts as privacy loss +∞). In each bin the masses P_b, Q_b are exact (normal CDFs) and the
  privacy loss L = log p/q lies in [l_b, u_b]: its values at the bin's ends ± M₂h²/8, where
  |L''(x)| ≤ M₂ = 1/σ_min² + max(x², (x−1)²)·(σ_min⁻² − σ_max⁻²)²/4 on the bin (each log
  density's second derivative is −E_w[σ_i⁻²] + Var_w(x/σ_i²) under the posterior weights w of
  the used components). Given P_b, Q_b and that range, the largest E_P[(1 − e^{ε−L})_+] over
  the bin is reached by two atoms at l_b and u_b with the bin's masses (the function is convex
  in e^{−L} and E_P[e^{−L}] = Q_b is fixed), so the sum over bins bounds δ(ε) from above.
* **lower**: the binned output is post-processing of X, so Σ_b (P_b − e^ε Q_b)_+ ≤ δ(ε).

Both directions (P against Q and Q against P) are evaluated and the larger δ taken. Rounding
in the CDF differences is below 1e-15 per bin; the bracket's width shows the precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp, ndtr

from dpmerge.accounting.gaussian import gaussian_delta

BINS = 200_000
TAIL_SIGMAS = 12.0  # the mass beyond 12 σ_max is below 1e-32


@dataclass(frozen=True)
class ExactBracket:
    """The exact ε of the mixture lies in [lower, upper] (upper is the certified value)."""

    lower: float
    upper: float


@dataclass(frozen=True)
class _Bins:
    edges: np.ndarray
    masses_p: np.ndarray  # (k, bins): component i's mass in each bin, centred at 0
    masses_q: np.ndarray  # the same, centred at 1
    tail_p: np.ndarray  # (k,): component mass outside the grid
    tail_q: np.ndarray


def _interval_mass(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Φ(b) − Φ(a) for a ≤ b, from the side where it does not cancel."""
    return np.where(a > 0, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))


class MixtureAccountant:
    """Exact hockey-stick bracket of Σπ_i N(0, σ_i²) against Σπ_i N(1, σ_i²) for any π."""

    def __init__(self, sigmas: Sequence[float], bins: int = BINS) -> None:
        self.sigmas = np.asarray(sigmas, float)
        radius = TAIL_SIGMAS * float(self.sigmas.max())
        edges = np.linspace(-radius, 1.0 + radius, bins + 1)
        s = self.sigmas[:, None]
        self.bins = _Bins(
            edges=edges,
            masses_p=_interval_mass(edges[:-1] / s, edges[1:] / s),
            masses_q=_interval_mass((edges[:-1] - 1) / s, (edges[1:] - 1) / s),
            tail_p=ndtr(-radius / self.sigmas) + ndtr(-(1 + radius) / self.sigmas),
            tail_q=ndtr(-(1 + radius) / self.sigmas) + ndtr(-radius / self.sigmas),
        )
        x = edges
        self._log_p = -0.5 * (x[None, :] / s) ** 2 - np.log(s)
        self._log_q = -0.5 * ((x[None, :] - 1) / s) ** 2 - np.log(s)
        reach = np.maximum.reduce(
            [np.abs(x[:-1]), np.abs(x[1:]), np.abs(x[:-1] - 1), np.abs(x[1:] - 1)]
        )
        self._curvature_terms = (np.diff(edges) ** 2 / 8, reach**2 / 4)

    def _profiles(self, weights: Sequence[float]):  # type: ignore[no-untyped-def]
        """δ(ε) functions, both directions: (certified upper), (binned lower)."""
        pi = np.asarray(weights, float)
        used = pi > 0
        log_pi = np.log(pi[used])[:, None]
        loss = logsumexp(self._log_p[used] + log_pi, axis=0) - logsumexp(
            self._log_q[used] + log_pi, axis=0
        )
        inner, outer = 1 / self.sigmas[used].min() ** 2, 1 / self.sigmas[used].max() ** 2
        square, reach = self._curvature_terms
        slack = square * (inner + reach * (inner - outer) ** 2)
        low = np.minimum(loss[:-1], loss[1:]) - slack
        high = np.maximum(loss[:-1], loss[1:]) + slack
        p = pi @ self.bins.masses_p
        q = pi @ self.bins.masses_q
        tails = (float(pi @ self.bins.tail_p), float(pi @ self.bins.tail_q))
        return (
            _two_point_profile(p, q, low, high, tails[0]),
            _two_point_profile(q, p, -high, -low, tails[1]),
        ), (_binned_profile(p, q), _binned_profile(q, p))

    def bracket(self, weights: Sequence[float], delta: float) -> ExactBracket:
        """The exact ε at ``delta`` of RS with probabilities ``weights``, bracketed."""
        uppers, lowers = self._profiles(weights)
        return ExactBracket(
            lower=max(_epsilon(profile, delta)[0] for profile in lowers),
            upper=max(_epsilon(profile, delta)[1] for profile in uppers),
        )

    def meets(self, weights: Sequence[float], epsilon: float, delta: float) -> bool:
        """Whether the certified (upper) δ(ε) is at most ``delta``."""
        uppers, _ = self._profiles(weights)
        return all(profile(epsilon) <= delta for profile in uppers)


def _two_point_profile(p, q, low, high, infinity):  # type: ignore[no-untyped-def]
    """δ(ε) of atoms: per bin, mass α at the loss ``high`` and p − α at ``low`` with
    α·e^{−high} + (p − α)·e^{−low} = q (the bin's masses kept); tail mass at +∞."""
    spread = np.maximum(high - low, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = np.where(p > 0, q / p, 0.0)
        # α/p = (1 − ratio·e^{low}) / (1 − e^{low − high}); one atom where the range is empty
        share = np.where(spread > 1e-12, (1 - ratio * np.exp(low)) / -np.expm1(-spread), 1.0)
    share = np.clip(np.nan_to_num(share, nan=1.0), 0.0, 1.0)
    sure = (q == 0) & (p > 0)  # no Q mass: the loss is +∞ here
    losses = np.concatenate([high, low])
    masses = np.concatenate([np.where(sure, 0, p * share), np.where(sure, 0, p * (1 - share))])
    infinity = infinity + float(p[sure].sum())

    def delta(epsilon: float) -> float:
        above = losses > epsilon
        return infinity + float(np.sum(masses[above] * -np.expm1(epsilon - losses[above])))

    return delta


def _binned_profile(p, q):  # type: ignore[no-untyped-def]
    def delta(epsilon: float) -> float:
        return float(np.sum(np.maximum(p - np.exp(epsilon) * q, 0.0)))

    return delta


def _epsilon(profile, delta: float, high: float = 64.0) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(low, high) within 1e-7 around the smallest ε with profile(ε) ≤ δ (δ(ε) decreases)."""
    if profile(0.0) <= delta:
        return 0.0, 0.0
    low = 0.0
    while profile(high) > delta:
        high *= 2
    while high - low > 1e-7:
        mid = 0.5 * (low + high)
        low, high = (low, mid) if profile(mid) <= delta else (mid, high)
    return low, high


def mixture_bound_epsilon(sigmas: Sequence[float], weights: Sequence[float], delta: float) -> float:
    """The paper's RS bound for Gaussian candidates: ε with Σπ_i·δ_i(ε) = δ, δ_i the exact
    Gaussian profile (docs/design.md#random-selection)."""

    def profile(epsilon: float) -> float:
        return sum(
            w * gaussian_delta(s, epsilon) for s, w in zip(sigmas, weights, strict=True) if w
        )

    return _epsilon(profile, delta)[1]


def dimension_lower_epsilon(
    sigmas: Sequence[float],
    weights: Sequence[float],
    delta: float,
    dimension: int,
    bins_along: int = 3000,
    bins_across: int = 1500,
) -> float:
    """A lower bound on the exact ε of RS between d-dimensional isotropic Gaussians (d ≥ 2).

    The release is the mixture of N(0, σ_i²I) against N(e₁, σ_i²I); (x₁, ‖x_⊥‖²) is a
    sufficient statistic, x₁ ~ N(0 or 1, σ_i²) and ‖x_⊥‖²/σ_i² ~ χ²(d−1) independent. Binning
    both is post-processing, so Σ_b (P_b − e^ε Q_b)_+ ≤ δ(ε): the ε returned (rounded down) is
    below the exact one. The norm across reveals σ_I more clearly as d grows."""
    from scipy.stats import chi2

    pi = np.asarray(weights, float)
    used = pi > 0
    s, pi = np.asarray(sigmas, float)[used], pi[used]
    radius = TAIL_SIGMAS * float(s.max())
    along = np.linspace(-radius, 1.0 + radius, bins_along + 1)
    free = dimension - 1
    low = float(s.min() ** 2 * chi2.ppf(1e-18, free))
    high = float(s.max() ** 2 * chi2.isf(1e-18, free))
    across = np.concatenate([[0.0], np.geomspace(max(low, 1e-300), high, bins_across), [np.inf]])
    a_p = _interval_mass(along[:-1] / s[:, None], along[1:] / s[:, None])
    a_q = _interval_mass((along[:-1] - 1) / s[:, None], (along[1:] - 1) / s[:, None])
    scaled = across[None, :] / s[:, None] ** 2
    b = np.diff(chi2.cdf(scaled, free), axis=1)
    b = np.where(scaled[:, :-1] > free, -np.diff(chi2.sf(scaled, free), axis=1), b)
    p = (a_p * pi[:, None]).T @ b
    q = (a_q * pi[:, None]).T @ b
    return max(
        _epsilon(_binned_profile(p.ravel(), q.ravel()), delta)[0],
        _epsilon(_binned_profile(q.ravel(), p.ravel()), delta)[0],
    )
