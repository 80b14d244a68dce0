"""Property tests of the invariants an auditor checks (docs/design.md#calibration,
docs/design.md#generic-bound, docs/design.md#structured-bound, docs/design.md#release-ledger):
over random candidate sets (cheap records: at most 200 steps), random weights and random targets.
Few examples each, no deadline: CI time matters (about 1 minute in all on a quiet core)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from factories import make_record
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dpmerge.accounting import account as account_mod
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.account import account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.choice import choose_method
from dpmerge.accounting.generic import composed_rdp, generic_bound, release_units
from dpmerge.accounting.ledger import cumulative_bound, release_for
from dpmerge.accounting.mixture import mixture_report
from dpmerge.accounting.structured import ORDERING_SLACK, structured_bound
from dpmerge.errors import BoundContradictionError
from dpmerge.formatting import epsilon_text, within_text

DELTA = 1e-5
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def candidate_sets(draw, *, low: int = 2, high: int = 3):
    """2–3 cheap candidates (at most 100 steps), some sharing a batch lineage (one release
    unit)."""
    k = draw(st.integers(low, high))
    lineages = [draw(st.integers(0, k - 1)) for _ in range(k)]
    rates = {g: draw(st.sampled_from([0.01, 0.02])) for g in set(lineages)}
    return [
        make_record(
            f"c{i}",
            draw(st.sampled_from([0.8, 1.3, 2.5, 4.0])),
            steps=draw(st.sampled_from([20, 50, 100])),
            sample_rate=rates[g],
            batch=600.0,
            batch_lineage=f"batches-{g}",
        )
        for i, g in enumerate(lineages)
    ]


@st.composite
def weights_for(draw, k: int, *, zeros: bool = True):
    values = [draw(st.floats(0.0 if zeros else 0.05, 1.0)) for _ in range(k)]
    assume(sum(values) > 1e-3 and max(values) > 0)
    total = math.fsum(values)
    return [v / total for v in values]


@FEW
@given(st.data())
def test_generic_is_at_least_every_used_candidates_epsilon(data):
    records = data.draw(candidate_sets())
    weights = data.draw(weights_for(len(records)))
    bound = generic_bound(records, weights, DELTA)
    for record, weight in zip(records, weights, strict=True):
        if weight > 0:
            own = candidate_bound(record, DELTA)
            assert bound.epsilon_pld >= own.epsilon_pld - 1e-9
            assert bound.epsilon_rdp >= own.epsilon_rdp - 1e-9


@FEW
@given(st.data())
def test_structured_is_at_most_generic_or_a_contradiction_is_raised(data):
    """``account`` either reports the structured value exactly as computed (never clamped)
    and within the ordering slack of the generic one, or raises."""
    records = data.draw(candidate_sets())
    weights = data.draw(weights_for(len(records), zeros=False))
    try:
        report = account(records, "lc", weights, DELTA)
    except BoundContradictionError:
        return
    direct = structured_bound(records, weights, DELTA, 1e-4)
    assert report.structured == direct
    assert report.structured.epsilon_pld <= report.generic.epsilon_pld + ORDERING_SLACK


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["rs", "lc", "mixture"]))
def test_a_calibrated_release_meets_its_target_and_its_ledger_covers_it(data, method):
    """Certified ε ≤ target for every method, recomputed from the returned merge; the
    ledger's cumulative bound over the release's used candidates is never below it."""
    records = data.draw(candidate_sets())
    epsilons = [candidate_bound(r, DELTA).epsilon for r in records]
    top = generic_bound(records, [1 / len(records)] * len(records), DELTA).epsilon
    target = min(epsilons) + data.draw(st.floats(0.0, 1.2)) * (top - min(epsilons))
    result = calibrate(records, method, target, DELTA)
    assert result.epsilon <= target
    if method == "mixture":
        again = mixture_report(records, [(r.probability, r.weights) for r in result.rungs], DELTA)
    else:
        again = account(records, method, result.weights, DELTA)
    assert again.epsilon == result.epsilon
    ledger = cumulative_bound([release_for("r", records, result.report)], DELTA)
    assert ledger.epsilon >= result.epsilon - 1e-9


@FEW
@given(st.data())
def test_a_mixture_lies_between_its_rungs(data):
    """PLD: ε of the mixture lies between the rungs' ε (δ(ε) is their convex combination);
    RDP: the mixture's curve lies between theirs at every order."""
    records = data.draw(candidate_sets())
    k = len(records)
    first, second = data.draw(weights_for(k)), data.draw(weights_for(k))
    p = data.draw(st.floats(0.01, 0.99))
    report = mixture_report(records, [(p, first), (1 - p, second)], DELTA)
    low, high = sorted(r.bound.epsilon_pld for r in report.rungs)
    assert low - 1e-6 <= report.gating.epsilon_pld <= high + 1e-6
    curves = [
        np.asarray(
            composed_rdp(release_units([c for c, w in zip(records, ws, strict=True) if w > 0]))
        )
        for ws in (first, second)
    ]
    from dpmerge.accounting.rs import rs_rdp_curve

    mixed = rs_rdp_curve(curves, [p, 1 - p])
    finite = np.isfinite(mixed)
    assert np.all(mixed[finite] <= np.maximum(*curves)[finite] * (1 + 1e-12) + 1e-12)
    assert np.all(mixed[finite] >= np.minimum(*curves)[finite] * (1 - 1e-12) - 1e-12)
    assert report.gating.epsilon_rdp == pytest.approx(
        rdp_mod.epsilon_from_rdp(mixed, DELTA)[0], rel=1e-12
    )


@FEW
@given(st.data())
def test_auto_chooses_the_highest_expected_proxy(data):
    records = data.draw(candidate_sets())
    epsilons = [candidate_bound(r, DELTA).epsilon for r in records]
    target = min(epsilons) * data.draw(st.floats(1.0, 4.0))
    offered = {m: calibrate(records, m, target, DELTA) for m in ("rs", "lc", "mixture")}
    choice = choose_method(offered, records)
    best = max(u for u in choice.utilities.values() if u is not None)
    assert choice.utilities[str(choice.method)] >= best - 1e-12 * max(1.0, abs(best))
    assert choice.calibration.epsilon <= target


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1e4, allow_nan=False), st.floats(1e-6, 1e4, allow_nan=False))
def test_a_displayed_epsilon_is_never_below_the_certified_one(value, target):
    shown = epsilon_text(value)
    assert float(shown) >= value
    assert float(shown) - value <= 1e-4 * (1 + 1e-9) + 1e-12 * value
    text = within_text(value, target)
    shown_value = float(text.split(" ")[2])
    assert shown_value >= value
    if value <= target:
        assert "≤" in text and float(text.split("ε* = ")[1]) <= target
    else:
        assert ">" in text


def test_the_property_strategies_reach_shared_batches():
    """The candidate strategy does produce shared-batch units (so the properties cover them)."""
    records = [
        make_record(f"c{i}", 1.0, steps=50, sample_rate=0.01, batch_lineage="same")
        for i in range(2)
    ]
    assert len(release_units(records)) == 1
    assert account_mod.check_candidates(records)
