"""Mean estimation (docs/design.md#mean-estimation): exact Gaussian accounting of RS and LC."""

from __future__ import annotations

import math

import pytest
from dp_accounting import gaussian_mechanism

from dpmerge.studies.mean_estimation import best_lc_mse, best_rs_mse

SIGMAS = (0.5, 1.0, 2.0, 4.0)


def test_lc_never_loses_to_rs_at_a_feasible_target():
    for target in (1, 1.5, 2, 3, 4, 8, 20):
        for accountant in ("pld", "rdp"):
            lc = best_lc_mse(SIGMAS, target, 1e-5, accountant)
            rs = best_rs_mse(SIGMAS, target, 1e-5, accountant)
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
    for target in (2, 4, 8):
        lc = {a: best_lc_mse(SIGMAS, target, 1e-5, a) for a in ("pld", "rdp")}
        rs = {a: best_rs_mse(SIGMAS, target, 1e-5, a) for a in ("pld", "rdp")}
        assert lc["rdp"] >= lc["pld"]
        assert rs["rdp"] >= rs["pld"] - 1e-12
