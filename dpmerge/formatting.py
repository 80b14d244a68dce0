"""How numbers are shown to people (docs/design.md#mechanism-record). Machine-readable fields
(JSON, metrics) carry raw values; text for people uses these functions, and an ε is never
rounded toward less privacy loss."""

from __future__ import annotations

import difflib
import math
import unicodedata
from collections.abc import Iterable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

EPSILON_DIGITS = 4
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Unicode categories never written raw to a terminal: control characters (a name holding
``\\x1b[2J`` would clear the screen, ``\\r`` or ``\\n`` forge a line), invisible formatting (a
right-to-left override reorders what is shown), surrogates, private-use and unassigned code
points, line and paragraph separators."""


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
    not ``1.2117 ≤ 1.21161``). A target ``:g`` shows exactly is compared as shown: 1.1999987
    within 1.2 reads ``1.2000 ≤ 1.2`` (the float nearest 1.2 lies below it, and compared with
    that the line read ``1.199999``)."""
    if value > target:
        return f"ε = {epsilon_text(value)} > ε* = {target:g}"
    exact = float(f"{target:g}") == target
    for digits in range(EPSILON_DIGITS, 13):
        shown = _ceiling(value, digits)
        limit = Decimal(target).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_FLOOR)
        if shown <= (Decimal(f"{target:g}") if exact else limit):
            break
    limit_text = f"{target:g}" if exact else f"{limit:.{digits}f}"
    return f"ε = {shown:.{digits}f} ≤ ε* = {limit_text}"


def number_text(value: float | None, digits: int = 4) -> str:
    """Any other number for display (accuracy, loss, utility): plain rounding."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def printable(text: str) -> str:
    """``text`` with every character of :data:`ESCAPED_CATEGORIES` written as its Python
    escape (``\\x1b``, ``\\n``, ``\\u202e``): what dpmerge echoes stays one line of visible
    characters. The one escaping of echoed input; :func:`dpmerge.documents.shorten` and every
    error line go through it."""
    if text.isprintable():
        return text
    return "".join(
        repr(ch)[1:-1] if unicodedata.category(ch) in ESCAPED_CATEGORIES else ch for ch in text
    )


def cut(text: str, limit: int) -> str:
    """``text`` on one line of visible characters (:func:`printable`), cut to ``limit``
    characters with an ellipsis."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def did_you_mean(word: str, known: Iterable[str], *, quoted: bool = True) -> str:
    """``"; did you mean 'x'?"`` naming the known word nearest to a misspelt ``word``, or
    ``""`` when none is near (``quoted=False``: the word bare, as for an option)."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {close[0]!r}?" if quoted else f"; did you mean {close[0]}?"
