"""Release units of the generic bound (docs/design.md#release-units), checked against
independent computations: dp_accounting's own accountants on events built here, and a direct
numerical integral for one step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import integrate, optimize, stats

from dpmerge.accounting import generic, profiles
from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting.account import MAX_CANDIDATES, account
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.generic import ReleaseUnit, Segment, generic_bound, release_units
from dpmerge.accounting.ledger import cumulative_bound, release_of
from dpmerge.accounting.structured import ORDERING_SLACK
from dpmerge.errors import InputError, RecordError, RefusalError
from dpmerge.vocabulary import UnitKind

DELTA = 1e-5
RDP_ORDERS = rdp_privacy_accountant.DEFAULT_RDP_ORDERS


def subsampled(sigma: float, q: float, steps: int) -> dp_event.DpEvent:
    return dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps
    )


def library_epsilons(events: list[dp_event.DpEvent], delta: float = DELTA) -> tuple[float, float]:
    """(PLD ε, RDP ε) of the composition of ``events``, by dp_accounting alone."""
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    rdp = rdp_privacy_accountant.RdpAccountant(orders=RDP_ORDERS)
    for event in events:
        pld.compose(event)
        rdp.compose(event)
    return pld.get_epsilon(delta), rdp.get_epsilon(delta)


def effective_sigma(sigmas: list[float]) -> float:
    return sum(s**-2 for s in sigmas) ** -0.5


def shared(name: str, sigma: float, **kwargs) -> object:
    return make_record(name, sigma, batch_lineage="shared-batches", **kwargs)


@pytest.mark.parametrize(
    "sigmas", [(1.5, 1.5), (1.0, 2.0), (0.9, 1.3, 2.5)], ids=["equal", "unequal", "three"]
)
def test_shared_batches_are_one_subsampled_gaussian(sigmas):
    """Runs on the same Poisson batches with independent noise: one subsampled Gaussian per
    step at σ_eff = (Σσ_i⁻²)^(−1/2), not a composition of independent runs."""
    q, steps = 0.01, 1000
    records = [shared(f"r{i}", s, sample_rate=q, steps=steps) for i, s in enumerate(sigmas)]
    bound = generic_bound(records, [1 / len(records)] * len(records), DELTA)
    pld_eps, rdp_eps = library_epsilons([subsampled(effective_sigma(list(sigmas)), q, steps)])
    assert bound.epsilon_pld == pytest.approx(pld_eps, abs=1e-6)
    assert bound.epsilon_pld >= pld_eps
    assert bound.epsilon_rdp == pytest.approx(rdp_eps, rel=1e-9)
    independent, _ = library_epsilons([subsampled(s, q, steps) for s in sigmas])
    assert bound.epsilon_pld > independent  # composing them as independent understates ε
    (unit,) = release_units(records)
    assert unit.kind == UnitKind.SHARED_BATCHES


def test_design_example_two_sigma_1_5_runs_on_shared_batches():
    """docs/design.md#release-units: 1.32 composed as independent vs 1.62 correct."""
    records = [shared(n, 1.5, sample_rate=0.01, steps=1000) for n in "ab"]
    assert generic_bound(records, [0.5, 0.5], DELTA).epsilon_pld == pytest.approx(1.6238, abs=1e-4)
    apart = [make_record(n, 1.5, sample_rate=0.01, steps=1000) for n in "ab"]
    assert generic_bound(apart, [0.5, 0.5], DELTA).epsilon_pld == pytest.approx(1.3228, abs=1e-4)


def test_unequal_steps_split_the_shared_unit_by_active_runs():
    q = 0.02
    a = shared("a", 1.0, sample_rate=q, steps=400)
    b = shared("b", 1.4, sample_rate=q, steps=1000)
    c = shared("c", 2.0, sample_rate=q, steps=700)
    bound = generic_bound([a, b, c], [0.2, 0.3, 0.5], DELTA)
    events = [
        subsampled(effective_sigma([1.0, 1.4, 2.0]), q, 400),
        subsampled(effective_sigma([1.4, 2.0]), q, 300),
        subsampled(1.4, q, 300),
    ]
    pld_eps, rdp_eps = library_epsilons(events)
    assert bound.epsilon_pld == pytest.approx(pld_eps, abs=1e-6)
    assert bound.epsilon_rdp == pytest.approx(rdp_eps, rel=1e-9)
    (unit,) = release_units([a, b, c])
    assert [s.steps for s in unit.segments] == [400, 300, 300]


def test_mixed_lineages_compose_units():
    """Two runs on shared batches, one independent run, one label: three units composed."""
    q, steps = 0.01, 800
    a = shared("a", 1.2, sample_rate=q, steps=steps)
    b = shared("b", 1.6, sample_rate=q, steps=steps)
    c = make_record("c", 1.1, sample_rate=q, steps=steps)
    bound = generic_bound([a, b, c], [0.3, 0.3, 0.4], DELTA)
    pld_eps, rdp_eps = library_epsilons(
        [subsampled(effective_sigma([1.2, 1.6]), q, steps), subsampled(1.1, q, steps)]
    )
    assert bound.epsilon_pld == pytest.approx(pld_eps, abs=1e-6)
    assert bound.epsilon_rdp == pytest.approx(rdp_eps, rel=1e-9)
    assert any("same Poisson batches" in a for a in bound.assumptions)


def _exact_one_step_epsilon(sigma: float, q: float, delta: float) -> float:
    """ε of one Poisson-subsampled Gaussian step (sensitivity 1) by numerical integration of
    the hockey-stick divergence in both directions: P = (1−q)N(0,σ²) + qN(1,σ²), Q = N(0,σ²)."""

    def hockey_stick(epsilon: float) -> float:
        def p(x):
            return (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, 1, sigma)

        def q_(x):
            return stats.norm.pdf(x, 0, sigma)

        bound = 40 * sigma + 1
        remove = integrate.quad(
            lambda x: max(p(x) - math.exp(epsilon) * q_(x), 0), -bound, bound, limit=400
        )[0]
        add = integrate.quad(
            lambda x: max(q_(x) - math.exp(epsilon) * p(x), 0), -bound, bound, limit=400
        )[0]
        return max(remove, add)

    return optimize.brentq(lambda e: hockey_stick(e) - delta, 0.01, 50, xtol=1e-9)


def test_one_step_shared_pair_against_numerical_integration():
    """The audit's reproduction: σ = 0.8, q = 0.1, T = 1, shared batches, λ = (½, ½).
    Composed as independent it read 3.076; the exact ε of this release is 5.304."""
    a = shared("a", 0.8, sample_rate=0.1, steps=1)
    b = shared("b", 0.8, sample_rate=0.1, steps=1)
    exact = _exact_one_step_epsilon(0.8 / math.sqrt(2), 0.1, DELTA)
    assert exact == pytest.approx(5.304, abs=2e-3)
    report = account([a, b], "lc", [0.5, 0.5], DELTA)
    for bound in (report.generic, report.structured):
        assert exact <= bound.epsilon_pld <= exact + 1e-3
    assert report.structured.epsilon_pld <= report.generic.epsilon_pld + ORDERING_SLACK


def test_a_target_between_the_old_and_the_true_value_is_not_met_by_averaging():
    a = shared("a", 0.8, sample_rate=0.1, steps=1)
    b = shared("b", 0.8, sample_rate=0.1, steps=1)
    generic = calibrate([a, b], "lc", 4.0, DELTA)
    assert generic.epsilon <= 4.0
    assert sum(w > 0 for w in generic.weights) == 1  # the pair's joint release is 5.30
    # The structured gate may mix them unequally; on shared batches its value is exact: one
    # subsampled Gaussian with σ = sqrt(Σλ_i²σ_i²) / Σλ_i (equal η, C, B here).
    structured = calibrate([a, b], "lc", 4.0, DELTA, gating_bound="structured")
    w = structured.weights
    sigma = 0.8 * math.sqrt(sum(x * x for x in w)) / sum(w)
    recomputed, _ = library_epsilons([subsampled(sigma, 0.1, 1)])
    assert structured.epsilon <= 4.0 and recomputed <= 4.0 + 1e-9


def test_checkpoints_collapse_only_on_an_explicit_run_identity():
    kwargs = dict(noise_lineage="noise-seed-3", batch_lineage="poisson-seed-3")
    early = make_record("early", 1.0, steps=1000, run_id="run-1", **kwargs)
    late = make_record("late", 1.0, steps=2000, run_id="run-1", **kwargs)
    (unit,) = release_units([early, late])
    assert unit.members == ("early", "late") and unit.segments[0].steps == 2000
    # Two runs with the same seeds and hyper-parameters but no run id are ambiguous...
    twin_a = make_record("a", 1.0, steps=1000, **kwargs)
    twin_b = make_record("b", 1.0, steps=2000, **kwargs)
    with pytest.raises(RefusalError, match="without a run_id"):
        release_units([twin_a, twin_b])
    # ...and two distinct run ids are a reused noise stream.
    other = make_record("other", 1.0, steps=2000, run_id="run-2", **kwargs)
    with pytest.raises(RefusalError, match="different runs"):
        release_units([early, other])
    # RS needs no independence.
    assert account([twin_a, twin_b], "rs", [0.5, 0.5], DELTA).gating.available


def test_ledger_over_shared_batch_candidates_is_the_unit_composition():
    q, steps = 0.01, 600
    a = shared("a", 1.0, sample_rate=q, steps=steps)
    b = shared("b", 1.5, sample_rate=q, steps=steps)
    c = make_record("c", 2.0, sample_rate=q, steps=steps)
    releases = [
        release_of("r1", "rs", [a, b, c], [0.5, 0.0, 0.5]),
        release_of("r2", "lc", [a, b, c], [0.0, 1.0, 0.0]),
    ]
    cumulative = cumulative_bound(releases, DELTA)
    pld_eps, rdp_eps = library_epsilons(
        [subsampled(effective_sigma([1.0, 1.5]), q, steps), subsampled(2.0, q, steps)]
    )
    assert cumulative.epsilon_pld == pytest.approx(pld_eps, abs=1e-6)
    assert cumulative.epsilon_rdp == pytest.approx(rdp_eps, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Properties over random lineage structures


@st.composite
def lineage_sets(draw):
    """2–4 cheap candidates; each in one of up to 3 batch lineages (q per lineage), each with
    its own noise lineage; random σ and step counts."""
    k = draw(st.integers(2, 4))
    groups = [draw(st.integers(0, 2)) for _ in range(k)]
    rates = {g: draw(st.sampled_from([0.005, 0.01, 0.02])) for g in set(groups)}
    records = [
        make_record(
            f"c{i}",
            draw(st.sampled_from([0.8, 1.0, 1.3, 1.8, 2.5])),
            steps=draw(st.sampled_from([100, 200, 300])),
            sample_rate=rates[g],
            batch=600.0,
            batch_lineage=f"batches-{g}",
        )
        for i, g in enumerate(groups)
    ]
    weights = [draw(st.floats(0.05, 1.0)) for _ in range(k)]
    total = math.fsum(weights)
    return records, [w / total for w in weights]


PROPERTY = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(lineage_sets())
def test_generic_bound_dominates_subsets_and_candidates(case):
    records, weights = case
    bound = generic_bound(records, weights, DELTA)
    for r in range(1, len(records)):
        for i in range(len(records) - r + 1):
            subset = records[i : i + r]
            sub = generic_bound(subset, [1 / r] * r, DELTA)
            assert bound.epsilon_pld >= sub.epsilon_pld - 1e-9
            assert bound.epsilon_rdp >= sub.epsilon_rdp - 1e-9
    for record in records:
        assert bound.epsilon_pld >= candidate_bound(record, DELTA).epsilon_pld - 1e-9
    if len({r.batch_lineage for r in records}) == len(records):
        composed, rdp_eps = library_epsilons([r.dp_event() for r in records])
        assert bound.epsilon_pld == pytest.approx(composed, abs=1e-6)
        assert bound.epsilon_rdp == pytest.approx(rdp_eps, rel=1e-9)


@PROPERTY
@given(lineage_sets())
def test_structured_never_exceeds_generic_without_a_cap(case):
    records, weights = case
    report = account(records, "lc", weights, DELTA)  # raises if the ordering is violated
    assert report.structured.available
    assert report.structured.epsilon_pld <= report.generic.epsilon_pld + ORDERING_SLACK


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lineage_sets(), st.floats(0.0, 1.0), st.sampled_from(["generic", "structured"]))
def test_calibration_never_certifies_above_an_independent_recomputation(case, where, gate):
    """Whatever the lineage structure, the certified merge's ε recomputed here (units built by
    the test, composed by dp_accounting) meets the target."""
    records, _ = case
    epsilons = [candidate_bound(r, DELTA).epsilon for r in records]
    everything = generic_bound(records, [1 / len(records)] * len(records), DELTA).epsilon
    target = min(epsilons) + where * (everything - min(epsilons))
    result = calibrate(records, "lc", target, DELTA, gating_bound=gate)
    used = [r for r, w in zip(records, result.weights, strict=True) if w > 0]
    events = []
    for lineage in sorted({r.batch_lineage for r in used}):
        group = [r for r in used if r.batch_lineage == lineage]
        previous = 0
        for end in sorted({r.steps for r in group}):
            active = [r.noise_multiplier for r in group if r.steps >= end]
            events.append(subsampled(effective_sigma(active), group[0].sample_rate, end - previous))
            previous = end
    recomputed, _ = library_epsilons(events)
    if gate == "generic":
        assert recomputed <= target + 1e-9
    assert result.epsilon <= target


# ---------------------------------------------------------------------------------------------
# Limits and bad values


def test_too_many_candidates_fail_fast_with_the_limit():
    many = [make_record(f"c{i}", 1.0 + i / 100) for i in range(MAX_CANDIDATES + 1)]
    with pytest.raises(RecordError, match=f"at most {MAX_CANDIDATES}"):
        calibrate(many, "lc", 2.0, DELTA)
    with pytest.raises(RecordError, match=f"at most {MAX_CANDIDATES}"):
        account(many, "rs", [1 / len(many)] * len(many), DELTA)


def test_weights_and_delta_are_strictly_typed(ladder):
    with pytest.raises(RecordError, match="must be numbers"):
        account(ladder[:2], "lc", [True, False], DELTA)
    with pytest.raises(RecordError, match="δ must be a number"):
        account(ladder[:2], "lc", [0.5, 0.5], True)
    with pytest.raises(InputError, match="method must be one of"):
        account(ladder[:2], "avg", [0.5, 0.5], DELTA)


def test_a_pld_beyond_the_grid_is_refused_and_rdp_stands(monkeypatch):
    monkeypatch.setattr(pld_mod, "MAX_PLD_LENGTH", 1000)
    pld_mod.candidate_pld.cache_clear()
    record = make_record("huge", 0.5, steps=5000, sample_rate=0.5)
    try:
        bound = candidate_bound.__wrapped__(record, DELTA)
    finally:
        pld_mod.candidate_pld.cache_clear()
    assert bound.epsilon_pld is None and "grid points" in bound.reason
    assert bound.epsilon_rdp is not None and np.isfinite(bound.epsilon_rdp)


def test_a_composed_pld_is_read_back_bit_identical_and_keyed_by_every_segment(
    tmp_path, monkeypatch
):
    """Each policy run is a fresh process: the composition of a subset's PLDs is kept on disk
    with the single PLDs, read back exactly, and a unit whose steps differ is another file."""
    units = (
        ReleaseUnit(UnitKind.RUN, ("a",), (Segment(1.3, 0.01, 50),)),
        ReleaseUnit(UnitKind.RUN, ("b",), (Segment(2.0, 0.01, 40),)),
    )
    pld_mod.set_disk_cache(tmp_path)
    try:
        built = generic.composed_pld.__wrapped__(units, 1e-3)
        assert len(list(tmp_path.glob("*.npz"))) == 3  # two segments and their composition
        with monkeypatch.context() as patched:
            patched.setattr(generic, "compose", lambda plds: pytest.fail("composed again"))
            again = generic.composed_pld.__wrapped__(units, 1e-3)
        for side in ("_pmf_remove", "_pmf_add"):
            assert getattr(again, side)._lower_loss == getattr(built, side)._lower_loss
            assert (getattr(again, side)._probs == getattr(built, side)._probs).all()
        longer = (units[0], ReleaseUnit(UnitKind.RUN, ("b",), (Segment(2.0, 0.01, 41),)))
        other = generic.composed_pld.__wrapped__(longer, 1e-3)
        assert len(list(tmp_path.glob("*.npz"))) == 5
        assert profiles.epsilon_for_delta(other, DELTA) > profiles.epsilon_for_delta(built, DELTA)
    finally:
        pld_mod.set_disk_cache(None)


def test_an_rdp_curve_is_read_back_exactly_from_the_file_cache(tmp_path, monkeypatch):
    from dpmerge.accounting import rdp

    pld_mod.set_disk_cache(tmp_path)
    try:
        built = rdp.subsampled_gaussian_rdp(1.3, 0.01, 50)
        with monkeypatch.context() as patched:
            patched.setattr(rdp, "_rdp_curve", lambda *a: pytest.fail("computed again"))
            again = rdp.subsampled_gaussian_rdp(1.3, 0.01, 50)
        assert again.tobytes() == built.tobytes()
        (path,) = tmp_path.glob("rdp-*.npz")
        path.write_bytes(b"altered")  # not trusted: computed again
        assert rdp.subsampled_gaussian_rdp(1.3, 0.01, 50).tobytes() == built.tobytes()
    finally:
        pld_mod.set_disk_cache(None)


def test_pld_file_cache_rejects_altered_files(tmp_path):
    pld_mod.set_disk_cache(tmp_path)
    try:
        key = (1.3, 0.01, 50, 1e-3)
        built = pld_mod.subsampled_gaussian_pld(*key)
        (path,) = tmp_path.glob("*.npz")
        assert profiles.epsilon_for_delta(pld_mod._read_cached(key), DELTA) == (
            profiles.epsilon_for_delta(built, DELTA)
        )
        # The same arrays under another key's name (a swapped file) are refused...
        other = (1.3, 0.01, 51, 1e-3)
        path.rename(pld_mod._cache_path(other))
        assert pld_mod._read_cached(other) is None
        # ...and so is an altered file (a probability changed, digest left alone).
        pld_mod._write_cached(key, built)
        stored = dict(np.load(path, allow_pickle=False))
        stored["remove_probs"] = stored["remove_probs"] * 0.5
        with open(path, "wb") as handle:
            np.savez(handle, **stored)
        assert pld_mod._read_cached(key) is None
    finally:
        pld_mod.set_disk_cache(None)
