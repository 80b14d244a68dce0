"""Evaluate the privacy of a given merge: RS with probabilities π or LC with weights λ."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.lc import generic_bound, structured_bound
from dpmerge.accounting.records import Candidate, require_same_dataset
from dpmerge.accounting.rs import rs_bound
from dpmerge.accounting.weights import simplex_weights
from dpmerge.errors import RecordError, RefusalError

Method = Literal["rs", "lc"]
GatingBound = Literal["generic", "structured"]


def check_delta(delta: float) -> float:
    if not 0 < delta < 1:
        raise RecordError(f"δ must lie in (0, 1), got {delta}")
    return float(delta)


def account(
    candidates: Sequence[Candidate],
    method: Method,
    weights: Sequence[float],
    delta: float,
    *,
    gating_bound: GatingBound = "generic",
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PrivacyReport:
    """The privacy report of one merge (SPEC §4, §5).

    RS is gated by the selection bound. LC reports the generic bound always and the structured
    one beside it (or why it does not apply); ``gating_bound`` picks which one gates, and asking
    for a structured gate where that bound does not apply raises ``RefusalError``.
    """
    if not candidates:
        raise RecordError("no candidates")
    require_same_dataset(candidates)
    delta = check_delta(delta)
    what = "RS probabilities" if method == "rs" else "LC weights"
    weights = simplex_weights(weights, len(candidates), what=what)
    names = tuple(c.name for c in candidates)
    if method == "rs":
        gating = rs_bound(candidates, weights, delta, discretisation)
        return PrivacyReport("rs", names, weights, delta, gating)
    if method != "lc":
        raise RecordError(f"method must be 'rs' or 'lc', got {method!r}")
    generic = generic_bound(candidates, weights, delta, discretisation)
    structured = structured_bound(candidates, weights, delta, discretisation, generic=generic)
    if gating_bound == "structured":
        if not structured.available:
            raise RefusalError(f"structured bound refused: {structured.reason}")
        gating = structured
    elif gating_bound == "generic":
        gating = generic
    else:
        raise RecordError(f"gating bound must be 'generic' or 'structured', got {gating_bound!r}")
    return PrivacyReport(
        "lc", names, weights, delta, gating, generic=generic, structured=structured
    )
