"""Rényi DP curves: ε(α) on dp_accounting's default grid of orders
(docs/design.md#accounting-primitives, docs/design.md#structured-bound).

* DP-SGD candidates and Gaussian mechanisms: dp_accounting's ``RdpAccountant``.
* The structured-LC surrogate N(0,1) vs Σ_S p_S·N(m_S,1), which dp_accounting's RDP accountant
  does not support: :func:`mixture_of_gaussians_rdp`, by log-space trapezoid quadrature on a
  grid that follows the integrand's peaks. Plain adaptive quadrature overflows once
  (α−1)·RDP exceeds ~709 and a fixed window misses the far peak at large α; both failure modes
  are avoided by summing log-integrand values with logsumexp over a grid that spans
  [−40, α·m_max + 40] (the modes of E_Q[(P/Q)^α] lie in [0, α·m_max]).
* Conversion to (ε, δ): dp_accounting's ``compute_epsilon`` (Canonne–Kamath–Steinke bound).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy.special import logsumexp

from dpmerge.accounting import file_cache
from dpmerge.accounting.records import MechanismRecord, PrivacyLabel
from dpmerge.errors import UnsupportedError

ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)
"""dp_accounting's default orders: 1.1–10.9 in steps of 0.1, 11–63, 128, 256, 512, 1024."""

QUADRATURE_SAFETY = 1e-6
"""Relative margin added to quadrature RDP values. The quadrature's measured error is
≤ 1e-8 relative (tests compare exact integer-order sums); the margin keeps it on the safe side."""

_TAIL = 40.0  # N(0,1) mass beyond 40 is e^-800: negligible at every order


def epsilon_from_rdp(rdp: np.ndarray | tuple[float, ...], delta: float) -> tuple[float, float]:
    """(ε, optimal order) for an RDP curve on :data:`ORDERS` at ``delta``."""
    epsilon, order = rdp_lib.compute_epsilon(ORDERS, np.asarray(rdp, float), delta)
    return float(epsilon), float(order)


def epsilon_from_rdp_function(
    rdp_at: Callable[[float], float], delta: float, stride: int = 8
) -> tuple[float, float]:
    """(ε, order) from an RDP curve evaluated lazily at a subset of :data:`ORDERS`.

    Any subset of orders gives a valid bound (ε is a minimum over orders), so evaluating fewer
    orders can only make ε larger, never unsafe. Evaluates every ``stride``-th order, then all
    orders next to the best one: ~25 evaluations instead of 156 for an expensive curve.
    """
    values: dict[int, float] = {}

    def epsilon_at(index: int) -> float:
        if index not in values:
            values[index] = rdp_at(ORDERS[index])
        order = ORDERS[index]
        return rdp_lib.compute_epsilon([order], [values[index]], delta)[0]

    coarse = [*range(0, len(ORDERS), stride), len(ORDERS) - 1]
    best = min(coarse, key=epsilon_at)
    local = range(max(0, best - stride + 1), min(len(ORDERS), best + stride))
    best = min(local, key=epsilon_at)
    return float(epsilon_at(best)), ORDERS[best]


def subsampled_gaussian_rdp(noise_multiplier: float, sample_rate: float, steps: int) -> np.ndarray:
    """RDP curve of ``steps`` compositions of the Poisson-subsampled Gaussian. At small σ and
    large q dp_accounting cannot evaluate some fractional orders near 1; it leaves them at +∞
    (excluded from the conversion to ε, so ε stays an upper bound) and logs a warning per order
    through absl, which is silenced here: the curve itself says which orders are missing.
    Kept in the file cache when it is on (:mod:`~dpmerge.accounting.file_cache`)."""
    key = (float(noise_multiplier), float(sample_rate), int(steps), tuple(ORDERS))
    stored = file_cache.read("rdp", key)
    if stored is not None and "rdp" in stored:
        return stored["rdp"]
    curve = _rdp_curve(*key[:3])
    file_cache.write("rdp", key, {"rdp": np.asarray(curve, dtype=np.float64)})
    return curve


def _rdp_curve(noise_multiplier: float, sample_rate: float, steps: int) -> np.ndarray:
    """The library's curve of ``SelfComposedDpEvent(PoissonSampledDpEvent(q, σ), steps)``:
    it composes that event as ``steps ×`` the one-step curve, computed here once per (σ, q)
    for every step count (a run's checkpoints, a calibration's trials)."""
    return steps * _one_step_rdp(noise_multiplier, sample_rate)


@lru_cache(maxsize=256)
def _one_step_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    accountant = rdp_lib.RdpAccountant(orders=ORDERS)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(
            dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
        )
    finally:
        absl.setLevel(level)
    curve = accountant.rdp
    curve.flags.writeable = False  # shared by every step count
    return curve


def gaussian_rdp(noise_multiplier: float) -> np.ndarray:
    """RDP curve of the Gaussian mechanism with sensitivity 1: α / (2σ²)."""
    return np.asarray(ORDERS) / (2.0 * noise_multiplier**2)


@lru_cache(maxsize=512)
def candidate_rdp(candidate: MechanismRecord | PrivacyLabel) -> tuple[float, ...]:
    """The candidate's RDP curve on :data:`ORDERS`; ``UnsupportedError`` for an (ε, δ) label,
    which has none.

    An RDP-curve label is interpolated onto the grid only where it is given exactly; orders the
    label does not list are set to +inf (no claim), never interpolated toward less privacy loss.
    """
    if isinstance(candidate, MechanismRecord):
        curve = subsampled_gaussian_rdp(
            candidate.noise_multiplier, candidate.sample_rate, candidate.steps
        )
        return tuple(curve.tolist())
    if not candidate.has_rdp:
        raise UnsupportedError(
            "rdp", f"candidate {candidate.name!r} has only an (ε, δ) label: no RDP curve"
        )
    given = dict(zip(candidate.rdp_orders or (), candidate.rdp_epsilons or (), strict=True))
    return tuple(float(given.get(a, np.inf)) for a in ORDERS)


def _log_trapezoid(log_values: np.ndarray, step: float) -> float:
    """log ∫ exp(g) for g sampled on a uniform grid (tails are negligible by construction)."""
    return float(logsumexp(log_values) + np.log(step))


def _mixture_log_ratio(x: np.ndarray, log_p: np.ndarray, m: np.ndarray) -> np.ndarray:
    """log P(x)/Q(x) = LSE_S(log p_S + m_S·x − m_S²/2)."""
    return logsumexp(log_p[:, None] + m[:, None] * x[None, :] - 0.5 * m[:, None] ** 2, axis=0)


@lru_cache(maxsize=65536)
def mixture_of_gaussians_rdp_at(
    sensitivities: tuple[float, ...], probabilities: tuple[float, ...], alpha: float
) -> float:
    """Per-step RDP of order α of the surrogate pair Q = N(0,1), P = Σ_S p_S·N(m_S,1)
    (docs/design.md#structured-bound): max(D_α(P‖Q), D_α(Q‖P)), inflated by
    :data:`QUADRATURE_SAFETY`."""
    m = np.asarray(sensitivities, float)
    p = np.asarray(probabilities, float)
    keep = p > 0
    m, log_p = m[keep], np.log(p[keep])
    m_max = float(m.max())
    if m_max == 0.0:
        return 0.0
    step = min(0.05, 0.25 / m_max)
    log_norm = -0.5 * np.log(2 * np.pi)
    # D_α(P‖Q) = log E_Q[(P/Q)^α] / (α−1); the integrand's peaks lie in [0, α·m_max].
    x = np.arange(-_TAIL, alpha * m_max + _TAIL + step, step)
    forward = _log_trapezoid(log_norm - 0.5 * x**2 + alpha * _mixture_log_ratio(x, log_p, m), step)
    # D_α(Q‖P) = log E_Q[(Q/P)^(α−1)] / (α−1); peaks in [−(α−1)·m_max, 0].
    x = np.arange(-(alpha - 1) * m_max - _TAIL, _TAIL + step, step)
    backward = _log_trapezoid(
        log_norm - 0.5 * x**2 - (alpha - 1) * _mixture_log_ratio(x, log_p, m), step
    )
    return max(forward, backward, 0.0) / (alpha - 1) * (1.0 + QUADRATURE_SAFETY)


def mixture_of_gaussians_rdp(
    sensitivities: Sequence[float], probabilities: Sequence[float]
) -> np.ndarray:
    """:func:`mixture_of_gaussians_rdp_at` at every order of :data:`ORDERS`."""
    key = (tuple(float(v) for v in sensitivities), tuple(float(v) for v in probabilities))
    return np.array([mixture_of_gaussians_rdp_at(*key, alpha) for alpha in ORDERS])
