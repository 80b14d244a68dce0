"""One ledger per data source (docs/design.md#release-ledger): every release whose candidates
trained on rows of one source — whatever subset of it — is counted in that source's cumulative
bound, which is charged to everyone in the source. The ledgers kept per dataset identifier
before (one document per subset) are read and merged; nothing is rewritten."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from factories import make_record

from dpmerge.accounting.ledger import cumulative_bound, release_of
from dpmerge.accounting.records import MechanismRecord
from dpmerge.errors import RefusalError
from dpmerge.keys import WorkflowKey
from dpmerge.state import CountedRelease, LocalBackend, StateStore, serving

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


def _entry(release_id: str, record: MechanismRecord) -> CountedRelease:
    return CountedRelease.of(
        release_of(release_id, "lc", [record], [1.0]),
        versions={record.name: f"{record.dataset} v1"},
        delta=DELTA,
        policy="p",
        policy_version=1,
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
