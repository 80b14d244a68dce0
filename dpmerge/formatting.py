"""How numbers are shown to people (docs/design.md#mechanism-record). Machine-readable fields
(JSON, metrics) carry raw values; text for people uses these functions, and an ε is never
rounded toward less privacy loss."""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

EPSILON_DIGITS = 4


def _ceiling(value: float, digits: int) -> Decimal:
    """``value`` rounded up to ``digits`` decimals, exactly: the float's own binary value is
    compared, so the result is never below it (0.98340000000001 shows 0.9835)."""
    return Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_CEILING)


def epsilon_text(value: float | None) -> str:
    """An ε for display, rounded *up* to 4 decimals (never below the value); ``—`` when
    absent, ``∞`` when unbounded."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "∞"
    return f"{_ceiling(value, EPSILON_DIGITS):.{EPSILON_DIGITS}f}"


def within_text(value: float, target: float) -> str:
    """``ε = … ≤ ε* = …`` for a release within its target: ε rounded up and ε* rounded down (or
    as given, when ``:g`` shows it exactly), at the fewest decimals from 4 to 12 at which the
    shown numbers keep the relation (1.21160707 within 1.21160828 reads ``1.211608 ≤ 1.211608``,
    not ``1.2117 ≤ 1.21161``)."""
    if value > target:
        return f"ε = {epsilon_text(value)} > ε* = {target:g}"
    exact = float(f"{target:g}") == target
    for digits in range(EPSILON_DIGITS, 13):
        shown = _ceiling(value, digits)
        limit = Decimal(target).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_FLOOR)
        if shown <= (Decimal(target) if exact else limit):
            break
    limit_text = f"{target:g}" if exact else f"{limit:.{digits}f}"
    return f"ε = {shown:.{digits}f} ≤ ε* = {limit_text}"


def number_text(value: float | None, digits: int = 4) -> str:
    """Any other number for display (accuracy, loss, utility): plain rounding."""
    return "n/a" if value is None else f"{value:.{digits}f}"
