"""RS and LC bounds (docs/design.md#random-selection, docs/design.md#generic-bound): reductions,
orderings, refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from factories import make_record

from dpmerge.accounting import account as account_mod
from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting.account import account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.generic import generic_bound
from dpmerge.accounting.records import PrivacyLabel, candidates_to_document
from dpmerge.accounting.structured import (
    ORDERING_SLACK,
    structured_epsilon_pld,
    structured_segments,
)
from dpmerge.accounting.weights import inverse_variance_weights, merged_noise_proxy
from dpmerge.cli import main
from dpmerge.errors import BoundContradictionError, RecordError, RefusalError

DELTA = 1e-5


def one_hot(k: int, i: int) -> list[float]:
    return [1.0 if n == i else 0.0 for n in range(k)]


@pytest.mark.parametrize("index", [0, 2, 4])
def test_one_hot_weights_reproduce_the_candidate(ladder, index):
    expected = candidate_bound(ladder[index], DELTA)
    weights = one_hot(len(ladder), index)
    rs = account(ladder, "rs", weights, DELTA).gating
    lc = account(ladder, "lc", weights, DELTA)
    for bound in (rs, lc.generic, lc.structured):
        assert bound.epsilon_pld == pytest.approx(expected.epsilon_pld, abs=1e-9)
        assert bound.epsilon_rdp == pytest.approx(expected.epsilon_rdp, rel=1e-9)


def test_rs_is_sandwiched_between_its_candidates(ladder):
    a, b = ladder[0], ladder[3]
    eps_a, eps_b = (candidate_bound(c, DELTA).epsilon for c in (a, b))
    for share in (0.001, 0.1, 0.5, 0.9):
        report = account([a, b], "rs", [share, 1 - share], DELTA)
        assert eps_b < report.gating.epsilon_pld < eps_a
        assert report.gating.epsilon_pld <= report.gating.epsilon_rdp


def test_rs_pld_is_the_mixture_of_the_candidate_plds(ladder):
    a, b = ladder[1], ladder[2]
    pa, pb = (pld_mod.candidate_pld(c, 1e-4) for c in (a, b))
    library = pa.compute_mixture(pb, 0.4).get_epsilon_for_delta(DELTA)
    ours = account([a, b], "rs", [0.4, 0.6], DELTA).gating.epsilon_pld
    assert library <= ours <= library + 2 * profiles.EPSILON_SAFETY


def test_generic_bound_is_the_composition_and_ignores_the_weights(ladder):
    a, b = ladder[1], ladder[2]
    composed = pld_mod.candidate_pld(a, 1e-4).compose(pld_mod.candidate_pld(b, 1e-4))
    expected = profiles.epsilon_for_delta(composed, DELTA)
    for w in (0.1, 0.5, 0.93):
        generic = account([a, b], "lc", [w, 1 - w], DELTA).generic
        assert generic.epsilon_pld == pytest.approx(expected, abs=1e-12)
        assert generic.epsilon_pld >= max(candidate_bound(c, DELTA).epsilon_pld for c in (a, b))


def test_structured_never_exceeds_generic_and_pld_never_exceeds_rdp(ladder):
    for weights in ([0.3, 0.7, 0, 0, 0], [0.5, 0.5, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2]):
        report = account(ladder, "lc", weights, DELTA)
        assert report.structured.epsilon_pld <= report.generic.epsilon_pld
        assert report.structured.epsilon_rdp <= report.generic.epsilon_rdp
        assert report.structured.epsilon_pld <= report.structured.epsilon_rdp
        assert report.generic.epsilon_pld <= report.generic.epsilon_rdp


def test_averaging_equal_candidates_can_exceed_each_one():
    """docs/design.md#structured-bound: averaging independent noisy copies reveals more than either
    copy."""
    a, b = make_record("a", 1.0), make_record("b", 1.0)
    single = candidate_bound(a, DELTA).epsilon_pld
    merged = account([a, b], "lc", [0.5, 0.5], DELTA).structured.epsilon_pld
    assert merged > single


def test_structured_matches_the_paper_reconstruction(ladder):
    """Values of the utility experiment (notes: σ 1.0/1.5 at t = 0.564 is ε* = 1)."""
    report = account(ladder, "lc", [0, 0.564, 0.436, 0, 0], DELTA)
    assert report.structured.epsilon_pld == pytest.approx(1.0, abs=2e-3)
    assert report.generic.epsilon_pld == pytest.approx(1.2513, abs=2e-3)


def test_shared_batches_collapse_to_one_subsampled_gaussian():
    a = make_record("a", 1.0, batch_lineage="shared")
    b = make_record("b", 1.5, batch_lineage="shared")
    weights = [0.6, 0.4]
    (segment,) = structured_segments([a, b], weights)
    assert segment.sensitivities[0] == 0.0 and len(segment.sensitivities) == 2
    c = [w * r.contribution_scale for w, r in zip(weights, (a, b), strict=True)]
    noise = math.sqrt(sum((ci * r.noise_multiplier) ** 2 for ci, r in zip(c, (a, b), strict=True)))
    expected = candidate_bound(make_record("eff", noise / sum(c)), DELTA).epsilon_pld
    raw = structured_epsilon_pld([segment], DELTA, 1e-4)
    assert raw == pytest.approx(expected, abs=1e-6)
    # The structured bound is reported as computed (never capped) and sits below the generic
    # bound over the shared-batch release unit (Cauchy–Schwarz: s/Σc ≥ (Σσ⁻²)^(−1/2)).
    report = account([a, b], "lc", weights, DELTA)
    assert report.structured.epsilon_pld == pytest.approx(raw, abs=1e-12)
    assert raw < report.generic.epsilon_pld
    assert not any("capped" in n for n in report.structured.assumptions)


def test_different_step_counts_are_split_into_segments():
    a = make_record("a", 1.0, steps=1000)
    b = make_record("b", 1.2, steps=2500)
    segments = structured_segments([a, b], [0.3, 0.7])
    assert [s.steps for s in segments] == [1000, 1500]
    assert len(segments[0].sensitivities) == 4  # both runs active: 2² subsets
    assert len(segments[1].sensitivities) == 2  # only b: a subsampled Gaussian
    assert account([a, b], "lc", [0.3, 0.7], DELTA).structured.available
    # Equal contributions put S = {a} and S = {b} on one shift: 3 distinct components.
    assert len(structured_segments([a, b], [0.5, 0.5])[0].sensitivities) == 3


def test_checkpoints_of_one_run_count_once_in_the_generic_bound():
    lineages = dict(noise_lineage="run-x/noise-1", batch_lineage="run-x/batch-1", run_id="x")
    early = make_record("early", 1.0, steps=1000, **lineages)
    late = make_record("late", 1.0, steps=2500, **lineages)
    report = account([early, late], "lc", [0.5, 0.5], DELTA)
    assert report.generic.epsilon_pld == pytest.approx(
        candidate_bound(late, DELTA).epsilon_pld, abs=1e-12
    )
    assert any("checkpoints" in a for a in report.generic.assumptions)
    assert not report.structured.available
    assert "noise lineage" in report.structured.reason
    # RS needs no independence: still valid over checkpoints.
    assert account([early, late], "rs", [0.5, 0.5], DELTA).gating.available


def test_reused_noise_stream_is_refused_even_by_the_generic_bound():
    a = make_record("a", 1.0, noise_lineage="seed-7", run_id="run-a")
    b = make_record("b", 2.0, noise_lineage="seed-7", run_id="run-b")
    with pytest.raises(RefusalError, match="reusing a noise stream"):
        account([a, b], "lc", [0.5, 0.5], DELTA)
    assert account([a, b], "rs", [0.5, 0.5], DELTA).gating.available


def test_structured_refuses_non_sgd_and_labels(ladder):
    adam = make_record("adam", 1.0, optimizer="adam")
    report = account([ladder[0], adam], "lc", [0.5, 0.5], DELTA)
    assert "plain SGD" in report.structured.reason
    with pytest.raises(RefusalError, match="plain SGD"):
        account([ladder[0], adam], "lc", [0.5, 0.5], DELTA, gating_bound="structured")
    label = PrivacyLabel(name="vendor", dataset=ladder[0].dataset, epsilon=1.0, delta=1e-6)
    report = account([ladder[0], label], "lc", [0.5, 0.5], DELTA)
    assert "label" in report.structured.reason
    assert report.generic.available and report.generic.epsilon_rdp is None
    assert any("label-only" in a for a in report.generic.assumptions)
    with pytest.raises(RefusalError, match="label"):
        account([ladder[0], label], "lc", [0.5, 0.5], DELTA, gating_bound="structured")


def test_shared_batch_lineage_with_different_rates_is_refused():
    a = make_record("a", 1.0, batch_lineage="b", sample_rate=0.01)
    b = make_record("b", 1.0, batch_lineage="b", sample_rate=0.02)
    with pytest.raises(RefusalError, match="sample rates"):
        account([a, b], "lc", [0.5, 0.5], DELTA)
    assert account([a, b], "rs", [0.5, 0.5], DELTA).gating.available


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([0.5, 0.6], "sum to"),
        ([-0.1, 1.1], "negative"),
        ([float("nan"), 1.0], "finite"),
        ([1.0], "expected 2"),
    ],
)
def test_bad_weights_are_refused(ladder, weights, message):
    for method in ("rs", "lc"):
        with pytest.raises(RecordError, match=message):
            account(ladder[:2], method, weights, DELTA)


def test_candidates_from_different_datasets_are_refused(ladder):
    other = make_record("other", 1.0, dataset="cifar10:abc")
    with pytest.raises(RecordError, match="different datasets"):
        account([ladder[0], other], "lc", [0.5, 0.5], DELTA)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5])
def test_bad_delta_is_refused(ladder, delta):
    with pytest.raises(RecordError, match="δ"):
        account(ladder[:1], "rs", [1.0], delta)


def test_inverse_variance_weights_minimise_the_noise_proxy(ladder):
    records = ladder[:3]
    best = inverse_variance_weights(records)
    assert best == pytest.approx(
        [
            1 / s**2 / sum(1 / r.noise_multiplier**2 for r in records)
            for s in (r.noise_multiplier for r in records)
        ]
    )
    floor = merged_noise_proxy(records, best)
    assert floor == pytest.approx(1 / sum(r.noise_multiplier**-2 for r in records))
    for other in ([1 / 3] * 3, [0.5, 0.3, 0.2], [0.9, 0.05, 0.05]):
        assert merged_noise_proxy(records, other) >= floor


def test_report_json_names_accountant_delta_and_relation(ladder):
    document = account(ladder[:2], "lc", [0.5, 0.5], DELTA).to_dict()
    for key in (
        "method",
        "weights",
        "delta",
        "epsilon_pld",
        "epsilon_rdp",
        "bound",
        "generic_epsilon_pld",
        "structured_epsilon_pld",
        "neighbouring",
        "accountant",
    ):
        assert key in document
    assert document["bound"] == "generic"
    assert document["neighbouring"] == "add_or_remove_one"
    assert document["bounds"]["structured"]["description"].startswith("structured (the DP")


def test_a_structured_bound_above_the_generic_one_is_raised_never_clamped(
    short_ladder, monkeypatch, tmp_path, capsys
):
    """A structured value above the generic one over the same release units is a
    contradiction: ``account`` raises it (and so every calibration and the CLI, in one line),
    whatever the gate; within :data:`ORDERING_SLACK` it is discretisation noise."""
    real = account_mod.structured_bound

    def inflated_by(extra):
        """The structured bound raised to ``extra`` above the generic one of the same merge."""

        def bound(candidates, weights, delta, discretisation):
            found = real(candidates, weights, delta, discretisation)
            above = generic_bound(candidates, weights, delta, discretisation).epsilon_pld
            return replace(found, epsilon_pld=above + extra)

        return bound

    pair = short_ladder[:2]
    generic = account(pair, "lc", [0.5, 0.5], DELTA).generic
    monkeypatch.setattr(account_mod, "structured_bound", inflated_by(ORDERING_SLACK / 2))
    report = account(pair, "lc", [0.5, 0.5], DELTA)
    assert report.structured.epsilon_pld < generic.epsilon_pld + ORDERING_SLACK
    monkeypatch.setattr(account_mod, "structured_bound", inflated_by(1.0))
    for gate in ("generic", "structured"):
        with pytest.raises(BoundContradictionError, match="exceeds the generic bound"):
            account(pair, "lc", [0.5, 0.5], DELTA, gating_bound=gate)
    with pytest.raises(BoundContradictionError):
        calibrate(short_ladder, "lc", 2 * generic.epsilon, DELTA)
    path = tmp_path / "candidates.json"
    path.write_text(json.dumps(candidates_to_document(pair)))
    code = main(
        ["account", "--candidates", str(path), "--method", "lc", "--weights", "0.5,0.5",
         "--delta", "1e-5"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1 and "exceeds the generic" in err
