"""Each registered release's internal record (docs/design.md#release-state).

A release's MLflow version holds only what its consumers may read (its public card, its
guarantee, its test accuracy). What is computed from its candidates — their names and versions,
their records as published, the weights or the mixture's rungs, the full privacy report and the
internal privacy card — is kept here, at ``releases/<release>.json``, signed with the workflow's
key: the workflow and operators read it (``dpmerge registry show … --internal``), consumers
cannot reach the state store. It is written before the version is registered, so every
registered release has one; ``dpmerge ledger rebuild`` counts a release from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpmerge.accounting.private_selection import Selection
from dpmerge.state.store import StateStore

SCHEMA = "dpmerge.release-record/1"


def release_key(release: str) -> str:
    return f"releases/{release}.json"


def keep_release(store: StateStore, record: dict[str, Any]) -> None:
    """Write the internal ``record`` of release ``record["release"]`` (signed; a retry of the
    same release replaces what an interrupted attempt wrote, keeping the selections kept for
    it by :func:`keep_selection`)."""

    def change(old: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        kept = (old or {}).get("selections", [])
        return {"schema": SCHEMA, **record, "selections": kept}, None

    store.update(release_key(record["release"]), change)


def keep_selection(
    store: StateStore, release: str, selection: Selection, consulted: Sequence[str]
) -> None:
    """Add private tuning's ``selection`` (by its draw key) and the candidates it
    ``consulted`` to the internal record of the ``release`` it chose, before the ledger counts
    it, so ``dpmerge ledger rebuild`` charges every selection that ended in the release
    (docs/design.md#private-tuning); a record not written yet is started with the selection
    alone (registration fills in the rest)."""
    item = {"selection": selection.to_dict(), "consulted": sorted(consulted)}

    def change(old: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
        document = old or {"schema": SCHEMA, "release": release}
        kept = list(document.get("selections", []))
        if item in kept:
            return None, None
        return {**document, "selections": [*kept, item]}, None

    store.update(release_key(release), change)


def read_release(store: StateStore, release: str) -> dict[str, Any] | None:
    """The internal record of ``release`` (its signature checked where the key is held);
    ``None`` when there is none."""
    found = store.read_signed(release_key(release))
    return None if found is None else found.document
