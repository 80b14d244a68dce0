"""Objects operators wrote that are not what their key says, recorded once as refused
(docs/design.md#release-state).

Operators write ``policies/`` and ``quarantine/`` (devstack/roles.py); everything they write is
untrusted input. Each object is read within the store's size and depth caps
(:func:`dpmerge.state.store.parse_document`), its key must have the prefix's shape and its
body the strict schema. An object that fails is a :class:`Rejection` naming the key and the
field at fault: a policy version's is recorded as that version's ``Rejected`` outcome, any
other (a key of another shape, a bad quarantine record) under ``rejected/<sha-256 of the
key>.json`` by the workflow's dispatcher, create-once, so it is examined once and shown by
``dpmerge policy ls`` and ``registry verify``. Nothing it holds is ever applied.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dpmerge.formatting import cut
from dpmerge.state.store import StateIntegrityError, StateStore, stamp

PREFIX = "rejected/"
SHOWN = 200
"""Longest key or reason recorded (a key may be up to S3's 1,024 bytes)."""


class FieldError(ValueError):
    """A stored body is not its schema: ``field`` says where (a closed check, never parsed
    from the message)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"field {field!r}: {reason}")
        self.field = field
        self.reason = reason


def exact_fields(document: Mapping[str, Any], names: Iterable[str]) -> None:
    """``document`` has exactly the fields ``names``: :class:`FieldError` naming the first
    unknown field (cut short), else the first missing one."""
    known = tuple(names)
    for name in document:
        if name not in known:
            raise FieldError(str(name)[:60] or "''", "unknown field")
    for name in known:
        if name not in document:
            raise FieldError(name, "missing")


def shown_key(key: str) -> str:
    """``key`` as it can be stored and printed: undecodable bytes escaped, cut short."""
    return cut(key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"), SHOWN)


@dataclass(frozen=True)
class Rejection:
    """A stored object refused: its key, the field at fault (``key`` for the key's shape,
    ``body`` for bytes that are no JSON object of the caps) and why."""

    key: str
    field: str
    reason: str

    def line(self) -> str:
        return f"{shown_key(self.key)}: field {self.field!r}: {cut(self.reason, SHOWN)}"

    def to_dict(self) -> dict[str, str]:
        return {"key": shown_key(self.key), "field": self.field, "reason": cut(self.reason, SHOWN)}


def digest(key: str) -> str:
    """A fixed-length name for any key (its SHA-256, hex)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def record_key(key: str) -> str:
    return f"{PREFIX}{digest(key)}.json"


def recorded_keys(store: StateStore) -> set[str]:
    """The ``rejected/`` keys already written (one listing)."""
    return set(store.keys(PREFIX))


def record(store: StateStore, rejection: Rejection) -> bool:
    """Record ``rejection`` (create-once); whether this call recorded it."""
    return store.create(record_key(rejection.key), {**rejection.to_dict(), "at": stamp()})


def recorded(store: StateStore) -> list[dict[str, Any]]:
    """Every recorded rejection (an unreadable record is shown as one itself)."""
    found = []
    for key in sorted(recorded_keys(store)):
        try:
            document = store.read(key)
        except StateIntegrityError as error:
            found.append(Rejection(key, "body", str(error)).to_dict())
            continue
        if document is not None:
            found.append(document.document)
    return found
