"""The exact ε of RS between Gaussian mechanisms (docs/design.md#mean-estimation): the bracket
against closed forms and an independent numerical integral."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm

from dpmerge.accounting.gaussian import gaussian_epsilon
from dpmerge.studies.rs_exact import (
    MixtureAccountant,
    dimension_lower_epsilon,
    mixture_bound_epsilon,
)

SIGMAS = (0.5, 1.0, 2.0, 4.0)


def integral_delta(sigmas, weights, epsilon: float) -> float:
    """δ(ε) = ∫(p − e^ε q)_+ by the trapezoid rule on a fine grid (both directions)."""
    x = np.linspace(-70, 71, 3_000_001)
    p = sum(w * norm.pdf(x, 0, s) for s, w in zip(sigmas, weights, strict=True))
    q = sum(w * norm.pdf(x, 1, s) for s, w in zip(sigmas, weights, strict=True))
    return max(
        float(np.trapezoid(np.maximum(p - np.exp(epsilon) * q, 0), x)),
        float(np.trapezoid(np.maximum(q - np.exp(epsilon) * p, 0), x)),
    )


@pytest.mark.parametrize("sigma", [0.7, 2.0])
def test_equal_components_give_the_gaussian_mechanism(sigma):
    bracket = MixtureAccountant((sigma, sigma)).bracket((0.5, 0.5), 1e-5)
    exact = gaussian_epsilon(sigma, 1e-5, "pld")
    assert bracket.lower - 1e-7 <= exact <= bracket.upper + 1e-7
    assert bracket.upper - bracket.lower < 1e-6


@pytest.mark.parametrize(
    "weights", [(0.1, 0.2, 0.3, 0.4), (0.0, 0.0, 0.94, 0.06), (0.02, 0.0, 0.0, 0.98)]
)
def test_bracket_holds_the_integral_and_is_below_the_mixture_bound(weights):
    bracket = MixtureAccountant(SIGMAS).bracket(weights, 1e-5)
    assert bracket.upper - bracket.lower < 1e-5
    assert integral_delta(SIGMAS, weights, bracket.upper) <= 1e-5 * (1 + 1e-3)
    assert integral_delta(SIGMAS, weights, bracket.lower - 1e-3) > 1e-5
    assert bracket.upper <= mixture_bound_epsilon(SIGMAS, weights, 1e-5)


def test_meets_agrees_with_the_bracket():
    accountant = MixtureAccountant(SIGMAS)
    weights = (0.1, 0.2, 0.3, 0.4)
    upper = accountant.bracket(weights, 1e-5).upper
    assert accountant.meets(weights, upper, 1e-5)
    assert not accountant.meets(weights, upper - 1e-3, 1e-5)


def test_a_release_in_more_dimensions_reveals_the_index():
    weights = (0.1, 0.2, 0.3, 0.4)
    scalar = MixtureAccountant(SIGMAS).bracket(weights, 1e-5).upper
    bound = mixture_bound_epsilon(SIGMAS, weights, 1e-5)
    lower = [dimension_lower_epsilon(SIGMAS, weights, 1e-5, d) for d in (2, 10, 100)]
    assert scalar - 1e-3 <= lower[0] <= lower[1] <= lower[2] <= bound + 1e-6
    assert lower[2] > 0.99 * bound  # at d = 100 the mixture bound is nearly exact
    pure = dimension_lower_epsilon(SIGMAS, (0, 0, 1, 0), 1e-5, 10)
    assert pure == pytest.approx(gaussian_epsilon(2.0, 1e-5, "pld"), abs=1e-4)
