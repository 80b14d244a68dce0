"""The release ledger as a policy merge uses it (docs/design.md#release-ledger): the entry a
release is counted with, the cumulative bound a card shows, counting before anything of a
release is published, and the checks that make a damaged ledger fail closed.

The ledger itself lives in the release-state store, in the dataset's signed document
(:mod:`dpmerge.state.serving`). Two checks keep it honest:

* **signed**: an entry changed outside the workflow fails the document's signature
  (:class:`~dpmerge.state.StateIntegrityError`, repair ``dpmerge state restore``);
* **witnessed**: every merged version in MLflow whose release signature verifies had its
  evaluation published when it was registered, so the ledger must count it; a ledger that lacks
  one was rolled back or replaced (:class:`LedgerIntegrityError`, repair ``dpmerge ledger
  rebuild``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dpmerge.accounting.ledger import release_for, release_of
from dpmerge.accounting.private_accuracy import Evaluation, PrivateAccuracy
from dpmerge.accounting.private_selection import Selection
from dpmerge.accounting.records import candidate_from_dict
from dpmerge.errors import IntegrityError, RecordError
from dpmerge.manifests import ReleaseSignatureError
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.release import MergeRequest
from dpmerge.registry import RegisteredCandidate, Registry
from dpmerge.state import CountedRelease, DatasetState
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.releases import read_release
from dpmerge.state.serving import MAX_SELECTIONS
from dpmerge.state.store import stamp
from dpmerge.vocabulary import Composition
from dpmerge.workspace import Workspace


class LedgerIntegrityError(IntegrityError):
    """The ledger lacks a release the registry shows was published: it was rolled back or
    replaced; the message names the repair."""


def ledger_entry(
    request: MergeRequest,
    candidates: Sequence[RegisteredCandidate],
    plan: PolicyPlan,
    version: PolicyVersion,
) -> CountedRelease:
    """The ledger entry of the release ``request`` names: its candidates with non-zero weight
    (under private tuning every candidate the selection consulted, and what it spent on the
    validation rows) as published (keyed dataset identifier and lineages, signed with each
    candidate: every number the accountants use, never a fingerprint), asked for by
    ``version`` of its policy."""
    published = [c.published for c in candidates]
    release = release_for(request.content_hash, published, plan.calibration.report)
    if plan.consulted:  # a private selection: every candidate it consulted is counted
        release = release_of(
            request.content_hash,
            release.method,
            published,
            [float(c.name in plan.consulted) for c in published],
        )
    versions = {
        c.model_dir.record.name: f"{c.name} v{c.version}"
        for c in candidates
        if c.model_dir.record is not None
    }
    return CountedRelease.of(
        release,
        versions=versions,
        delta=plan.calibration.delta,
        policy=version.name,
        policy_version=version.version,
        evaluation=plan.evaluation,  # replaced by the drawn estimate's (evaluated)
        selections=(plan.selection,) if plan.selection is not None else (),
    )


def evaluated(entry: CountedRelease, metrics: Mapping[str, Any]) -> CountedRelease:
    """``entry`` with what its published accuracy estimate (in the merged model's
    ``metrics``) spent on the test rows; unchanged where they carry no private estimate."""
    estimate = PrivateAccuracy.from_metrics(metrics)
    return entry if estimate is None else replace(entry, evaluation=estimate.evaluation)


@dataclass(frozen=True)
class LedgerSummary:
    """The cumulative bound with a release counted, as its card shows it (``as_of``: the UTC
    time it was read), and why a cap refuses it (``refusal``; ``None`` when it does not):
    the training rows' ``epsilon`` at ``delta`` under ``accountant``; the test rows'
    ``test_epsilon`` (δ = 0, composed ``test_composition``; ``None`` where
    ``test_unrecorded`` releases have no recorded estimate) and one person's
    ``person_epsilon`` (at ``delta``, composed ``person_composition``), the validation rows'
    ``validation_epsilon`` (private selections, δ = 0),
    docs/design.md#release-ledger."""

    epsilon: float
    delta: float
    accountant: str
    candidates: tuple[str, ...]
    releases: int
    cap: float | None
    test_epsilon: float | None = None
    test_composition: str = Composition.SEQUENTIAL.value
    test_unrecorded: tuple[str, ...] = ()
    person_epsilon: float | None = None
    person_composition: str = Composition.SEQUENTIAL.value
    validation_epsilon: float = 0.0
    attempts: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    refusal: str | None = None
    as_of: str = field(default_factory=stamp)

    def card(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("refusal")
        data["candidates"] = list(self.candidates)
        data["attempts"] = list(self.attempts)
        data["test_unrecorded"] = list(self.test_unrecorded)
        return data


def check_witnessed(registry: Registry, state: DatasetState) -> None:
    """Every signed merged version of the dataset is counted (see the module docstring)."""
    counted = {r.release_id for r in state.releases}
    missing = []
    for stored in registry.merged_versions(state.dataset):
        try:
            facts = registry.release_facts(stored)
        except ReleaseSignatureError:
            continue  # not the workflow's: never reused or promoted, reported by verify
        if facts.content_hash not in counted:
            missing.append(f"{stored.name} v{stored.version}")
    if missing:
        raise LedgerIntegrityError(
            f"the release ledger of {state.dataset} lacks {len(missing)} published release(s) "
            f"(e.g. {missing[0]}): it was rolled back or replaced, so its cumulative bound would "
            "be too low; restore the state with `dpmerge state restore`, or add them back from "
            "the registry with `dpmerge ledger rebuild`"
        )


def _summary(state: DatasetState, entry: CountedRelease, cap: float | None) -> LedgerSummary:
    state_serving.check_records(state, entry)
    statement = state.statement(entry.delta, entry)
    bound = statement.training
    others = [r for r in state.ledger if r.release_id != entry.release_id]
    names = sorted({name for r in [*others, entry] for name in r.names})
    refusal = None if cap is None else state.cap_refusal(entry, cap)
    attempts = tuple(
        {
            "release": r.release_id,
            "method": r.method,
            "policy_version": r.policy_version,
            "counted_at": r.counted_at,
        }
        for r in state_serving.attempts(state, entry.policy, entry.release_id)
    )
    return LedgerSummary(
        epsilon=bound.epsilon,
        delta=entry.delta,
        accountant=str(bound.accountant),
        candidates=tuple(names),
        releases=len(others) + 1,
        cap=cap,
        test_epsilon=statement.test.epsilon,
        test_composition=statement.test.composition.value,
        test_unrecorded=statement.test.unrecorded,
        person_epsilon=statement.person.epsilon,
        person_composition=statement.person.composition.value,
        validation_epsilon=statement.validation,
        attempts=attempts,
        refusal=refusal,
    )


def ledger_summary(workspace: Workspace, entry: CountedRelease, cap: float | None) -> LedgerSummary:
    """The cumulative bound with ``entry`` counted, read only, after checking the ledger is
    signed and witnessed (nothing is written)."""
    state = state_serving.read_state(workspace.state(), entry.dataset)
    check_witnessed(workspace.registry(), state)
    return _summary(state, entry, cap)


def count_release(workspace: Workspace, entry: CountedRelease, cap: float | None) -> LedgerSummary:
    """Count ``entry`` in the ledger before anything of it is published (idempotent; a
    conditional write that keeps every concurrent release); :class:`RefusalError` when the cap
    refuses it now (a concurrent release took the room)."""
    store = workspace.state()
    state = state_serving.read_state(store, entry.dataset)
    check_witnessed(workspace.registry(), state)
    state_serving.count(store, entry, cap)
    return _summary(state_serving.read_state(store, entry.dataset), entry, None)


def rebuild_ledger(workspace: Workspace) -> list[str]:
    """Add back every signed merged version the ledger lacks (with its test-row estimate), and
    to a counted one the private selections it lacks (the repair for a ledger that was rolled
    back or replaced), read from the release's signed internal record
    (:mod:`dpmerge.state.releases`); returns the release ids added or completed. Needs the
    workflow's key.
    A signed release without an internal record is not guessed at: :class:`LedgerIntegrityError`
    names it."""
    registry = workspace.registry()
    store = workspace.state()
    added, unknown = [], []
    for stored in registry.merged_versions():
        try:
            facts = registry.release_facts(stored)
        except ReleaseSignatureError:
            continue
        state = state_serving.read_state(store, facts.dataset)
        before = state.entry(facts.content_hash)
        record = read_release(store, facts.content_hash)
        if record is None:
            unknown.append(f"{stored.name} v{stored.version}")
            continue
        records = [candidate_from_dict(c["record"]) for c in record["merge"]["candidates"]]
        selections, consulted = _kept_selections(record, [r.name for r in records])
        evaluation = record.get("evaluation")
        # a private selection consulted candidates beyond those the release uses
        used = set(record["used_candidates"]) | consulted
        release = release_of(
            facts.content_hash, record["method"], records, [float(r.name in used) for r in records]
        )
        entry = CountedRelease.of(
            release,
            versions={
                name: f"{record['parent_model']} v{version}"
                for name, version in zip(record["candidates"], record["parents"], strict=True)
            },
            delta=facts.delta,
            policy=stored.tags.get("dp.policy", ""),
            policy_version=0,
            evaluation=None if evaluation is None else Evaluation.from_dict(evaluation),
            selections=selections,
        )
        if before is None or before.joined(entry) != before:
            state_serving.count(store, entry, None)
            added.append(facts.content_hash)
    if unknown:
        raise LedgerIntegrityError(
            f"{len(unknown)} signed release(s) have no internal record in the state store "
            f"(e.g. {unknown[0]}), so their candidates are unknown; restore the state store's "
            f"`releases/` objects from their versions (`dpmerge state restore`); added "
            f"{len(added)} other release(s)"
        )
    return added


def _kept_selections(
    record: Mapping[str, Any], merged: Sequence[str]
) -> tuple[tuple[Selection, ...], set[str]]:
    """The private selections a release's internal record keeps and the candidates they
    consulted: ``selections`` (one per selection that chose the release, with what it
    consulted, :func:`dpmerge.state.releases.keep_selection`), and the one ``selection`` of
    records kept before a release could hold several (without a key or what it consulted:
    charged beside any kept later, every candidate of the ``merged`` ones counted — the safe
    side)."""
    kept = record.get("selections", [])
    if not isinstance(kept, list) or len(kept) > MAX_SELECTIONS:
        raise RecordError(f"a release record keeps at most {MAX_SELECTIONS} selections in a list")
    selections, consulted = [], set()
    if "selection" in record:
        selections.append(Selection.from_dict(record["selection"]))
        consulted |= set(merged)
    for item in kept:
        names = item.get("consulted") if isinstance(item, dict) else None
        if not isinstance(names, list) or not all(n in merged for n in names):
            raise RecordError("a kept selection names what it consulted, among the merge's")
        selections.append(Selection.from_dict(item.get("selection")))
        consulted |= set(names)
    return tuple(selections), consulted
