"""How numbers are shown to people (docs/design.md#mechanism-record). Machine-readable fields
(JSON, metrics) carry raw values; text for people uses these functions, and an ε is never
rounded toward less privacy loss."""

from __future__ import annotations

import math

EPSILON_DIGITS = 4


def epsilon_text(value: float | None) -> str:
    """An ε for display, rounded *up* to 4 decimals; ``—`` when absent, ``∞`` when unbounded.

    The 1e-9 guard keeps a value that is a 4-decimal number up to float noise (0.98340000000001)
    from showing one step higher; every PLD ε already carries a 1e-7 safety margin."""
    if value is None:
        return "—"
    if math.isinf(value):
        return "∞"
    scale = 10**EPSILON_DIGITS
    return f"{math.ceil(value * scale - 1e-9) / scale:.{EPSILON_DIGITS}f}"


def number_text(value: float | None, digits: int = 4) -> str:
    """Any other number for display (accuracy, loss, utility): plain rounding."""
    return "n/a" if value is None else f"{value:.{digits}f}"
