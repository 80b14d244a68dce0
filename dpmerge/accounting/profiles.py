"""Privacy profiles δ(ε) read off pessimistic PLDs, vectorised
(docs/design.md#accounting-primitives, docs/design.md#random-selection).

For a discrete PLD with losses ℓ_j (multiples of the discretisation), probabilities p_j and
mass p_∞ at +∞, the hockey-stick divergence is

    δ(ε) = p_∞ + Σ_{ℓ_j > ε} p_j − e^ε · Σ_{ℓ_j > ε} p_j·e^{−ℓ_j},

exactly as dp_accounting computes it (``pld_pmf._get_delta_for_epsilon_vectorized``), with the
suffix sums accumulated in the same order (from the largest loss down), so values agree with
the library to the last bit. The library walks the PMF in a Python loop on every call; here the
suffix sums are computed once per PLD and every query is a vector operation. This is what makes
random selection fast: δ_RS(ε) = Σ_i π_i·δ_i(ε) per adjacency direction
(docs/design.md#random-selection), and its ε
at δ* has a closed form inside the grid segment where the mixture crosses δ*.

Reads the dense PMF arrays of dp_accounting 0.6.0 (pinned); tests compare every value with the
library's own ``get_delta_for_epsilon`` / ``get_epsilon_for_delta``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dpmerge.accounting.pld import PLD

EPSILON_SAFETY = 1e-7
"""Added to every ε read from a PLD. The closed form and the library's loop differ by up to a
few 1e-9 in float rounding (more at tiny δ, where U − δ cancels), in either direction; the
margin keeps every reported ε on the safe side of both."""


@dataclass(frozen=True)
class _Profile:
    """One adjacency direction of a PLD as suffix sums over its loss grid."""

    offset: int  # loss index of the first PMF entry (loss = index · discretisation)
    discretisation: float
    upper: np.ndarray  # upper[k] = p_∞ + Σ_{j ≥ k} p_j, length n + 1 (upper[n] = p_∞)
    lower: np.ndarray  # lower[k] = Σ_{j ≥ k} p_j·e^{−ℓ_j}, length n + 1 (lower[n] = 0)

    @classmethod
    def of(cls, pmf: object) -> _Profile:
        dense = pmf.to_dense_pmf()  # type: ignore[attr-defined]
        probs = np.asarray(dense._probs, float)
        losses = (np.arange(probs.size) + dense._lower_loss) * dense._discretization
        upper = np.cumsum(np.concatenate(([dense._infinity_mass], probs[::-1])))[::-1]
        with np.errstate(divide="ignore", over="ignore"):
            weighted = np.where(
                probs > 0, np.exp(-losses + np.log(np.where(probs > 0, probs, 1.0))), 0.0
            )
        lower = np.cumsum(np.concatenate(([0.0], weighted[::-1])))[::-1]
        return cls(int(dense._lower_loss), float(dense._discretization), upper, lower)

    def on_grid(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Suffix sums at loss indices start..stop−1, i.e. over losses ≥ each index."""
        positions = np.clip(np.arange(start, stop) - self.offset, 0, self.upper.size - 1)
        return self.upper[positions], self.lower[positions]

    @property
    def stop(self) -> int:
        return self.offset + self.upper.size - 1


@lru_cache(maxsize=1024)
def profiles(pld: PLD) -> tuple[_Profile, _Profile]:
    """(remove, add) profiles of a PLD; cached on the PLD object (PLDs are never mutated)."""
    return _Profile.of(pld._pmf_remove), _Profile.of(pld._pmf_add)


def delta_for_epsilon(pld: PLD, epsilons: np.ndarray | float) -> np.ndarray:
    """δ(ε) of a PLD at each ε (max over both adjacency directions)."""
    eps = np.atleast_1d(np.asarray(epsilons, float))
    out = np.zeros_like(eps)
    for profile in profiles(pld):
        # First loss strictly above ε (the library excludes losses ≤ ε).
        k = np.floor(eps / profile.discretisation + 1e-9).astype(np.int64) + 1
        idx = np.clip(k - profile.offset, 0, profile.upper.size - 1)
        lower = profile.lower[idx]
        with np.errstate(over="ignore", invalid="ignore"):  # e^ε overflows only where it is ∞
            scaled = np.where(lower > 0, np.exp(eps) * lower, 0.0)
        out = np.maximum(out, profile.upper[idx] - scaled)
    return np.clip(out, 0.0, 1.0)


def mixture_epsilon(plds: Sequence[PLD], weights: Sequence[float], delta: float) -> float:
    """Smallest ε with max_dir Σ_i w_i·δ_i^dir(ε) ≤ δ: the ε of random selection
    (docs/design.md#random-selection).

    All PLDs must share one discretisation. Exact for the pessimistic PLDs: inside the grid
    segment where the mixture crosses δ, δ(ε) = U − e^ε·L, so ε = log((U − δ)/L); then
    :data:`EPSILON_SAFETY` is added.
    """
    pairs = [(w, p) for w, p in zip(weights, plds, strict=True) if w > 0]
    if not pairs:
        raise ValueError("mixture weights are all zero")
    directions = list(zip(*(profiles(p) for _, p in pairs), strict=True))
    epsilon = 0.0
    for direction in directions:
        start = min(pr.offset for pr in direction)
        stop = max(pr.stop for pr in direction) + 1
        upper = np.zeros(stop - start)
        lower = np.zeros(stop - start)
        for (w, _), profile in zip(pairs, direction, strict=True):
            u, low = profile.on_grid(start, stop)
            upper += w * u
            lower += w * low
        epsilon = max(
            epsilon,
            _epsilon_from_suffix_sums(start, direction[0].discretisation, upper, lower, delta),
        )
    return epsilon + EPSILON_SAFETY


def _epsilon_from_suffix_sums(
    start: int, discretisation: float, upper: np.ndarray, lower: np.ndarray, delta: float
) -> float:
    """ε for one direction from suffix sums indexed by loss index ``start + i``."""
    if upper[-1] > delta:  # mass at +∞ exceeds δ: no finite ε
        return math.inf
    losses = (start + np.arange(upper.size)) * discretisation
    # δ at each grid loss ℓ_i uses the losses strictly above it: suffix index i + 1.
    with np.errstate(divide="ignore", over="ignore"):
        positive = lower[1:] > 0
        scaled = np.where(
            positive, np.exp(losses[:-1] + np.log(np.where(positive, lower[1:], 1.0))), 0.0
        )
    at_grid = upper[1:] - scaled
    feasible = np.flatnonzero(at_grid <= delta)
    i = int(feasible[0]) if feasible.size else upper.size - 2
    # On (ℓ_{i−1}, ℓ_i] the losses above ε are those with index ≥ i.
    if lower[i] <= 0 or upper[i] <= delta:
        return max(0.0, float(losses[i - 1])) if i > 0 else 0.0
    return max(0.0, math.log((upper[i] - delta) / lower[i]))


def epsilon_for_delta(pld: PLD, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ delta (same value as the library's ``get_epsilon_for_delta``)."""
    return mixture_epsilon([pld], [1.0], delta)
