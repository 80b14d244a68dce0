"""Evaluate the privacy of a given merge: RS with probabilities π or LC with weights λ
(docs/design.md#random-selection, docs/design.md#generic-bound,
docs/design.md#structured-bound)."""

from __future__ import annotations

from collections.abc import Sequence

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting.bounds import PairBound, PrivacyReport
from dpmerge.accounting.delta import check_delta
from dpmerge.accounting.generic import generic_bound
from dpmerge.accounting.records import Candidate, attestation_lines, require_same_dataset
from dpmerge.accounting.rs import rs_bound
from dpmerge.accounting.structured import check_ordering, structured_bound
from dpmerge.accounting.weights import initialisation_conflict, simplex_weights
from dpmerge.errors import RecordError, RefusalError
from dpmerge.vocabulary import GatingBound, Method, choose

MAX_CANDIDATES = 64
"""Most candidates one accounting or calibration considers. Each needs its own PLD (up to
~0.7 s at the fine grid) and generic calibration enumerates subsets; a larger file fails fast
with this limit rather than running for hours."""


def check_candidates(candidates: Sequence[Candidate]) -> str:
    """A non-empty, single-dataset candidate list within :data:`MAX_CANDIDATES`; returns the
    dataset fingerprint."""
    if not candidates:
        raise RecordError("no candidates")
    if len(candidates) > MAX_CANDIDATES:
        raise RecordError(
            f"{len(candidates)} candidates: at most {MAX_CANDIDATES} are accounted or calibrated "
            "at once; pass the subset to merge"
        )
    return require_same_dataset(candidates)


def gating_of(generic: PairBound, structured: PairBound) -> tuple[PairBound, tuple[str, ...]]:
    """The gate of an opt-in structured policy: the smaller of two valid bounds, labelled.

    Both are upper bounds where the structured assumptions hold (the policy opted into them),
    and the ordering has been checked, so the smaller one is a valid gate."""
    if not structured.available:
        raise RefusalError(f"structured bound refused: {structured.reason}")
    if generic.epsilon < structured.epsilon:
        return generic, (
            "gated by the generic bound: smaller than the structured bound for this merge",
        )
    return structured, ()


def account(
    candidates: Sequence[Candidate],
    method: Method | str,
    weights: Sequence[float],
    delta: float,
    *,
    gating_bound: GatingBound | str = GatingBound.GENERIC,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PrivacyReport:
    """The privacy report of one merge.

    RS is gated by the selection bound. LC reports the generic bound always and the structured
    one beside it (or why it does not apply); ``gating_bound`` picks which one gates, and asking
    for a structured gate where that bound does not apply raises ``RefusalError``. A structured
    value above the generic one raises ``BoundContradictionError`` (never clamped).
    """
    check_candidates(candidates)
    delta = check_delta(delta)
    method = choose(Method, method, "method")
    gating_bound = choose(GatingBound, gating_bound, "gating bound")
    what = "RS probabilities" if method == Method.RS else "LC weights"
    weights = simplex_weights(weights, len(candidates), what=what)
    names = tuple(c.name for c in candidates)
    used = [c for c, w in zip(candidates, weights, strict=True) if w > 0]
    attested = attestation_lines(used)
    if method == Method.RS:
        gating = rs_bound(candidates, weights, delta, discretisation)
        return PrivacyReport(Method.RS, names, weights, delta, gating, attestations=attested)
    generic = generic_bound(candidates, weights, delta, discretisation)
    structured = structured_bound(candidates, weights, delta, discretisation)
    check_ordering(generic, structured)
    conflict = initialisation_conflict(used)
    notes: tuple[str, ...] = () if conflict is None else (f"warning: {conflict}",)
    if gating_bound == GatingBound.STRUCTURED:
        gating, gate_notes = gating_of(generic, structured)
        notes += gate_notes
    else:
        gating = generic
    return PrivacyReport(
        Method.LC,
        names,
        weights,
        delta,
        gating,
        generic,
        structured,
        notes=notes,
        attestations=attested,
    )
