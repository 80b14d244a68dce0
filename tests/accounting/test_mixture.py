"""The one-step PLDs (the structured surrogate's mixture, the subsampled Gaussian) and RDP
against the library and exact sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from scipy.special import gammaln, logsumexp

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod

Q = 1 / 235


def _independent_pair(m_a: float, m_b: float, q: float = Q) -> tuple[list[float], list[float]]:
    return [0.0, m_a, m_b, m_a + m_b], [(1 - q) ** 2, q * (1 - q), q * (1 - q), q * q]


CASES = [
    ([0.0, 1.0], [1 - Q, Q]),
    _independent_pair(0.8, 1.0),
    _independent_pair(1.2, 0.9),
    ([0.0, 0.5, 1.0, 1.5], [0.7, 0.15, 0.1, 0.05]),
]


@pytest.mark.parametrize(("sensitivities", "probabilities"), CASES)
def test_vectorised_mixture_pld_equals_the_library(sensitivities, probabilities):
    """Our connect-the-dots construction versus ``from_mixture_gaussian_mechanism``."""
    ours = pld_mod.mixture_of_gaussians_pld(sensitivities, probabilities, 1e-3)
    library = pld_lib.from_mixture_gaussian_mechanism(
        1.0, sensitivities, probabilities, value_discretization_interval=1e-3
    )
    eps = np.linspace(-0.5, 4, 200)
    np.testing.assert_allclose(
        ours.get_delta_for_epsilon(eps), library.get_delta_for_epsilon(eps), atol=1e-12
    )
    for steps in (1, 500):
        a = ours.self_compose(steps) if steps > 1 else ours
        b = library.self_compose(steps) if steps > 1 else library
        assert profiles.epsilon_for_delta(a, 1e-5) == pytest.approx(
            profiles.epsilon_for_delta(b, 1e-5), abs=1e-8
        )


def test_vectorised_mixture_pld_at_the_fine_discretisation():
    sensitivities, probabilities = _independent_pair(0.8, 1.0)
    ours = pld_mod.mixture_of_gaussians_pld(sensitivities, probabilities, 1e-4)
    library = pld_lib.from_mixture_gaussian_mechanism(
        1.0, sensitivities, probabilities, value_discretization_interval=1e-4
    )
    assert profiles.epsilon_for_delta(ours.self_compose(2350), 1e-5) == pytest.approx(
        profiles.epsilon_for_delta(library.self_compose(2350), 1e-5), abs=1e-8
    )


@pytest.mark.parametrize(
    ("sigma", "q", "discretisation"),
    [
        (0.5, 1e-4, 1e-3),
        (0.8, Q, 1e-4),
        (1.3, 0.05, 1e-3),
        (2.5, 0.3, 1e-3),
        (7.0, 0.9, 1e-3),
        (30.0, 0.999, 1e-4),
        (1.0, 1.0, 1e-3),
    ],
)
def test_subsampled_gaussian_step_is_the_librarys(sigma, q, discretisation):
    """The vectorised one-step PLD every candidate's ε starts from is the library's
    ``from_gaussian_mechanism``, bit for bit, in both directions."""
    ours = pld_mod._one_step.__wrapped__(sigma, q, discretisation)
    library = pld_lib.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=discretisation
    )
    assert ours._symmetric == library._symmetric
    for a, b in ((ours._pmf_remove, library._pmf_remove), (ours._pmf_add, library._pmf_add)):
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
        assert (a._lower_loss, a._infinity_mass) == (b._lower_loss, b._infinity_mass)
        np.testing.assert_array_equal(a._probs, b._probs)


@pytest.mark.parametrize(("sigma", "q"), [(0.5, 0.05), (1.0, Q), (4.0, 0.5), (1.3, 1.0)])
def test_subsampled_gaussian_rdp_is_the_librarys_composition(sigma, q):
    """``steps ×`` the cached one-step curve is what the library's RDP accountant returns for
    the self-composed event, bit for bit (orders it cannot evaluate stay +∞)."""
    for steps in (1, 7, 2350):
        accountant = RdpAccountant(orders=rdp_mod.ORDERS)
        event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        accountant.compose(dp_event.SelfComposedDpEvent(event, steps))
        np.testing.assert_array_equal(rdp_mod._rdp_curve(sigma, q, steps), accountant.rdp)


def test_single_component_mixture_is_the_subsampled_gaussian():
    sigma = 1.3
    mixture = pld_mod.mixture_of_gaussians_pld([0.0, 1 / sigma], [1 - Q, Q], 1e-4)
    gaussian = pld_mod.subsampled_gaussian_pld(sigma, Q, 1, 1e-4)
    assert profiles.epsilon_for_delta(mixture.self_compose(2000), 1e-5) == pytest.approx(
        profiles.epsilon_for_delta(gaussian.self_compose(2000), 1e-5), abs=1e-8
    )


@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.0, 4.0])
def test_quadrature_rdp_reproduces_the_subsampled_gaussian(sigma):
    """k = 1: integer orders match dp_accounting's exact binomial sums; at fractional orders
    the library's formula is an over-estimate (notes: accounting-probe §3.2), never below."""
    ours = rdp_mod.mixture_of_gaussians_rdp([0.0, 1 / sigma], [1 - Q, Q])
    library = rdp_mod.subsampled_gaussian_rdp(sigma, Q, 1)
    orders = np.asarray(rdp_mod.ORDERS)
    integer = np.isclose(orders, np.round(orders))
    np.testing.assert_allclose(ours[integer], library[integer], rtol=2e-6)
    assert np.all(ours[integer] >= library[integer])  # the safety margin is upward
    assert np.all(ours[~integer] <= library[~integer] * (1 + 2e-6))


def _exact_lattice_rdp(alpha: int, k: int, c: float, q: float) -> float:
    """Exact D_α(P‖Q) for equal weights: m_S = |S|·c, P(|S| = j) = Binom(k, q)."""
    j = np.arange(k + 1)
    log_b = gammaln(k + 1) - gammaln(j + 1) - gammaln(k - j + 1)
    log_p = log_b + j * math.log(q) + (k - j) * math.log1p(-q)
    # E_Q[(P/Q)^α] = Σ_{j1..jα} Π p_ji · exp(c² Σ_{a<b} j_a j_b): expand via the convolution
    # of the α-fold sum s = Σ j_i, using E_Q[exp(c·s·x − c²Σj_i²/2)] = exp(c²(s² − Σj_i²)/2).
    # Track (s, Σ j_i²) jointly by dynamic programming over the α draws.
    states = {(0, 0): 0.0}
    for _ in range(alpha):
        nxt: dict[tuple[int, int], list[float]] = {}
        for (s, sq), lw in states.items():
            for jj, lp in zip(j.tolist(), log_p.tolist(), strict=True):
                nxt.setdefault((s + jj, sq + jj * jj), []).append(lw + lp)
        states = {key: float(logsumexp(v)) for key, v in nxt.items()}
    terms = [lw + c * c * (s * s - sq) / 2 for (s, sq), lw in states.items()]
    return float(logsumexp(terms)) / (alpha - 1)


@pytest.mark.parametrize("alpha", [2, 3, 5, 8])
def test_quadrature_rdp_matches_exact_integer_order_sums(alpha):
    """k = 2 and 3 independent candidates with equal weights: exact multinomial sums."""
    for k, c in ((2, 0.7), (3, 0.55)):
        q = 0.05
        sens = [j * c for j in range(k + 1)]
        probs = [math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k + 1)]
        exact = _exact_lattice_rdp(alpha, k, c, q)
        ours = rdp_mod.mixture_of_gaussians_rdp_at(tuple(sens), tuple(probs), float(alpha))
        assert ours == pytest.approx(exact, rel=2e-6)
        assert ours >= exact


def test_quadrature_stays_finite_where_naive_integration_overflows():
    """(α−1)·RDP far above 709 at α = 1024 and σ = 0.6 (notes: accounting-probe §3.3)."""
    sigma = 0.6
    value = rdp_mod.mixture_of_gaussians_rdp_at((0.0, 1 / sigma), (1 - Q, Q), 1024.0)
    library = rdp_mod.subsampled_gaussian_rdp(sigma, Q, 1)[rdp_mod.ORDERS.index(1024.0)]
    assert math.isfinite(value) and (1024 - 1) * value > 709
    assert value == pytest.approx(library, rel=2e-6)


@pytest.mark.parametrize("steps", [2, 300, 2350])
@pytest.mark.parametrize("discretisation", [1e-3, 1e-4])
def test_self_composition_is_the_librarys(steps, discretisation):
    """``pld.self_compose`` (vectorised truncation bounds) returns the library's PMFs exactly."""
    sensitivities, probabilities = _independent_pair(0.8, 1.0)
    one = pld_mod.mixture_of_gaussians_pld(sensitivities, probabilities, discretisation)
    ours, library = pld_mod.self_compose(one, steps), one.self_compose(steps)
    for a, b in ((ours._pmf_remove, library._pmf_remove), (ours._pmf_add, library._pmf_add)):
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
        assert a._lower_loss == b._lower_loss
        assert a._infinity_mass == b._infinity_mass
        np.testing.assert_array_equal(a._probs, b._probs)
    gaussian = pld_lib.from_gaussian_mechanism(
        1.1, sampling_prob=Q, value_discretization_interval=discretisation
    )
    np.testing.assert_array_equal(
        pld_mod.self_compose(gaussian, steps)._pmf_remove.to_dense_pmf()._probs,
        gaussian.self_compose(steps)._pmf_remove.to_dense_pmf()._probs,
    )
