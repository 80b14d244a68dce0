"""Per-candidate curves against dp_accounting and closed forms
(docs/design.md#accounting-primitives)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from dp_accounting import dp_event, gaussian_mechanism
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_record

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.candidate import candidate_bound, noise_multiplier_for_epsilon
from dpmerge.accounting.gaussian import gaussian_delta, gaussian_noise_for_epsilon
from dpmerge.accounting.records import PrivacyLabel


def test_reference_value_sigma_one_sixty_epochs():
    """docs/design.md#accounting-primitives: q = 256/60000, σ = 1, T = 14063, δ = 1e-5 → PLD ≈
    2.823, RDP ≈ 3.079."""
    record = make_record("ref", 1.0, sample_rate=256 / 60000, steps=14063, batch=256)
    bound = candidate_bound(record, 1e-5)
    assert bound.epsilon_pld == pytest.approx(2.823, abs=0.01)
    assert bound.epsilon_rdp == pytest.approx(3.079, abs=0.005)
    assert bound.accountant == "pld" and bound.epsilon == bound.epsilon_pld


def test_candidate_pld_matches_the_library_accountant():
    record = make_record("a", 1.1, steps=3000)
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(record.dp_event())
    library = accountant.get_epsilon(1e-5)
    ours = candidate_bound(record, 1e-5).epsilon_pld
    assert library <= ours <= library + 1e-6  # ours adds the 1e-7 safety margin


def test_candidate_rdp_matches_the_library_accountant():
    record = make_record("a", 0.9, steps=1000)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(record.dp_event())
    assert candidate_bound(record, 1e-6).epsilon_rdp == pytest.approx(
        accountant.get_epsilon(1e-6), rel=1e-12
    )


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-9])
def test_profiles_agree_with_the_library(delta):
    a = pld_mod.subsampled_gaussian_pld(0.8, 0.01, 500, 1e-4)
    b = pld_mod.subsampled_gaussian_pld(2.0, 0.01, 500, 1e-4)
    for pld in (a, b, a.compose(b)):
        library = pld.get_epsilon_for_delta(delta)
        ours = profiles.epsilon_for_delta(pld, delta)
        assert library <= ours <= library + 2 * profiles.EPSILON_SAFETY
        eps = np.linspace(0, 6, 40)
        np.testing.assert_allclose(
            profiles.delta_for_epsilon(pld, eps), pld.get_delta_for_epsilon(eps), atol=1e-14
        )


def test_mixture_profile_equals_library_compute_mixture():
    a = pld_mod.subsampled_gaussian_pld(0.8, 0.01, 300, 1e-4)
    b = pld_mod.subsampled_gaussian_pld(1.6, 0.01, 300, 1e-4)
    library = a.compute_mixture(b, 0.3).get_epsilon_for_delta(1e-5)
    ours = profiles.mixture_epsilon([a, b], [0.3, 0.7], 1e-5)
    assert library <= ours <= library + 2 * profiles.EPSILON_SAFETY


def test_analytic_gaussian_mechanism():
    """The exact Gaussian profile (Balle & Wang) versus the pessimistic PLD and a numerical
    hockey-stick integral."""
    sigma, epsilon = 1.3, 0.7
    exact = gaussian_delta(sigma, epsilon)
    xs = np.linspace(-20, 20, 400001)
    p = np.exp(-((xs - 1) ** 2) / (2 * sigma**2))
    q = np.exp(-(xs**2) / (2 * sigma**2))
    hockey = np.sum(np.maximum(p - math.exp(epsilon) * q, 0)) * (xs[1] - xs[0])
    assert exact == pytest.approx(hockey / math.sqrt(2 * math.pi * sigma**2), rel=1e-6)
    pessimistic = pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=1e-4)
    assert profiles.delta_for_epsilon(pessimistic, epsilon)[0] >= exact
    assert profiles.delta_for_epsilon(pessimistic, epsilon)[0] == pytest.approx(exact, rel=1e-3)


def test_gaussian_calibration_rounds_noise_up():
    for accountant in ("pld", "rdp"):
        sigma = gaussian_noise_for_epsilon(1.5, 1e-5, accountant)
        epsilon = (
            gaussian_mechanism.get_epsilon_gaussian(sigma, 1e-5)
            if accountant == "pld"
            else rdp_mod.epsilon_from_rdp(rdp_mod.gaussian_rdp(sigma), 1e-5)[0]
        )
        assert epsilon <= 1.5
        assert epsilon == pytest.approx(1.5, abs=1e-5)


def test_noise_multiplier_for_epsilon_is_certified_and_tight():
    sigma = noise_multiplier_for_epsilon(2.0, 1e-5, 1 / 235, 2350)
    record = make_record("cal", sigma)
    epsilon = candidate_bound(record, 1e-5).epsilon_pld
    assert epsilon <= 2.0
    assert epsilon > 1.98  # within the 1e-3 relative tolerance on σ


def test_pld_epsilon_never_exceeds_rdp_epsilon():
    for sigma in (0.6, 1.0, 2.5):
        bound = candidate_bound(make_record("x", sigma, steps=1000), 1e-5)
        assert bound.epsilon_pld <= bound.epsilon_rdp


def test_label_candidates():
    label = PrivacyLabel(name="vendor", dataset="d", epsilon=1.2, delta=1e-6)
    bound = candidate_bound(label, 1e-6)
    assert bound.epsilon_pld == pytest.approx(1.2, abs=1e-6)
    assert bound.epsilon_rdp is None
    orders = rdp_mod.ORDERS
    rdp_label = PrivacyLabel(
        name="old", dataset="d", rdp_orders=orders, rdp_epsilons=tuple(a / 8 for a in orders)
    )
    bound = candidate_bound(rdp_label, 1e-5)
    assert bound.epsilon_pld is None
    assert bound.epsilon_rdp == pytest.approx(
        rdp_mod.epsilon_from_rdp(rdp_mod.gaussian_rdp(2.0), 1e-5)[0]
    )


def test_record_translates_to_the_dp_event():
    record = make_record("e", 1.2, steps=77, sample_rate=0.02)
    assert record.dp_event() == dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.2)), 77
    )


def test_orders_dp_accounting_cannot_evaluate_are_infinite_and_quiet(caplog) -> None:
    """At σ ≈ 0.57, q = 0.1 dp_accounting cannot evaluate the orders just above 1: they stay +∞
    (ε comes from the other orders, still an upper bound) and no warning per order reaches the
    user's terminal."""
    with caplog.at_level(logging.WARNING):
        curve = rdp_mod.subsampled_gaussian_rdp(0.8 / math.sqrt(2), 0.1, 1)
    assert not [r for r in caplog.records if r.name == "absl"]
    assert math.isinf(curve[0]) and np.isfinite(curve).sum() > len(curve) // 2
    epsilon, order = rdp_mod.epsilon_from_rdp(curve, 1e-5)
    assert math.isfinite(epsilon) and order > 1.1
