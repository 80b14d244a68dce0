"""Versions taken out of use, recorded in the release-state store (docs/design.md#release-state).

``quarantine/<registered model>/<version>.json`` is written once, by an operator (``dpmerge
registry quarantine``) or by the workflow, and never removed: a quarantined candidate is never
merged and a quarantined release never reused or promoted again, whatever an MLflow tag says
(the tag ``dp.status=quarantined`` is only its projection, for people browsing MLflow).

Operators write this prefix, so every object under it is untrusted input
(:mod:`dpmerge.state.rejections`): a key of another shape or a body that is not exactly a
quarantine record is a :class:`~dpmerge.state.rejections.Rejection`, reported and never
applied, and no reader (a merge run, ``registry verify``) fails on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from dpmerge.state.policies import DIGITS, actor
from dpmerge.state.rejections import FieldError, Rejection
from dpmerge.state.store import StateStore, UnreadableObjectError, stamp

PREFIX = "quarantine/"
MODEL = r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}"
_KEY = re.compile(rf"quarantine/({MODEL})/([0-9]{{{DIGITS},12}})\.json")
MAX_TEXT = 2000


def key_of(model: str, version: str | int) -> str:
    return f"{PREFIX}{model}/{int(version):0{DIGITS}d}.json"


@dataclass(frozen=True)
class Quarantine:
    model: str
    version: str
    reason: str
    by: str
    at: str


def parse_key(key: str) -> tuple[str, str] | None:
    """``(model, version)`` of a quarantine key of the right shape (``None``: another shape)."""
    match = _KEY.fullmatch(key)
    if match is None or int(match[2]) < 1 or key != key_of(match[1], match[2]):
        return None
    return match[1], str(int(match[2]))


def record_of(model: str, version: str, document: dict[str, Any]) -> Quarantine:
    """The record ``document`` holds; :class:`FieldError` when it is not exactly one for
    ``model`` ``version``."""
    names = [f.name for f in fields(Quarantine)]
    for name in document:
        if name not in names:
            raise FieldError(str(name)[:60] or "''", "unknown field")
    for name in names:
        value = document.get(name)
        if type(value) is not str or len(value) > MAX_TEXT:
            raise FieldError(name, f"must be a string of at most {MAX_TEXT} characters")
    if (document["model"], document["version"]) != (model, version):
        named = f"{document['model']!r} v{document['version']!r}"
        raise FieldError("model", f"names {named}, not its key")
    return Quarantine(**document)


def read(store: StateStore, key: str) -> Quarantine | Rejection:
    """The quarantine record at ``key``, or why it is refused."""
    parsed = parse_key(key)
    if parsed is None:
        return Rejection(key, "key", f"not {PREFIX}<model>/<{DIGITS}-digit version>.json")
    try:
        found = store.read(key)
    except UnreadableObjectError as error:
        return Rejection(key, "body", error.reason)
    if found is None:
        return Rejection(key, "key", "no longer stored")
    try:
        return record_of(*parsed, found.document)
    except FieldError as error:
        return Rejection(key, error.field, error.reason)


def quarantine(store: StateStore, model: str, version: str, reason: str) -> Quarantine:
    """Take ``model`` ``version`` out of use (idempotent: the first valid record stays)."""
    return record(store, Quarantine(model, str(int(version)), reason, actor(), stamp()))


def record(store: StateStore, quarantined_version: Quarantine) -> Quarantine:
    """Write ``quarantined_version`` (create-once); the record that stays."""
    model, version = quarantined_version.model, quarantined_version.version
    store.create(key_of(model, version), quarantined_version.__dict__)
    return quarantined(store, model).get(version, quarantined_version)


def models(store: StateStore) -> list[str]:
    """The models with a quarantine key of the right shape."""
    return sorted({parsed[0] for key in store.keys(PREFIX) if (parsed := parse_key(key))})


def examine(store: StateStore, model: str | None = None) -> list[Quarantine | Rejection]:
    """Every object under ``quarantine/`` (of ``model`` only, if given): its record or why it
    is refused."""
    prefix = f"{PREFIX}{model}/" if model is not None else PREFIX
    found = []
    for key in store.keys(prefix):
        parsed = parse_key(key)
        if model is not None and (parsed is None or parsed[0] != model):
            continue  # another model's key listed under this prefix, or one of another shape
        found.append(read(store, key))
    return found


def quarantined(store: StateStore, model: str) -> dict[str, Quarantine]:
    """The quarantined versions of ``model``: version -> its record (refused objects left out:
    :func:`examine` reports them)."""
    return {
        record.version: record for record in examine(store, model) if isinstance(record, Quarantine)
    }
