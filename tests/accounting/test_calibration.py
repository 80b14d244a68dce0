"""Calibration to a target (docs/design.md#calibration), including hypothesis property tests."""

from __future__ import annotations

import inspect
import itertools

import pytest
from factories import make_checkpoints, make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpmerge.accounting.account import account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.generic_search import subset_weights
from dpmerge.accounting.records import PrivacyLabel
from dpmerge.accounting.weights import initialisation_conflict, merged_noise_proxy
from dpmerge.errors import InfeasibleTargetError, RecordError

DELTA = 1e-5
PROPERTY = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def epsilons(candidates):
    return [candidate_bound(c, DELTA).epsilon for c in candidates]


@pytest.mark.parametrize("method", ["rs", "lc"])
def test_target_below_the_most_private_candidate_is_infeasible(short_ladder, method):
    low = min(epsilons(short_ladder))
    with pytest.raises(InfeasibleTargetError) as raised:
        calibrate(short_ladder, method, low * 0.9, DELTA)
    assert raised.value.reachable_epsilon_range[0] == pytest.approx(low)
    assert "below the most private" in str(raised.value)


def test_rs_reproduces_the_linear_programme(ladder):
    """Utility-experiment values: at ε* = 1, π = (σ 1.0: 0.303, σ 1.5: 0.697)."""
    result = calibrate(ladder, "rs", 1.0, DELTA)
    assert result.weights[1] == pytest.approx(0.303, abs=0.002)
    assert result.weights[2] == pytest.approx(0.697, abs=0.002)
    assert result.epsilon <= 1.0
    assert result.epsilon == pytest.approx(1.0, abs=1e-4)
    assert result.report.gating.kind == "selection"


def test_rs_probabilities_come_from_the_records_only(ladder):
    """π is a function of the records: there is no way to pass accuracies (the audit found
    validation accuracies steering π), and a validation utility is refused for RS."""
    assert "utilities" not in inspect.signature(calibrate).parameters
    with pytest.raises(TypeError):
        calibrate(ladder, "rs", 1.0, DELTA, utilities=[0.8, 0.81, 0.82, 0.83, 0.84])
    with pytest.raises(RecordError, match="generic bound only"):
        calibrate(ladder, "rs", 1.0, DELTA, merge_utility=lambda weights: weights[-1])
    result = calibrate(ladder, "rs", 1.0, DELTA)
    assert result.utility_kind.startswith("noise proxy")
    assert result.utility == pytest.approx(
        -sum(
            p * c.noise_multiplier**2 / c.steps for p, c in zip(result.weights, ladder, strict=True)
        ),
        rel=1e-9,
    )


@PROPERTY
@given(a=st.floats(0.0, 1.0), b=st.floats(0.0, 1.0))
def test_rs_epsilon_is_monotone_along_a_two_candidate_path(short_ladder, a, b):
    low, high = sorted((a, b))
    safer, riskier = short_ladder[3], short_ladder[0]
    e_low = account([riskier, safer], "rs", [low, 1 - low], DELTA).gating.epsilon_pld
    e_high = account([riskier, safer], "rs", [high, 1 - high], DELTA).gating.epsilon_pld
    assert e_low <= e_high + 1e-9


def test_lc_generic_picks_the_best_feasible_subset(ladder):
    """Brute force over every subset: nothing with better utility meets the target."""
    target = 1.5
    result = calibrate(ladder, "lc", target, DELTA)
    assert result.report.gating.kind == "generic"
    assert result.epsilon <= target
    best_utility = result.utility
    for r in range(1, len(ladder) + 1):
        for subset in itertools.combinations(range(len(ladder)), r):
            members = [ladder[i] for i in subset]
            utility = -merged_noise_proxy(members, subset_weights(members))
            if utility <= best_utility + 1e-12:
                continue
            weights = [0.0] * len(ladder)
            for i, w in zip(subset, subset_weights(members), strict=True):
                weights[i] = w
            assert account(ladder, "lc", weights, DELTA).epsilon > target


def test_lc_generic_reproduces_the_notes(ladder):
    """notes: two σ 1.5/2.0 inverse-variance candidates compose to ε 0.699."""
    candidates = ladder[1:4]  # σ 1.0, 1.5, 2.0: only 1.5 and 2.0 meet ε* = 0.75 alone
    result = calibrate(candidates, "lc", 0.75, DELTA)
    assert result.weights[0] == 0.0
    assert result.weights[1] == pytest.approx(0.64, abs=1e-9)  # λ ∝ σ⁻²
    assert result.epsilon == pytest.approx(0.699, abs=2e-3)


@PROPERTY
@given(data=st.data())
def test_lc_generic_calibrated_epsilon_never_exceeds_the_target(short_ladder, data):
    low = min(epsilons(short_ladder))
    target = data.draw(st.floats(low, 4 * low))
    result = calibrate(short_ladder, "lc", target, DELTA)
    assert result.epsilon <= target
    assert result.report.generic.epsilon_pld == result.report.gating.epsilon_pld


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_lc_structured_calibration_properties(short_ladder, data):
    """Certified ε ≤ target, and every reported feasible segment certifies at the fine
    discretisation (checked at its ends and midpoint)."""
    low = min(epsilons(short_ladder))
    target = data.draw(st.floats(low, 3 * low))
    result = calibrate(
        short_ladder, "lc", target, DELTA, gating_bound="structured", map_segments=True
    )
    assert result.report.gating.kind == "structured"
    assert result.epsilon <= target
    assert result.report.structured.epsilon_pld <= result.report.generic.epsilon_pld
    start, end = result.search["path_from"], result.search["path_to"]
    for t_low, t_high in result.search["feasible_segments"]:
        for t in (t_low, (t_low + t_high) / 2, t_high):
            weights = [(1 - t) * a + t * b for a, b in zip(start, end, strict=True)]
            total = sum(weights)
            weights = [w / total for w in weights]
            report = account(short_ladder, "lc", weights, DELTA, gating_bound="structured")
            assert report.epsilon <= target


@settings(max_examples=10, deadline=None)
@given(t=st.floats(0.0, 1.0))
def test_lc_structured_never_exceeds_generic_along_a_pair(t):
    a = make_record("a", 0.9, steps=300, sample_rate=0.01, batch=600.0)
    b = make_record("b", 1.3, steps=300, sample_rate=0.01, batch=600.0)
    report = account([a, b], "lc", [t, 1 - t], DELTA)
    # At t = 0 or 1 both analyse one candidate; σ = 1/(1/σ) may differ in the last bit.
    assert report.structured.epsilon_pld <= report.generic.epsilon_pld + 1e-9
    assert report.structured.epsilon_rdp <= report.generic.epsilon_rdp + 1e-9


def test_structured_search_finds_both_segments_of_a_non_monotone_path():
    """Equal candidates: ε peaks at t = 0.5 above either end, so a target between the single
    candidate's ε and the peak is feasible near both ends and not in the middle
    (docs/design.md#calibration)."""
    a = make_record("a", 1.0, steps=300, sample_rate=0.01, batch=600.0)
    b = make_record("b", 1.0, steps=300, sample_rate=0.01, batch=600.0)
    single = candidate_bound(a, DELTA).epsilon
    peak = account([a, b], "lc", [0.5, 0.5], DELTA).structured.epsilon
    assert peak > single
    target = (single + peak) / 2
    result = calibrate([a, b], "lc", target, DELTA, gating_bound="structured", map_segments=True)
    segments = result.search["feasible_segments"]
    assert len(segments) == 2
    assert segments[0][0] == 0.0 and segments[1][1] == 1.0
    assert segments[0][1] < 0.5 < segments[1][0]
    assert result.epsilon <= target


def test_validation_utilities_cannot_steer_a_choice_beyond_the_released_subset(ladder):
    """The subset is chosen by the data-independent proxy; validation accuracy only tunes the
    weights within it, where every weighting has the subset's generic bound."""
    plain = calibrate(ladder, "lc", 1.5, DELTA)

    def prefer_the_noisiest(weights):  # a "validation accuracy" that wants another subset
        return weights[-1] - 0.01 * weights[0]

    tuned = calibrate(ladder, "lc", 1.5, DELTA, merge_utility=prefer_the_noisiest)
    members = [w > 0 for w in plain.weights]
    assert [w > 0 for w in tuned.weights] == members
    assert tuned.weights != plain.weights  # tuned within the subset
    assert tuned.report.generic.epsilon_pld == plain.report.generic.epsilon_pld
    assert not tuned.report.structured.available
    assert "tuned by validation accuracy" in tuned.report.structured.reason
    for gate, method in (("structured", "lc"), ("generic", "rs")):
        with pytest.raises(RecordError, match="generic bound only"):
            calibrate(ladder, method, 1.5, DELTA, gating_bound=gate, merge_utility=len)


def test_lc_above_the_reachable_range_returns_the_best_merge(short_ladder):
    result = calibrate(short_ladder, "lc", 1e3, DELTA)
    assert all(w > 0 for w in result.weights)  # everything, inverse-variance
    assert result.epsilon < 1e3


def test_label_only_candidates_in_calibration(short_ladder):
    label = PrivacyLabel(name="vendor", dataset=short_ladder[0].dataset, epsilon=0.2, delta=1e-6)
    candidates = [*short_ladder, label]
    # RS accepts labels; the most private candidate alone is the label here.
    result = calibrate(candidates, "rs", 0.25, DELTA)
    assert result.epsilon <= 0.25
    # LC without utilities leaves the label out, and says so; with a utility it may use it.
    lc = calibrate(candidates, "lc", 2.0, DELTA)
    assert lc.weights[-1] == 0.0
    assert any("vendor" in s for s in lc.search["skipped"])
    only_label = calibrate(candidates, "lc", 0.25, DELTA)
    assert only_label.weights[-1] == 1.0


def test_candidates_from_different_initialisations_are_never_averaged():
    """A data-independent rule read off the records: weights of runs that started from different
    initialisations are not averaged (non-convex models sit in different basins)."""
    shared = [
        make_record(f"a{s}", s, steps=300, sample_rate=0.01, batch=600.0, initialisation="seed-0")
        for s in (0.9, 1.3)
    ]
    other = make_record(
        "b1.1", 1.1, steps=300, sample_rate=0.01, batch=600.0, initialisation="seed-9"
    )
    candidates = [*shared, other]
    top = 10 * max(epsilons(candidates))
    for gate in ("generic", "structured"):
        result = calibrate(candidates, "lc", top, DELTA, gating_bound=gate)
        used = {c.initialisation for c, w in zip(candidates, result.weights, strict=True) if w > 0}
        assert len(used) == 1, gate
    generic = calibrate(candidates, "lc", top, DELTA)
    assert generic.weights[2] == 0.0 and all(w > 0 for w in generic.weights[:2])
    assert any("different initialisations" in s for s in generic.search["skipped"])
    report = account(candidates, "lc", [0.4, 0.3, 0.3], DELTA)
    assert any("different initialisations" in n for n in report.notes)


def test_an_import_that_does_not_state_its_initialisation_starts_from_its_own():
    """An imported candidate whose profile names no initialisation is never averaged with
    another candidate (docs/design.md#imported-candidates); naming the shared start lets LC
    average it, a DP-SGD record and a label alike."""
    own = [
        make_record(f"a{s}", s, steps=300, sample_rate=0.01, batch=600.0, initialisation="seed-0")
        for s in (0.9, 1.3)
    ]
    imported = make_record(
        "imp1.1", 1.1, steps=300, sample_rate=0.01, batch=600.0, initialisation=None
    )
    imported = imported.model_copy(update={"attested_by": "Acme"})
    top = 10 * max(epsilons([*own, imported]))
    unstated = calibrate([*own, imported], "lc", top, DELTA)
    assert unstated.weights[2] == 0.0 and all(w > 0 for w in unstated.weights[:2])
    said = "'imp1.1' (imported, initialisation not stated)"
    assert any(said in s for s in unstated.search["skipped"])
    stated = imported.model_copy(update={"initialisation": "seed-0"})
    assert all(w > 0 for w in calibrate([*own, stated], "lc", top, DELTA).weights)
    stated_start = {"initialisation": "seed-0"}
    twin = imported.model_copy(update={"name": "imp-twin"})  # two silent imports: two starts
    assert initialisation_conflict([imported, twin]) is not None
    assert initialisation_conflict([stated, twin.model_copy(update=stated_start)]) is None
    label = PrivacyLabel(
        name="pair", dataset=own[0].dataset, epsilon=0.5, delta=1e-7, attested_by="Acme"
    )
    conflict = initialisation_conflict([own[0], label])
    assert conflict is not None and "'pair' (imported, initialisation not stated)" in conflict
    assert initialisation_conflict([own[0], label.model_copy(update=stated_start)]) is None
    legacy = make_record("old", 1.0, initialisation=None)  # not imported: not compared
    assert legacy.initialisation is None and initialisation_conflict([own[0], legacy]) is None


def test_checkpoints_of_one_run_are_averaged_at_the_cost_of_the_longest():
    """A run's kept checkpoints join a rung together, up to a common stop: the LC averages its
    iterates, and its generic ε is the longest checkpoint's (docs/design.md#release-units)."""
    candidates = make_checkpoints(1.0) + make_checkpoints(2.0)
    longest = candidate_bound(candidates[2], DELTA).epsilon
    result = calibrate(candidates, "lc", longest, DELTA)
    used = [c for c, w in zip(candidates, result.weights, strict=True) if w > 0]
    assert {c.name for c in used} == {"run1.0-100", "run1.0-150", "run1.0-200"}
    assert result.epsilon == pytest.approx(longest, abs=1e-9)
    assert len({w for w in result.weights if w > 0}) == 1  # equal weights: a tail average
    # Between two stops of the noisier run, the ladder stops that run early.
    second = candidate_bound(candidates[4], DELTA).epsilon
    early = calibrate(candidates[3:], "lc", second * 1.0001, DELTA)
    assert [c.name for c, w in zip(candidates[3:], early.weights, strict=True) if w > 0] == [
        "run2.0-100",
        "run2.0-150",
    ]
    mixed = calibrate(candidates, "mixture", (longest + second) / 2, DELTA)
    assert mixed.epsilon <= (longest + second) / 2
    for rung in mixed.rungs:
        steps = {c.run_id: [] for c in candidates}
        for c, w in zip(candidates, rung.weights, strict=True):
            if w > 0:
                steps[c.run_id].append(c.steps)
        for taken in steps.values():  # each run from its first kept checkpoint up to a stop
            assert taken == sorted(taken) and (not taken or taken[0] == 100)
