"""Versions taken out of use, recorded in the release-state store (docs/design.md#release-state).

``quarantine/<registered model>/<version>.json`` is written once, by an operator (``dpmerge
registry quarantine``) or by the workflow, and never removed: a quarantined candidate is never
merged and a quarantined release never reused or promoted again, whatever an MLflow tag says
(the tag ``dp.status=quarantined`` is only its projection, for people browsing MLflow).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpmerge.state.policies import actor
from dpmerge.state.store import StateStore, stamp


def _key(model: str, version: str) -> str:
    return f"quarantine/{model}/{int(version):08d}.json"


@dataclass(frozen=True)
class Quarantine:
    model: str
    version: str
    reason: str
    by: str
    at: str


def quarantine(store: StateStore, model: str, version: str, reason: str) -> Quarantine:
    """Take ``model`` ``version`` out of use (idempotent: the first record stays)."""
    record = Quarantine(model, str(int(version)), reason, actor(), stamp())
    store.create(_key(model, version), record.__dict__)
    return quarantined(store, model).get(record.version, record)


def quarantined(store: StateStore, model: str) -> dict[str, Quarantine]:
    """The quarantined versions of ``model``: version -> its record."""
    found = {}
    for key in store.keys(f"quarantine/{model}/"):
        document = store.read(key)
        if document is not None:
            data = document.document
            version = str(int(key.rsplit("/", 1)[-1].removesuffix(".json")))
            found[version] = Quarantine(
                model,
                version,
                str(data.get("reason", "")),
                str(data.get("by", "")),
                str(data.get("at", "")),
            )
    return found
