"""When a policy event happened, as far as ordering goes (docs/design.md#security).

An event's ``occurred`` time is the sender's claim: one event dated ten years ahead used to
freeze a policy (every later change ended "superseded"). Alias changes are therefore ordered by
the time the *server* received the event (Prefect's ``event.received``; in-process, this
process's clock), and an event that claims to come from the future — more than
:data:`CLOCK_SKEW` after it was received — is refused. A recorded alias time that lies in the
future (written before this rule, or by a wrong clock) is not trusted to supersede anything.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from dpmerge.documents import shorten
from dpmerge.errors import InputError

CLOCK_SKEW = timedelta(minutes=5)
"""How far a sender's clock may run ahead of the server's."""


class EventTimeError(InputError):
    """An event's time is malformed or lies in the future beyond the clock-skew allowance."""


def parse_time(value: str | datetime | None) -> datetime:
    """An event time (ISO 8601, naive means UTC); ``None`` or ``""`` is now."""
    if value is None or value == "":
        return datetime.now(UTC)
    if isinstance(value, datetime):
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            raise EventTimeError(f"event time {shorten(value)} is not an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def order_time(
    occurred: str | datetime | None,
    received: str | datetime | None,
    now: datetime | None = None,
) -> datetime:
    """The time that orders this event's alias changes: the server's ``received`` time (else
    now). :class:`EventTimeError` when the sender's ``occurred`` is later than that by more
    than :data:`CLOCK_SKEW`, or when ``received`` itself lies in the future."""
    current = now or datetime.now(UTC)
    ordered = parse_time(received) if received not in (None, "") else current
    if ordered > current + CLOCK_SKEW:
        raise EventTimeError(
            f"event received at {ordered.isoformat()}, after now ({current.isoformat()}): refused"
        )
    if occurred not in (None, ""):
        claimed = parse_time(occurred)
        if claimed > ordered + CLOCK_SKEW:
            raise EventTimeError(
                f"event dated {claimed.isoformat()}, later than its arrival "
                f"({ordered.isoformat()}) by more than {CLOCK_SKEW}: refused (send it with a "
                "correct clock)"
            )
    return ordered


def trusted(recorded: datetime, now: datetime | None = None) -> bool:
    """A recorded alias time can order later events only if it is not in the future."""
    return recorded <= (now or datetime.now(UTC)) + CLOCK_SKEW
