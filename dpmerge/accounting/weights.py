"""Validation of RS probabilities π and LC weights λ (SPEC §4, §5: both on the simplex)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpmerge.errors import RecordError

SUM_TOLERANCE = 1e-9


def simplex_weights(
    weights: Sequence[float], count: int, *, what: str = "weights"
) -> tuple[float, ...]:
    """Return ``weights`` as floats after checking they are a point of the simplex.

    Refuses (naming the problem) a wrong count, NaN/inf, negative entries, or a sum off 1 by
    more than 1e-9. Nothing is renormalised silently: the weights are part of the mechanism.
    """
    values = tuple(float(w) for w in weights)
    if len(values) != count:
        raise RecordError(f"{what}: expected {count} values (one per candidate), got {len(values)}")
    for i, w in enumerate(values):
        if not math.isfinite(w):
            raise RecordError(f"{what}[{i}] is {w}: weights must be finite numbers")
        if w < 0:
            raise RecordError(f"{what}[{i}] = {w} is negative: weights lie on the simplex")
    total = math.fsum(values)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise RecordError(f"{what} sum to {total!r}, not 1: weights lie on the simplex")
    return values
