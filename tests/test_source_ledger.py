"""One ledger per data source (docs/design.md#release-ledger): every release whose candidates
trained on rows of one source — whatever subset of it — is counted in that source's cumulative
bound, which is charged to everyone in the source. The ledgers kept per dataset identifier
before (one document per subset) are read and merged; nothing is rewritten. The test rows'
spending (each release's Laplace accuracy estimate) is counted too, and composed per person."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_record

from dpmerge.accounting.ledger import cumulative_bound, release_of
from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.accounting.records import MechanismRecord
from dpmerge.errors import RefusalError
from dpmerge.keys import WorkflowKey
from dpmerge.state import CountedRelease, LocalBackend, StateStore, serving
from dpmerge.state.store import StateIntegrityError
from dpmerge.vocabulary import Composition

DELTA = 1e-6
FULL = "digits-hmac:" + "a" * 32  # the published identifier of every training row
FIRST = "digits-hmac:" + "b" * 32  # of the first rows only (a --limit run)
OTHER = "fashion-mnist-hmac:" + "c" * 32


def _record(name: str, dataset: str, sigma: float, n: int, steps: int) -> MechanismRecord:
    run = f"{dataset}/{name}"  # published lineages are keyed per run: another subset, another run
    return make_record(
        name,
        sigma,
        steps=steps,
        sample_rate=256 / n,
        dataset=dataset,
        dataset_size=n,
        noise_lineage=f"{run}/noise",
        batch_lineage=f"{run}/batches",
    )


def _entry(
    release_id: str, record: MechanismRecord, evaluation: Evaluation | None = None
) -> CountedRelease:
    return CountedRelease.of(
        release_of(release_id, "lc", [record], [1.0]),
        versions={record.name: f"{record.dataset} v1"},
        delta=DELTA,
        policy="p",
        policy_version=1,
        evaluation=evaluation,
    )


@pytest.fixture
def store(tmp_path) -> StateStore:
    return StateStore(LocalBackend(tmp_path / "state"), WorkflowKey.generate())


def _joint(records: list[MechanismRecord]) -> tuple[float, float]:
    """(PLD, RDP) ε of the records' joint release, composed with dp_accounting directly."""
    event = dp_event.ComposedDpEvent([r.dp_event() for r in records])
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    rdp = rdp_privacy_accountant.RdpAccountant()
    return pld.compose(event).get_epsilon(DELTA), rdp.compose(event).get_epsilon(DELTA)


def test_two_candidates_on_overlapping_subsets_share_one_ledger(store: StateStore) -> None:
    """The audit's case: one candidate on every row, one on the first 20,000 (a second dataset
    identifier). Each document alone understates what a person in both subsets spent; the
    source's ledger is at least their joint composition, re-derived with dp_accounting."""
    everyone = _record("cand", FULL, 1.1, 54_000, 2_000)
    first = _record("cand", FIRST, 0.9, 20_000, 1_500)  # the same name: another subset's run
    serving.count(store, _entry("r-full", everyone), None)
    serving.count(store, _entry("r-first", first), None)
    per_document = [
        cumulative_bound([e.release() for e in serving.read_state(store, d).releases], DELTA)
        for d in (FULL, FIRST)
    ]
    joint_pld, joint_rdp = _joint([everyone, first])
    assert all(b.epsilon < joint_pld for b in per_document)  # what the audit found
    for dataset in (FULL, FIRST):
        state = serving.read_state(store, dataset)
        assert {e.release_id for e in state.ledger} == {"r-full", "r-first"}
        bound = state.cumulative(DELTA)
        assert bound.epsilon >= joint_pld and bound.epsilon_rdp >= joint_rdp - 1e-9
        assert bound.epsilon <= min(joint_rdp, joint_pld * 1.01)  # composed, not summed loosely
    assert serving.read_state(store, OTHER).ledger == ()  # another source: its own ledger
    assert serving.sources(store) == {"digits": sorted([FULL, FIRST])}


def test_the_ledgers_kept_per_identifier_are_read_and_merged(store: StateStore) -> None:
    """Documents written before (one per identifier, several releases each) are the migration's
    input: read, merged into their source's ledger, a release counted twice composed once, and
    left as they were."""
    records = [_record(f"c{i}", d, 1.0 + i / 4, 30_000, 1_000) for i, d in enumerate((FULL, FIRST))]
    for record in records:
        serving.count(store, _entry(f"r-{record.name}", record), None)
    serving.count(store, _entry("r-extra", _record("x", FIRST, 2.0, 30_000, 500)), None)
    serving.count(store, _entry("r-elsewhere", _record("y", OTHER, 1.0, 60_000, 500)), None)
    before = {d: store.read(serving.dataset_key(d)).document for d in (FULL, FIRST, OTHER)}
    state = serving.read_state(store, FULL)
    assert sorted(e.release_id for e in state.ledger) == ["r-c0", "r-c1", "r-extra"]
    assert [e.release_id for e in state.releases] == ["r-c0"]  # its own document's
    serving.count(store, _entry("r-c0", records[0]), None)  # counted again: no change
    assert {d: store.read(serving.dataset_key(d)).document for d in before} == before
    merged = cumulative_bound([e.release() for e in state.ledger], DELTA)
    assert state.cumulative(DELTA).epsilon == merged.epsilon
    joint_pld, _ = _joint([*records, _record("x", FIRST, 2.0, 30_000, 500)])
    assert merged.epsilon >= joint_pld


def test_a_cap_is_checked_against_the_whole_source(store: StateStore) -> None:
    """A subset's release that its own document would admit is refused when the source's
    cumulative bound with it exceeds the cap."""
    serving.count(store, _entry("r-full", _record("a", FULL, 0.8, 54_000, 2_000)), None)
    alone = cumulative_bound(
        [_entry("r", _record("b", FIRST, 0.8, 20_000, 1_000)).release()], DELTA
    )
    source = serving.read_state(store, FULL).cumulative(DELTA).epsilon
    cap = alone.epsilon + 0.01
    assert source > cap - alone.epsilon  # the two together exceed the cap
    with pytest.raises(RefusalError, match="above the cap"):
        serving.count(store, _entry("r-first", _record("b", FIRST, 0.8, 20_000, 1_000)), cap)
    assert serving.read_state(store, FIRST).releases == ()


N_TEST = 360  # the digits test rows


def _laplace_epsilon(epsilons: list[float], delta: float) -> float:
    """ε at ``delta`` of the Laplace estimates' composition, with dp_accounting's PLD: each
    estimate adds noise of scale 1/(n·ε) to a mean of sensitivity 1/n (noise multiplier 1/ε)."""
    events = [dp_event.LaplaceDpEvent(1 / epsilon) for epsilon in epsilons]
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    return pld.compose(dp_event.ComposedDpEvent(events)).get_epsilon(delta)


def test_the_test_rows_spending_of_each_release_is_counted(store: StateStore) -> None:
    """Two releases whose estimates spent ε_eval 0.5 and 1.0 on the same test rows: the ledger
    states the test rows' ε = 1.5 at δ = 0 (their sum), which bounds the composition
    dp_accounting's PLD accountant derives; one person (one identifier: disjoint splits) is
    bounded by the larger of the training and the test rows' ε."""
    for name, epsilon in (("a", 0.5), ("b", 1.0)):
        record = _record(name, FULL, 1.1, 54_000, 2_000)
        serving.count(store, _entry(f"r-{name}", record, Evaluation(epsilon, N_TEST)), None)
    state = serving.read_state(store, FULL)
    assert [e.evaluation for e in state.ledger] == [
        Evaluation(0.5, N_TEST),
        Evaluation(1.0, N_TEST),
    ]
    statement = state.statement(DELTA)
    assert statement.test.epsilon == 1.5 and statement.test.delta == 0.0
    assert statement.test.unrecorded == () and statement.test.releases == 2
    derived = _laplace_epsilon([0.5, 1.0], 1e-12)
    assert 1.5 * 0.99 <= derived <= 1.5 + 1e-9  # the sum is the bound, and a tight one
    assert _laplace_epsilon([0.5, 1.0], 1e-3) < 1.5  # a δ > 0 would buy less; none is claimed
    assert statement.training.epsilon == state.cumulative(DELTA).epsilon
    person = statement.person
    assert person.composition == Composition.PARALLEL and person.delta == DELTA
    assert person.epsilon == max(statement.training.epsilon, 1.5)


def test_a_person_of_two_subsets_is_charged_both_splits(store: StateStore) -> None:
    """Releases under two identifiers of one source (the audit's case): a subset's test rows
    are not known to be apart from another's training rows, so one person's bound is the sum
    of the training and the test rows' ε (sequential), not the larger."""
    serving.count(
        store, _entry("r-full", _record("a", FULL, 1.1, 54_000, 2_000), Evaluation(1.0, 360)), None
    )
    serving.count(
        store, _entry("r-first", _record("a", FIRST, 0.9, 20_000, 1_500), Evaluation(0.5, 72)), None
    )
    statement = serving.read_state(store, FIRST).statement(DELTA)
    assert statement.test.epsilon == 1.5
    assert statement.person.composition == Composition.SEQUENTIAL
    assert statement.person.epsilon >= statement.training.epsilon + 1.5


def test_entries_without_an_evaluation_read_and_leave_the_test_rows_unbounded(
    store: StateStore,
) -> None:
    """Entries counted before the ledger recorded evaluations (no ``evaluation`` key) read as
    they are and are named: the test rows' ε is not bounded (such a release may have published
    an exact accuracy), never a guessed number; nor is one person's."""
    serving.count(store, _entry("r-old", _record("a", FULL, 1.1, 54_000, 2_000)), None)
    serving.count(
        store, _entry("r-new", _record("b", FULL, 1.1, 54_000, 2_000), Evaluation(1.0, 360)), None
    )
    document = store.read(serving.dataset_key(FULL)).document
    assert ["evaluation" in r for r in document["releases"]] == [False, True]
    statement = serving.read_state(store, FULL).statement(DELTA)
    assert statement.test.epsilon is None and statement.test.unrecorded == ("r-old",)
    assert statement.person.epsilon is None
    assert statement.training.epsilon == serving.read_state(store, FULL).cumulative(DELTA).epsilon


@pytest.mark.parametrize(
    "evaluation",
    [
        {"epsilon": -1.0, "delta": 0.0, "mechanism": "laplace", "n": 360},
        {"epsilon": "1.0", "delta": 0.0, "mechanism": "laplace", "n": 360},
        {"epsilon": 1.0, "delta": 1e-6, "mechanism": "laplace", "n": 360},
        {"epsilon": 1.0, "delta": 0.0, "mechanism": "gaussian", "n": 360},
        {"epsilon": 1.0, "delta": 0.0, "mechanism": "laplace", "n": 0},
        {"epsilon": 1.0, "delta": 0.0, "mechanism": "laplace"},
        None,
    ],
)
def test_a_malformed_evaluation_makes_the_document_unreadable(
    store: StateStore, evaluation: object
) -> None:
    """A signed document whose entry holds a malformed evaluation is refused as a whole, in one
    line naming the repair (a state-integrity finding), not read with a guessed value."""
    serving.count(
        store, _entry("r", _record("a", FULL, 1.1, 54_000, 2_000), Evaluation(1.0, 360)), None
    )

    def damage(document: dict | None) -> tuple[dict, None]:
        assert document is not None
        document["releases"][0]["evaluation"] = evaluation
        return document, None

    store.update(serving.dataset_key(FULL), damage)  # signed: the workflow's own bug, say
    with pytest.raises(StateIntegrityError, match="cannot be read") as refused:
        serving.read_state(store, FULL)
    assert "\n" not in str(refused.value) and "dpmerge state restore" in str(refused.value)


def test_summed_epsilons_are_rounded_up() -> None:
    """Basic composition never rounds toward less privacy: the float returned is at least the
    exact sum of the floats added (checked in exact rational arithmetic)."""
    from fractions import Fraction

    from dpmerge.accounting.ledger import sum_up

    for epsilons in ([0.1, 0.2], [0.1] * 10, [1.0, 1e-17], [0.5, 1.0], [1 / 3, 1 / 7, 2 / 9]):
        total = sum_up(epsilons)
        assert Fraction(total) >= sum(map(Fraction, epsilons))
        assert total <= sum(epsilons) * (1 + 1e-15)  # by at most one step
