"""One RS draw per release, stored before it is used (docs/design.md#rs-secrecy).

A retried or concurrent run of the same release must not draw again: a second draw is a
selection step that costs privacy, and two versions from two draws reveal both. So the draw for
a release (keyed by its hash, which does not depend on the draw) is read first; only when
there is none is a new index drawn from the OS's cryptographic RNG and written create-once —
to the audit bucket (``If-None-Match: *``), or without S3 as a 0600 file under
``<home>/audit`` (``O_EXCL``). If another run wrote first, its draw is used and this one is
discarded unused. The record is the release's audit record: the index never goes anywhere
else."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from dpmerge.errors import IntegrityError
from dpmerge.merging import draw_index
from dpmerge.storage import ObjectExistsError, ObjectNotFoundError
from dpmerge.workspace import Workspace

SCHEMA = "dpmerge.rs_draw/1"


def _local_path(workspace: Workspace, release: str) -> Any:
    return workspace.private_dir("audit") / f"{release}.json"


def _read(workspace: Workspace, release: str) -> dict[str, Any] | None:
    store = workspace.store()
    if store is None:
        path = _local_path(workspace, release)
        return json.loads(path.read_text()) if path.exists() else None
    try:
        return store.read_audit_record(release)
    except ObjectNotFoundError:
        return None


def _write_once(workspace: Workspace, release: str, record: dict[str, Any]) -> None:
    """Create the draw record; :class:`ObjectExistsError` when one exists already."""
    store = workspace.store()
    if store is not None:
        store.write_audit_record(release, record)
        return
    path = _local_path(workspace, release)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(record, handle, indent=2)
    try:
        os.link(staging, path)
    except FileExistsError:
        raise ObjectExistsError(f"{path} already exists") from None
    finally:
        staging.unlink()


def _index(record: dict[str, Any], names: Sequence[str], probabilities: Sequence[float]) -> int:
    """The stored index, after checking the record is this release's draw."""
    same = record.get("candidates") == list(names) and record.get("probabilities") == [
        float(p) for p in probabilities
    ]
    index = record.get("drawn_index")
    if not same or not isinstance(index, int) or not 0 <= index < len(names):
        raise IntegrityError(
            f"the stored RS draw of release {record.get('release')!r} does not match its "
            "candidates and probabilities; the audit record was altered (restore it from the "
            "audit bucket's versions)"
        )
    return index


def stored_draw(
    workspace: Workspace,
    release: str,
    names: Sequence[str],
    probabilities: Sequence[float],
    notes: dict[str, Any],
) -> int:
    """The index drawn for ``release``: the stored one, else a new draw stored before use."""
    existing = _read(workspace, release)
    if existing is not None:
        return _index(existing, names, probabilities)
    index = draw_index(probabilities)
    record = {
        "schema": SCHEMA,
        "release": release,
        "candidates": list(names),
        "probabilities": [float(p) for p in probabilities],
        "drawn_index": index,
        "drawn_candidate": names[index],
        "drawn_at": datetime.now(UTC).isoformat(),
        "notes": notes,
    }
    try:
        _write_once(workspace, release, record)
    except ObjectExistsError:  # a concurrent run stored its draw first: that one counts
        winner = _read(workspace, release)
        if winner is None:
            raise
        return _index(winner, names, probabilities)
    return index
