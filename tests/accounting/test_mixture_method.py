"""The ``mixture`` method — a secret draw between two LC merges of subsets — and the rule
``auto`` uses to choose among RS, LC and the mixture (docs/design.md#random-selection,
docs/design.md#calibration). Every certified ε is re-derived here by dp_accounting alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_checkpoints, make_record
from scipy.special import logsumexp

from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.choice import choose_method, expected_utility
from dpmerge.accounting.generic import generic_bound
from dpmerge.accounting.ledger import cumulative_bound, release_for
from dpmerge.accounting.mixture import mixture_report
from dpmerge.errors import InfeasibleTargetError, RecordError, RefusalError

DELTA = 1e-5
ORDERS = rdp_privacy_accountant.DEFAULT_RDP_ORDERS


def library_rung(records) -> tuple[privacy_loss_distribution.PrivacyLossDistribution, np.ndarray]:
    """A rung's PLD (pessimistic connect-the-dots at 1e-4) and RDP curve, by dp_accounting
    alone: the composition of its independent members' subsampled Gaussians."""
    pld = None
    curve = np.zeros(len(ORDERS))
    for r in records:
        one = privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=r.noise_multiplier,
            sampling_prob=r.sample_rate,
            value_discretization_interval=1e-4,
            pessimistic_estimate=True,
            use_connect_dots=True,
        ).self_compose(r.steps)
        pld = one if pld is None else pld.compose(one)
        accountant = rdp_privacy_accountant.RdpAccountant(orders=ORDERS)
        accountant.compose(
            dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(
                    r.sample_rate, dp_event.GaussianDpEvent(r.noise_multiplier)
                ),
                r.steps,
            )
        )
        curve = curve + np.asarray(accountant._rdp)
    return pld, curve


def members(records, weights):
    return [r for r, w in zip(records, weights, strict=True) if w > 0]


@pytest.fixture(scope="module")
def mixed(short_ladder):
    """A target between two rungs of the generic ladder, where the programme mixes."""
    lc = calibrate(short_ladder, "lc", 1.0, DELTA)
    result = calibrate(short_ladder, "mixture", 1.0, DELTA)
    return lc, result


def test_a_mixture_draws_between_two_rungs_and_spends_the_target(short_ladder, mixed):
    lc, result = mixed
    assert result.method == "mixture" and result.weights is None
    assert len(result.rungs) == 2
    assert lc.epsilon < result.epsilon <= 1.0
    assert sum(r.probability for r in result.rungs) == pytest.approx(1.0)
    assert all(0 < r.probability < 1 for r in result.rungs)
    # The programme's expected utility beats LC's single rung; the rungs are inverse-variance.
    assert result.utility > lc.utility
    for rung in result.rungs:
        used = members(short_ladder, rung.weights)
        precision = [r.noise_multiplier**-2 for r in used]
        expected = [p / sum(precision) for p in precision]
        assert [w for w in rung.weights if w > 0] == pytest.approx(expected)
    report = result.to_dict()
    assert report["method"] == "mixture" and report["bound"] == "mixture"
    assert report["weights"] is None and len(report["rungs"]) == 2
    assert report["search"]["rungs"] == [list(r.members(result.report.names)) for r in result.rungs]


def test_the_mixture_bound_is_rederived_by_dp_accounting(short_ladder, mixed):
    """PLD: the library's mixture of the two rungs' composed PLDs; RDP: the log-mean-exp of
    the library's composed curves, converted by the library."""
    _, result = mixed
    (a, b) = result.rungs
    pld_a, rdp_a = library_rung(members(short_ladder, a.weights))
    pld_b, rdp_b = library_rung(members(short_ladder, b.weights))
    library = pld_a.compute_mixture(pld_b, a.probability).get_epsilon_for_delta(DELTA)
    gating = result.report.gating
    assert library <= gating.epsilon_pld <= library + 1e-6
    orders = np.asarray(ORDERS)
    weights = np.asarray([a.probability, b.probability])[:, None]
    curve = logsumexp((orders - 1) * np.stack([rdp_a, rdp_b]), axis=0, b=weights) / (orders - 1)
    rdp, _ = rdp_privacy_accountant.compute_epsilon(orders, curve, DELTA)
    assert gating.epsilon_rdp == pytest.approx(rdp, rel=1e-9)
    # Each rung's own bound is its generic bound, and the mixture lies between them (PLD).
    for rung in result.rungs:
        assert rung.bound == generic_bound(short_ladder, rung.weights, DELTA)
    low, high = sorted(r.bound.epsilon_pld for r in result.rungs)
    assert low - 1e-6 <= gating.epsilon_pld <= high + 1e-6


def test_the_ledger_counts_every_candidate_of_either_rung(short_ladder, mixed):
    _, result = mixed
    union = {n for r in result.rungs for n in r.members(result.report.names)}
    assert set(result.report.used_candidates) == union
    release = release_for("r1", short_ladder, result.report)
    assert {c.name for c in release.candidates} == union and release.method == "mixture"
    everything = [c for c in short_ladder if c.name in union]
    expected = generic_bound(everything, [1 / len(everything)] * len(everything), DELTA)
    assert cumulative_bound([release], DELTA).epsilon_pld == expected.epsilon_pld
    with pytest.raises(RecordError, match="other candidates"):
        release_for("r1", short_ladder[:2], result.report)


def test_a_target_above_every_mix_is_one_rung_the_lc_merge(short_ladder):
    result = calibrate(short_ladder, "mixture", 1e3, DELTA)
    lc = calibrate(short_ladder, "lc", 1e3, DELTA)
    assert len(result.rungs) == 1 and result.rungs[0].probability == 1.0
    assert result.rungs[0].weights == lc.weights
    assert result.epsilon == pytest.approx(lc.epsilon, abs=1e-9)


def test_mixture_inputs_are_checked(short_ladder):
    with pytest.raises(InfeasibleTargetError):
        calibrate(short_ladder, "mixture", 0.01, DELTA)
    with pytest.raises(RecordError, match="LC only"):
        calibrate(short_ladder, "mixture", 1.0, DELTA, gating_bound="structured")
    one = [1.0, 0.0, 0.0, 0.0]
    for rungs, message in (
        ([(0.5, one), (0.3, one), (0.2, one)], "between one and two"),
        ([(0.0, one), (1.0, one)], "above 0"),
        ([(0.5, one), (0.6, one)], "sum to"),
        ([(1.0, [0.5, 0.6, 0.0, 0.0])], "sum to"),
        ([(True, one)], "must be numbers"),
    ):
        with pytest.raises(RecordError, match=message):
            mixture_report(short_ladder, rungs, DELTA)
    with pytest.raises(RecordError, match="δ must lie in"):
        mixture_report(short_ladder, [(1.0, one)], 1.5)
    other = short_ladder[1].model_copy(update={"initialisation": "seed-9"})
    warned = mixture_report([short_ladder[0], other], [(1.0, [0.5, 0.5])], DELTA)
    assert any("different initialisations" in note for note in warned.notes)
    reused = [
        make_record(n, 1.0, steps=100, sample_rate=0.01, noise_lineage="same-stream")
        for n in ("x", "y")
    ]
    with pytest.raises(RefusalError, match="share noise lineage"):
        mixture_report(reused, [(0.5, [0.5, 0.5]), (0.5, [1.0, 0.0])], DELTA)


def test_opt_in_tuning_changes_weights_within_each_rung_not_the_bound(short_ladder, mixed):
    _, plain = mixed

    def prefer_the_noisiest(weights):
        return weights[-1] - 0.01 * weights[0]

    tuned = calibrate(short_ladder, "mixture", 1.0, DELTA, merge_utility=prefer_the_noisiest)
    assert [r.probability for r in tuned.rungs] == [r.probability for r in plain.rungs]
    for a, b in zip(tuned.rungs, plain.rungs, strict=True):
        assert [w > 0 for w in a.weights] == [w > 0 for w in b.weights]
        assert a.bound == b.bound
    assert tuned.report.gating == plain.report.gating
    assert "validation accuracy" in tuned.utility_kind


def test_an_infeasible_target_says_which_sigma_reaches_it(short_ladder):
    """The σ at which one candidate with the most private record's q and T meets ε* (PLD),
    shown rounded up; a candidate at that σ does meet it, one 1 % less noisy does not."""
    safest = max(short_ladder, key=lambda r: r.noise_multiplier)
    target = 0.5 * candidate_bound(safest, DELTA).epsilon
    with pytest.raises(InfeasibleTargetError) as raised:
        calibrate(short_ladder, "lc", target, DELTA)
    sigma = raised.value.required_noise_multiplier
    assert sigma is not None and sigma > safest.noise_multiplier
    shown = float(str(raised.value).split("train σ ≥ ")[1].split(" ")[0])
    assert shown >= sigma and "(PLD)" in str(raised.value)
    at = safest.model_copy(update={"noise_multiplier": shown})
    assert candidate_bound(at, DELTA).epsilon_pld <= target
    below = safest.model_copy(update={"noise_multiplier": sigma * 0.99})
    assert candidate_bound(below, DELTA).epsilon_pld > target


# --- choose_method ----------------------------------------------------------------------------


def test_auto_picks_the_mixture_where_it_mixes_and_lc_where_it_does_not(short_ladder, mixed):
    lc, mixture = mixed
    rs = calibrate(short_ladder, "rs", 1.0, DELTA)
    choice = choose_method({"rs": rs, "lc": lc, "mixture": mixture}, short_ladder)
    assert choice.method == "mixture" and choice.calibration is mixture
    assert choice.utilities["mixture"] > choice.utilities["lc"]
    assert choice.utilities["mixture"] >= choice.utilities["rs"]
    assert choice.utilities["mixture"] == pytest.approx(mixture.utility)
    assert "mixture" in choice.reason
    high = {m: calibrate(short_ladder, m, 1e3, DELTA) for m in ("rs", "lc", "mixture")}
    choice = choose_method(high, short_ladder)
    assert choice.method == "lc"  # the mixture is LC's rung alone: a tie goes to LC
    assert choice.utilities["mixture"] == choice.utilities["lc"]


def test_auto_is_read_off_the_records_and_checks_its_input(short_ladder, mixed):
    lc, _ = mixed
    assert expected_utility(lc, short_ladder) == pytest.approx(lc.utility)
    with pytest.raises(RecordError, match="at least one"):
        choose_method({}, short_ladder)
    with pytest.raises(RecordError, match="not one of these records"):
        choose_method({"rs": lc}, short_ladder)
    with pytest.raises(RecordError, match="not one of these records"):
        choose_method({"lc": lc}, short_ladder[:2])
    document = json.dumps(choose_method({"lc": lc}, short_ladder).utilities)
    assert "lc" in document


def test_the_utility_counts_a_run_once_at_its_length():
    """−1/Σ T_r/σ_r² over the runs: averaging a run's checkpoints earns nothing (one noise
    stream), stopping it earlier costs in proportion; equal-length runs rank as the per-step
    proxy does."""
    from dpmerge.accounting.weights import (
        inverse_variance_weights,
        merged_noise_proxy,
        subset_utility,
    )

    one, two = make_checkpoints(1.0), make_checkpoints(2.0)
    assert subset_utility(one) == subset_utility(one[2:]) == pytest.approx(-1.0 / 200)
    assert subset_utility(one[:2]) == pytest.approx(-1.0 / 150)
    assert subset_utility([one[2], two[2]]) == pytest.approx(-1.0 / (200 + 200 / 4))
    equal = [make_record(f"e{s}", s, steps=200) for s in (1.0, 1.5, 3.0)]
    per_step = merged_noise_proxy(equal, inverse_variance_weights(equal))
    assert subset_utility(equal) == pytest.approx(-per_step / 200)


def test_a_rung_exactly_at_the_target_is_affordable_and_ties_prefer_the_mixture():
    """At the ε of a run's end the mixture releases that run's whole average (the coarse grid
    and the programme's slack do not drop it); where RS between two checkpoints ties with the
    mixture of the merges ending at them, auto takes the mixture (which averages more)."""
    candidates = make_checkpoints(1.0) + make_checkpoints(2.0)
    end = candidate_bound(candidates[5], DELTA).epsilon
    mixture = calibrate(candidates, "mixture", end, DELTA)
    assert len(mixture.rungs) == 1
    assert set(mixture.rungs[0].members(mixture.report.names)) == {
        c.name for c in make_checkpoints(2.0)
    }
    between = (candidate_bound(candidates[4], DELTA).epsilon + end) / 2
    offered = {m: calibrate(candidates[3:], m, between, DELTA) for m in ("rs", "mixture")}
    choice = choose_method(offered, candidates[3:])
    assert choice.utilities["rs"] == pytest.approx(choice.utilities["mixture"], rel=1e-12)
    assert choice.method == "mixture"
