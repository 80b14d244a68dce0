"""Privacy loss distributions (docs/design.md#accounting-primitives): pessimistic,
connect-the-dots, cached.

Every PLD here is a pessimistic estimate: its δ(ε) upper-bounds the mechanism's hockey-stick
divergence, so ε read from it never rounds toward less privacy loss.

Mixture-of-Gaussians PLDs (the structured LC surrogate, docs/design.md#structured-bound) are
built by our own
vectorised connect-the-dots construction, :func:`mixture_of_gaussians_pld`. dp_accounting 0.6.0
inverts the mixture's privacy loss with a recursive scalar bisection in Python (1.5–14 s per
PLD at discretisation 1e-4). We compute the same hockey-stick values δ(ε_j) on the same ε grid,
with the library's own CDF formulas and truncation bounds, but invert the privacy loss with a
vectorised, bracketed Newton iteration, and hand the values to the library's public
``create_pmf_pessimistic_connect_dots_fixed_gap``. The result is tested against
``from_mixture_gaussian_mechanism`` (``tests/accounting/test_mixture.py``); dp-accounting is pinned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.common import DifferentialPrivacyParameters
from dp_accounting.pld.privacy_loss_mechanism import (
    AdjacencyType,
    GaussianPrivacyLoss,
    MixtureGaussianPrivacyLoss,
)
from scipy import fft

from dpmerge.accounting import file_cache
from dpmerge.accounting.records import MechanismRecord, PrivacyLabel
from dpmerge.errors import UnsupportedError

PLD = pld_lib.PrivacyLossDistribution

FINE_DISCRETISATION = 1e-4
"""Value discretisation interval of every certified ε (docs/design.md#accounting-primitives)."""
COARSE_DISCRETISATION = 1e-3
"""Discretisation used only to steer searches; never certifies (docs/design.md#calibration)."""

MAX_PLD_LENGTH = 2**24
"""Largest composed PLD grid built (16.7 M points: ~0.5 GB with the FFT's work arrays). A larger
grid means an ε far beyond any useful range; the PLD accountant refuses it
(``UnsupportedError``) and the RDP bound stands alone."""

_NEWTON_MAX_ITERATIONS = 300
_CONTINUATION_SIZE = 4096
_CONTINUATION_STRIDE = 64


def subsampled_gaussian_pld(
    noise_multiplier: float, sample_rate: float, steps: int, discretisation: float
) -> PLD:
    """PLD of ``steps`` compositions of the Poisson-subsampled Gaussian (add-or-remove-one).

    With :func:`set_disk_cache` the result is also kept as a file and read back by later
    processes (a policy merge runs in a fresh process each time)."""
    key = (float(noise_multiplier), float(sample_rate), int(steps), float(discretisation))
    return disk_cached(key, lambda: self_compose(_one_step(*key[:2], discretisation), steps))


@lru_cache(maxsize=64)
def _one_step(noise_multiplier: float, sample_rate: float, discretisation: float) -> PLD:
    """One Poisson-subsampled Gaussian step: the costly part of a candidate's PLD, shared by
    its checkpoints and by step counts that differ (PLDs are never mutated).

    dp_accounting's ``from_gaussian_mechanism(σ, sampling_prob=q, pessimistic_estimate=True,
    use_connect_dots=True)``, built the way the library builds it (its mechanism, its
    connect-the-dots bounds and grid, its public ``create_pmf_pessimistic_connect_dots_fixed_gap``)
    but with δ(ε) on the grid computed by :func:`_subsampled_gaussian_deltas`: the library
    inverts the privacy loss one grid point at a time in Python (0.23 s of scalar calls per
    step PLD). Tested bit-for-bit equal to the library's PLD."""
    if sample_rate == 1.0:  # symmetric, and no subsampling to invert: the library's own
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=noise_multiplier,
            value_discretization_interval=discretisation,
            pessimistic_estimate=True,
            use_connect_dots=True,
        )
    pmfs = []
    for adjacency in (AdjacencyType.REMOVE, AdjacencyType.ADD):
        mechanism = GaussianPrivacyLoss(
            noise_multiplier,
            sensitivity=1.0,
            pessimistic_estimate=True,
            sampling_prob=sample_rate,
            adjacency_type=adjacency,
        )
        bounds = mechanism.connect_dots_bounds()
        lower = math.floor(bounds.epsilon_lower / discretisation)
        upper = math.ceil(bounds.epsilon_upper / discretisation)
        epsilons = np.arange(lower, upper + 1) * discretisation
        deltas = _subsampled_gaussian_deltas(mechanism, epsilons)
        pmfs.append(
            pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
                discretisation, lower, upper, deltas
            )
        )
    return PLD(*pmfs)


def _subsampled_gaussian_deltas(mechanism: GaussianPrivacyLoss, epsilons: np.ndarray) -> np.ndarray:
    """``mechanism.get_delta_for_epsilon(epsilons)`` for a subsampled (q < 1) Gaussian with
    sensitivity 1 in the ADD or REMOVE direction: the library's regions, closed-form inverse
    privacy loss and CDFs, the same float operations in the same order, over the whole grid at
    once (``log_a_times_exp_b_plus_c(1/q, ±ε, 1 − 1/q)`` takes its ``c < 0`` branch)."""
    q, variance = mechanism.sampling_prob, mechanism._standard_deviation**2
    remove = mechanism.adjacency_type == AdjacencyType.REMOVE
    edge = math.log(1 - q) if remove else -math.log(1 - q)
    deltas = np.zeros_like(epsilons, dtype=float)
    if remove:
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    else:
        inverse = epsilons < -math.log1p(-q)
    targets = epsilons[inverse]
    # math.isclose(ε, edge): the library's inverse is at ±∞ there
    at_edge = np.abs(targets - edge) <= 1e-09 * np.maximum(np.abs(targets), abs(edge))
    # the privacy loss without subsampling, log(exp(±ε)/q + 1 − 1/q), by the library's
    # log_a_times_exp_b_plus_c(a, b, c), which raises outside its domain (as here)
    a, c = 1 / q, 1 - 1 / q
    b = targets if remove else -targets
    d = b + np.log(a)
    log_minus_c = np.log(-c)
    beyond = (targets <= edge) if remove else (targets > edge)
    if np.any(~at_edge & (beyond | ((b != 0) & (log_minus_c >= d)))):
        raise ArithmeticError("subsampled Gaussian: a grid point outside the inverse's domain")
    with np.errstate(divide="ignore", invalid="ignore"):
        loss = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(log_minus_c - d)))
    # the library's inverse without subsampling at sensitivity 1: −1/2 − ℓ·σ² (REMOVE), and
    # 1 + that at −ℓ (ADD)
    x = -0.5 - loss * variance if remove else 1.0 + (-0.5 - (-loss) * variance)
    x = np.where(at_edge, math.inf if remove else -math.inf, x)
    deltas[inverse] = mechanism.mu_upper_cdf(x) - np.exp(targets + mechanism.mu_lower_log_cdf(x))
    return np.clip(deltas, 0, 1)


# --- optional file cache (dpmerge.accounting.file_cache) ---------------------------------
_CACHE_KIND = "sg"


def set_disk_cache(directory: str | Path | None) -> None:
    """Keep subsampled-Gaussian PLDs, their compositions and RDP curves as files in
    ``directory`` (``None``: memory only; :mod:`~dpmerge.accounting.file_cache`)."""
    file_cache.set_directory(directory)


def disk_cached(key: tuple[Any, ...], build: Callable[[], PLD]) -> PLD:
    """``build()``, kept in the file cache and read back by later processes. ``key`` must name
    every input of ``build``."""
    cached = _read_cached(key)
    if cached is not None:
        return cached
    result = build()
    _write_cached(key, result)
    return result


def _cache_path(key: tuple[Any, ...]) -> Path | None:
    return file_cache.path(_CACHE_KIND, key)


def _read_cached(key: tuple[Any, ...]) -> PLD | None:
    stored = file_cache.read(_CACHE_KIND, key)
    if stored is None:
        return None
    try:
        pmfs = [
            pld_pmf.DensePLDPmf(
                float(stored["discretization"]),
                int(stored[f"{side}_lower_loss"]),
                stored[f"{side}_probs"].copy(),
                float(stored[f"{side}_infinity_mass"]),
                bool(stored["pessimistic"]),
            )
            for side in ("remove", "add")
        ]
        symmetric = bool(stored["symmetric"])
    except KeyError:
        return None
    return PLD(pmfs[0], None if symmetric else pmfs[1])


def _write_cached(key: tuple[Any, ...], pld: PLD) -> None:
    sides = {"remove": pld._pmf_remove, "add": pld._pmf_add}
    if not all(isinstance(p, pld_pmf.DensePLDPmf) for p in sides.values()):
        return
    arrays: dict[str, Any] = {
        "discretization": np.float64(sides["remove"]._discretization),
        "pessimistic": np.bool_(sides["remove"]._pessimistic_estimate),
        "symmetric": np.bool_(pld._symmetric),
    }
    for side, pmf in sides.items():
        arrays[f"{side}_lower_loss"] = np.int64(pmf._lower_loss)
        arrays[f"{side}_probs"] = np.asarray(pmf._probs, dtype=np.float64)
        arrays[f"{side}_infinity_mass"] = np.float64(pmf._infinity_mass)
    file_cache.write(_CACHE_KIND, key, arrays)


@lru_cache(maxsize=512)
def candidate_pld(candidate: MechanismRecord | PrivacyLabel, discretisation: float) -> PLD:
    """The candidate's PLD: from its record, or the worst case of its (ε, δ) label
    (docs/design.md#mechanism-record).

    Raises ``UnsupportedError`` for an RDP-only label, which has no PLD.
    """
    if isinstance(candidate, MechanismRecord):
        return subsampled_gaussian_pld(
            candidate.noise_multiplier, candidate.sample_rate, candidate.steps, discretisation
        )
    if candidate.epsilon is None or candidate.delta is None:
        raise UnsupportedError("pld", f"candidate {candidate.name!r} has only an RDP label: no PLD")
    return pld_lib.from_privacy_parameters(
        DifferentialPrivacyParameters(epsilon=candidate.epsilon, delta=candidate.delta),
        value_discretization_interval=discretisation,
    )


def _self_convolve_bounds(
    probs: np.ndarray, times: int, tail_mass_truncation: float
) -> tuple[int, int]:
    """dp_accounting's ``compute_self_convolve_bounds``: Chernoff bounds at the same 40 orders,
    each log moment-generating function by plain numpy over the positive entries (the library's
    40 ``logsumexp`` calls take longer than the FFT itself)."""
    size = probs.size
    upper, lower = (size - 1) * times, 0
    if tail_mass_truncation == 0:
        return lower, upper
    positive = probs > 0
    support = np.flatnonzero(positive).astype(float)
    log_probs = np.log(probs[positive])
    slack = math.log(2 / tail_mass_truncation)
    for order in (np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size).tolist():
        exponents = order * support + log_probs
        top = exponents.max()
        log_mgf = top + math.log(np.exp(exponents - top).sum())
        bound = (times * log_mgf + slack) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    return lower, upper


def _self_compose_pmf(
    pmf: pld_pmf.PLDPmf, times: int, tail_mass_truncation: float
) -> pld_pmf.PLDPmf:
    """``DensePLDPmf.self_compose``: FFT power within the truncation bounds, the truncated tail
    mass moved to +∞ (pessimistic)."""
    dense = pmf.to_dense_pmf()
    probs = np.asarray(dense._probs, float)
    lower, upper = _self_convolve_bounds(probs, times, tail_mass_truncation)
    length = upper - lower + 1
    if length > MAX_PLD_LENGTH:
        raise UnsupportedError(
            "pld",
            f"the composed PLD would need {length:.3g} grid points (limit {MAX_PLD_LENGTH:.3g}): "
            "ε is far beyond any useful range; only the RDP bound is computed",
        )
    fast = fft.next_fast_len(max(length, probs.size))
    powered = np.real(fft.ifft(fft.fft(probs, fast) ** times))
    out = np.roll(powered, -lower)[:length]
    infinity = tail_mass_truncation - math.expm1(times * math.log1p(-dense._infinity_mass))
    return pld_pmf.DensePLDPmf(
        dense._discretization,
        dense._lower_loss * times + lower,
        out,
        infinity,
        dense._pessimistic_estimate,
    )


def self_compose(pld: PLD, times: int, tail_mass_truncation: float = 1e-15) -> PLD:
    """``pld.self_compose(times)``, faster (see :func:`_self_convolve_bounds`); tested equal to
    the library's result."""
    if times == 1:
        return pld
    remove = _self_compose_pmf(pld._pmf_remove, times, tail_mass_truncation)
    if pld._symmetric:
        return PLD(remove)
    return PLD(remove, _self_compose_pmf(pld._pmf_add, times, tail_mass_truncation))


# --------------------------------------------------------------------------------------------
# Mixture of Gaussians: std 1 noise, sensitivity m_S with probability p_S
# (docs/design.md#structured-bound).


def _merge_components(
    sensitivities: np.ndarray, probabilities: np.ndarray
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Drop zero-probability components and merge equal sensitivities (rounded to 1e-12)."""
    keep = probabilities > 0
    keys = np.round(sensitivities[keep], 12)
    merged: dict[float, float] = {}
    for key, p in zip(keys.tolist(), probabilities[keep].tolist(), strict=True):
        merged[key] = merged.get(key, 0.0) + p
    order = sorted(merged)
    return tuple(order), tuple(merged[k] for k in order)


class _MixtureLoss:
    """The privacy loss ℓ(x) of N(0,1) vs Σ p_S·N(m_S,1) in one adjacency direction, with the
    derivative the Newton steps need. Same formula as dp_accounting's ``privacy_loss``:
    REMOVE: ℓ(x) = log Σ p_S·exp(−m_S²/2 − m_S·x);  ADD: ℓ(x) = −log Σ p_S·exp(−m_S²/2 + m_S·x).
    Both are decreasing in x; REMOVE is convex, ADD concave.
    """

    def __init__(self, sens: np.ndarray, probs: np.ndarray, adjacency: AdjacencyType) -> None:
        self.sign = -1.0 if adjacency == AdjacencyType.REMOVE else 1.0
        self.outer = 1.0 if adjacency == AdjacencyType.REMOVE else -1.0
        self.sens = sens
        self.constants = np.log(probs) - 0.5 * sens**2

    def value_and_slope(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Components along axis 0: reductions over a handful of rows stay vectorised over x.
        summands = self.constants[:, None] + self.sign * self.sens[:, None] * x[None, :]
        top = summands.max(axis=0)
        weights = np.exp(summands - top)
        total = weights.sum(axis=0)
        value = top + np.log(total)
        slope = self.sign * (self.sens @ weights) / total
        return self.outer * value, self.outer * slope


def _inverse_privacy_losses(
    loss: _MixtureLoss, targets: np.ndarray, guess_low: np.ndarray, guess_high: np.ndarray
) -> np.ndarray:
    """x with ℓ(x) = target for each target: safeguarded Newton (a Newton step when it stays
    inside the shrinking bracket, else bisection), vectorised over targets.

    ``guess_low``/``guess_high`` are per-target starting values; a global bracket around all of
    them is widened until it provably contains every root (ℓ is monotone).
    """
    low, high = float(guess_low.min()), float(guess_high.max())
    span = max(high - low, 1e-3)
    while loss.value_and_slope(np.array([low]))[0][0] < targets.max():
        low -= span
        span *= 2
    while loss.value_and_slope(np.array([high]))[0][0] > targets.min():
        high += span
        span *= 2
    lo, hi = np.full(targets.shape, low), np.full(targets.shape, high)
    if targets.size > _CONTINUATION_SIZE:
        # Continuation: solve every k-th target, interpolate starting points for the rest (the
        # roots are monotone in the target); Newton then needs two or three steps each.
        sub = np.unique(np.r_[np.arange(0, targets.size, _CONTINUATION_STRIDE), targets.size - 1])
        roots = _inverse_privacy_losses(loss, targets[sub], guess_low[sub], guess_high[sub])
        x = np.clip(np.interp(targets, targets[sub], roots), low, high)
    else:
        # Newton approaches the root of a convex decreasing ℓ (REMOVE) from the left without
        # overshooting, and of a concave one (ADD) from the right: start on that side.
        start = np.clip(guess_low if loss.outer > 0 else guess_high, low, high)
        wrong_side = (loss.value_and_slope(start)[0] < targets) == (loss.outer > 0)
        x = np.where(wrong_side, low if loss.outer > 0 else high, start)
    active = np.ones(targets.shape, dtype=bool)
    step_before_last = hi - lo
    last_step = hi - lo
    for _ in range(_NEWTON_MAX_ITERATIONS):
        idx = np.flatnonzero(active)
        xa = x[idx]
        value, slope = loss.value_and_slope(xa)
        excess = value - targets[idx]
        right_of_root = excess < 0  # ℓ is decreasing: ℓ(x) < target means x > root
        hi[idx] = np.where(right_of_root, xa, hi[idx])
        lo[idx] = np.where(right_of_root, lo[idx], xa)
        with np.errstate(divide="ignore", invalid="ignore"):
            newton = xa - excess / slope
        # Newton where it stays inside the bracket and keeps halving its steps (rtsafe);
        # bisection where ℓ is flat (near its asymptote) and Newton would crawl.
        usable = (
            np.isfinite(newton)
            & (newton >= lo[idx])
            & (newton <= hi[idx])
            & (np.abs(newton - xa) <= 0.5 * step_before_last[idx])
        )
        x_new = np.where(usable, newton, 0.5 * (lo[idx] + hi[idx]))
        x[idx] = x_new
        step_before_last[idx] = last_step[idx]
        last_step[idx] = np.abs(x_new - xa)
        tolerance = 1e-13 * (1.0 + np.abs(x_new))
        done = (np.abs(x_new - xa) <= tolerance) | (hi[idx] - lo[idx] <= tolerance)
        active[idx[done]] = False
        if not active.any():
            return x
    raise ArithmeticError("mixture privacy-loss inversion did not converge")


def _single_gaussian_inverse(
    mechanism: MixtureGaussianPrivacyLoss, losses: np.ndarray, sensitivity: float, q: float
) -> np.ndarray:
    """Inverse privacy loss of the subsampled Gaussian with all positive mass on one
    sensitivity: the starting bracket (dp_accounting starts from the same four values; the
    bracket is then widened where it does not hold)."""
    if q < 1.0:
        if mechanism.adjacency_type == AdjacencyType.REMOVE:
            losses = np.log(np.maximum((np.exp(losses) - (1 - q)) / q, 1e-300))
        else:
            losses = -np.log(np.maximum((np.exp(-losses) - (1 - q)) / q, 1e-300))
    return mechanism.inverse_privacy_loss_for_single_gaussian(losses, sensitivity)


def _hockey_stick_deltas(
    mechanism: MixtureGaussianPrivacyLoss,
    sens: np.ndarray,
    probs: np.ndarray,
    epsilons: np.ndarray,
) -> np.ndarray:
    """δ(ε_j) for one adjacency direction: dp_accounting's ``get_delta_for_epsilon`` formula
    (its CDFs, its regions), with the privacy-loss inversion vectorised."""
    q = float(np.clip(probs[sens > 0].sum(), 0, 1))
    deltas = np.zeros_like(epsilons, dtype=float)
    if q == 1.0:
        inverse = np.ones_like(epsilons, dtype=bool)
    elif mechanism.adjacency_type == AdjacencyType.ADD:
        inverse = epsilons < -math.log1p(-q)
    else:
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    targets = epsilons[inverse]
    if targets.size:
        positive = sens[sens > 0]
        ends = [
            _single_gaussian_inverse(mechanism, targets, s, q)
            for s in (positive.min(), positive.max())
        ]
        x = _inverse_privacy_losses(
            _MixtureLoss(sens, probs, mechanism.adjacency_type),
            targets,
            np.minimum(*ends),
            np.maximum(*ends),
        )
        deltas[inverse] = mechanism.mu_upper_cdf(x) - np.exp(
            targets + mechanism.mu_lower_log_cdf(x)
        )
    deltas = np.clip(deltas, 0, 1)
    # δ(ε) is non-increasing; repair float noise upward (the safe side), as the library does.
    return np.maximum.accumulate(deltas[::-1])[::-1]


def _one_direction_pmf(
    sensitivities: tuple[float, ...],
    probabilities: tuple[float, ...],
    adjacency: AdjacencyType,
    discretisation: float,
) -> pld_pmf.PLDPmf:
    mechanism = MixtureGaussianPrivacyLoss(
        1.0, sensitivities, probabilities, pessimistic_estimate=True, adjacency_type=adjacency
    )
    bounds = mechanism.connect_dots_bounds()
    lower = math.floor(bounds.epsilon_lower / discretisation)
    upper = math.ceil(bounds.epsilon_upper / discretisation)
    epsilons = np.arange(lower, upper + 1) * discretisation
    deltas = _hockey_stick_deltas(
        mechanism, np.asarray(sensitivities), np.asarray(probabilities), epsilons
    )
    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
        discretisation, lower, upper, deltas
    )


@lru_cache(maxsize=4096)
def _mixture_pld_cached(
    sensitivities: tuple[float, ...], probabilities: tuple[float, ...], discretisation: float
) -> PLD:
    return PLD(
        _one_direction_pmf(sensitivities, probabilities, AdjacencyType.REMOVE, discretisation),
        _one_direction_pmf(sensitivities, probabilities, AdjacencyType.ADD, discretisation),
    )


def mixture_of_gaussians_pld(
    sensitivities: np.ndarray | list[float],
    probabilities: np.ndarray | list[float],
    discretisation: float = FINE_DISCRETISATION,
) -> PLD:
    """One-step pessimistic PLD of N(0,1) versus Σ_S p_S·N(m_S, 1) (connect-the-dots).

    Equivalent to ``from_mixture_gaussian_mechanism(1.0, m, p, ...)``; see the module docstring.
    """
    merged = _merge_components(np.asarray(sensitivities, float), np.asarray(probabilities, float))
    return _mixture_pld_cached(*merged, discretisation)
