"""Mean estimation (SPEC §5.3): exact Gaussian accounting of RS and LC."""

from __future__ import annotations

import math

import pytest
from dp_accounting import gaussian_mechanism

from dpmerge.studies.mean_estimation import best_lc_mse, best_rs_mse, mean_estimation_study

SIGMAS = (0.5, 1.0, 2.0, 4.0)


def test_lc_never_loses_to_rs_at_a_feasible_target():
    for row in mean_estimation_study(SIGMAS, [1, 1.5, 2, 3, 4, 8, 20], 1e-5):
        for lc, rs in ((row.lc_mse_pld, row.rs_mse_pld), (row.lc_mse_rdp, row.rs_mse_rdp)):
            if rs is not None:
                assert lc is not None and lc <= rs + 1e-12


def test_lc_mse_is_the_calibrated_gaussian_and_floors_at_inverse_variance():
    mse = best_lc_mse(SIGMAS, 2.0, 1e-5, "pld")
    sigma = math.sqrt(mse)
    assert gaussian_mechanism.get_epsilon_gaussian(sigma, 1e-5) <= 2.0 + 1e-9
    assert gaussian_mechanism.get_epsilon_gaussian(sigma * 0.999, 1e-5) > 2.0
    floor = 1 / sum(s**-2 for s in SIGMAS)
    assert best_lc_mse(SIGMAS, 100.0, 1e-5, "pld") == pytest.approx(floor)


def test_infeasible_targets_are_null():
    below = gaussian_mechanism.get_epsilon_gaussian(max(SIGMAS), 1e-5) * 0.9
    assert best_lc_mse(SIGMAS, below, 1e-5, "pld") is None
    assert best_rs_mse(SIGMAS, below, 1e-5, "pld") is None
    assert best_rs_mse(SIGMAS, below, 1e-5, "rdp") is None


def test_rdp_is_never_tighter_than_the_exact_profile():
    for row in mean_estimation_study(SIGMAS, [2, 4, 8], 1e-5):
        assert row.lc_mse_rdp >= row.lc_mse_pld
        assert row.rs_mse_rdp >= row.rs_mse_pld - 1e-12
