"""Release ledger (docs/design.md#release-ledger): the cumulative privacy of every released
model of a data source (every subset of it).

Releases derived from the same candidates are correlated, so composing the releases' own ε
values is not a valid bound. The valid cumulative bound is the joint release of the union of
candidates that went into any released model, grouped into release units
(docs/design.md#release-units: runs that shared batches form one unit) and composed.
For an RS release every candidate with π_i > 0 counts as used, and for a mixture every member
of either rung: the drawn index is secret, and a ledger that counted only what was drawn would
publish it.

Where the ledger is kept, and how concurrent writers and damage are handled, is the
release-state store's business (``dpmerge.state.serving``, docs/design.md#release-state); this
module is only the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dpmerge.accounting.bounds import PairBound, PrivacyReport
from dpmerge.accounting.generic import release_units, units_bound
from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.accounting.records import Candidate, candidate_from_dict
from dpmerge.errors import RecordError
from dpmerge.vocabulary import Composition


@dataclass(frozen=True)
class Release:
    """One released (promoted) model: which candidates went into it."""

    release_id: str
    dataset: str
    method: str
    candidates: tuple[Candidate, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "release_id": self.release_id,
            "dataset": self.dataset,
            "method": self.method,
            "candidates": [c.model_dump(mode="json", exclude_none=True) for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Release:
        return cls(
            release_id=str(data["release_id"]),
            dataset=str(data["dataset"]),
            method=str(data["method"]),
            candidates=tuple(candidate_from_dict(c) for c in data["candidates"]),
        )


def release_of(
    release_id: str, method: str, candidates: Sequence[Candidate], weights: Sequence[float]
) -> Release:
    """The ledger entry of a merge: the candidates with non-zero weight (π_i or λ_i)."""
    used = tuple(c for c, w in zip(candidates, weights, strict=True) if w > 0)
    if not used:
        raise RecordError("a release uses at least one candidate")
    return Release(release_id, used[0].dataset, method, used)


def release_for(release_id: str, candidates: Sequence[Candidate], report: PrivacyReport) -> Release:
    """The ledger entry of any merge — RS, LC or mixture — from its privacy report: the
    candidates ``report.used_candidates`` names (for a mixture, every member of either rung;
    which rung was drawn stays secret)."""
    if [c.name for c in candidates] != list(report.names):
        raise RecordError("the report was computed for other candidates")
    used = set(report.used_candidates)
    return release_of(
        release_id, str(report.method), candidates, [float(c.name in used) for c in candidates]
    )


def cumulative_bound(releases: Sequence[Release], delta: float) -> PairBound:
    """Bound of the joint release of the union of the releases' candidates, over their release
    units. A source's ledger spans several dataset identifiers (subsets), whose candidates are
    told apart by identifier and name."""
    union: dict[tuple[str, str], Candidate] = {}
    for release in releases:
        for candidate in release.candidates:
            known = union.setdefault((candidate.dataset, candidate.name), candidate)
            if known != candidate:
                raise RecordError(
                    f"two different candidates are named {candidate.name!r} in the ledger"
                )
    return units_bound(release_units(list(union.values())), delta)


def sum_up(epsilons: Sequence[float]) -> float:
    """The sum of ``epsilons``, rounded up: the float returned is never below the exact sum
    (basic composition must not round toward less privacy)."""
    total = math.fsum(epsilons)
    if Fraction(total) < sum(map(Fraction, epsilons), Fraction(0)):
        total = math.nextafter(total, math.inf)
    return total


@dataclass(frozen=True)
class EvaluationBound:
    """The test rows' cumulative ε over a ledger's releases: each release's estimate is pure
    ε_eval-DP (δ = 0) on the same test rows, so they compose sequentially and their sum is the
    bound (basic composition, exact for pure ε). ``epsilon`` is ``None`` — not bounded — when
    a release has no recorded estimate (``unrecorded``: counted before the ledger recorded
    evaluations, or rebuilt; it may have published an exact accuracy),
    docs/design.md#release-ledger."""

    epsilon: float | None
    releases: int
    unrecorded: tuple[str, ...] = ()
    delta: float = 0.0
    composition: Composition = Composition.SEQUENTIAL


def evaluation_bound(evaluations: Mapping[str, Evaluation | None]) -> EvaluationBound:
    """The test rows' bound of the releases ``evaluations`` names (release id → its recorded
    evaluation, ``None`` where none is recorded)."""
    unrecorded = tuple(sorted(r for r, e in evaluations.items() if e is None))
    spent = [e.epsilon for e in evaluations.values() if e is not None]
    epsilon = None if unrecorded else sum_up(spent)
    return EvaluationBound(epsilon, len(evaluations), unrecorded)


@dataclass(frozen=True)
class PersonBound:
    """What the ledger promises one person of the source, whichever split holds their row
    (docs/design.md#release-ledger): ``parallel`` — the larger of the training and the test
    rows' ε, where every release used one dataset identifier (one split: a person is a training
    row or a test row, never both) — else ``sequential``, their sum (a subset's test rows are
    not known to be apart from another identifier's training rows). ``None`` where the test rows
    are not bounded. δ is the training bound's (the test rows' is 0)."""

    epsilon: float | None
    delta: float
    composition: Composition


def person_bound(
    training: PairBound, test: EvaluationBound, one_split: bool, validation: float = 0.0
) -> PersonBound:
    """The per-person bound from the training rows' ``training``, the test rows' ``test`` and
    the validation rows' ``validation`` (private selections' ε summed; 0 where none was made:
    a third split, apart from both by the keyed split)."""
    composition = Composition.PARALLEL if one_split else Composition.SEQUENTIAL
    if test.epsilon is None:
        return PersonBound(None, training.delta, composition)
    parts = [training.epsilon, test.epsilon, validation]
    epsilon = max(parts) if one_split else sum_up(parts)
    return PersonBound(epsilon, training.delta, composition)


@dataclass(frozen=True)
class LedgerStatement:
    """A source ledger's statement per split: the training rows' bound (every release's
    candidates composed), the test rows' and one person's (docs/design.md#release-ledger)."""

    training: PairBound
    test: EvaluationBound
    person: PersonBound
    validation: float = 0.0
    """The validation rows' ε: the releases' private selections' ε summed (pure ε, δ = 0)."""
