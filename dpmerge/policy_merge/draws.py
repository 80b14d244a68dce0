"""Draws kept once per release, stored before they are used (docs/design.md#rs-secrecy,
docs/design.md#row-protection, docs/design.md#private-tuning): the RS index, the noise of the
test-accuracy estimate, and private tuning's selection.

A retried or concurrent run of the same release must not draw again: a second RS draw is a
selection step that costs privacy, and two versions from two draws reveal both; a second noisy
accuracy would spend the evaluation ε twice on the test rows (averaging the two). So a release's
draw (keyed by its hash, which does not depend on the draw) is read first; only when there is
none is a new one drawn from the OS's cryptographic RNG and written create-once — to the audit
bucket (``If-None-Match: *``), or without S3 as a 0600 file under ``<home>/audit``
(``O_EXCL``). If another run wrote first, its draw is used and this one is discarded unused.
The RS record is the release's audit record: the index never goes anywhere else. The accuracy
record holds the published estimate only, never the exact accuracy; the selection record the
options and the chosen index, never the validation counts. A selection is made before its
release is known, so its key is a hash of what it chooses among (:func:`selection_key`)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from dpmerge.accounting.private_accuracy import PrivateAccuracy, private_accuracy
from dpmerge.accounting.private_selection import Selection, noisy_max
from dpmerge.errors import IntegrityError, RecordError
from dpmerge.merging import draw_index
from dpmerge.storage import ObjectExistsError, ObjectNotFoundError
from dpmerge.workspace import Workspace

SCHEMA = "dpmerge.rs_draw/1"
ACCURACY_SCHEMA = "dpmerge.test_accuracy_draw/1"
SELECTION_SCHEMA = "dpmerge.selection_draw/1"
ACCURACY_SUFFIX = ".test-accuracy"
"""The accuracy draw's key: the release hash with this suffix (the RS draw's is the hash)."""
Kept = TypeVar("Kept")


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


def kept_once(
    workspace: Workspace,
    key: str,
    draw: Callable[[], dict[str, Any]],
    use: Callable[[dict[str, Any]], Kept],
) -> Kept:
    """``use`` of the record stored under ``key``: the stored one, else a new ``draw()``
    stored create-once before use (a concurrent run's, if it stored first)."""
    existing = _read(workspace, key)
    if existing is not None:
        return use(existing)
    record = draw()
    try:
        _write_once(workspace, key, record)
    except ObjectExistsError:  # a concurrent run stored its draw first: that one counts
        winner = _read(workspace, key)
        if winner is None:
            raise
        return use(winner)
    return use(record)


def stored_draw(
    workspace: Workspace,
    release: str,
    names: Sequence[str],
    probabilities: Sequence[float],
    notes: dict[str, Any],
) -> int:
    """The index drawn for ``release``: the stored one, else a new draw stored before use."""

    def draw() -> dict[str, Any]:
        index = draw_index(probabilities)
        return {
            "schema": SCHEMA,
            "release": release,
            "candidates": list(names),
            "probabilities": [float(p) for p in probabilities],
            "drawn_index": index,
            "drawn_candidate": names[index],
            "drawn_at": datetime.now(UTC).isoformat(),
            "notes": notes,
        }

    return kept_once(workspace, release, draw, lambda r: _index(r, names, probabilities))


def _estimate(record: dict[str, Any], release: str, n: int) -> PrivateAccuracy:
    """The stored estimate, after checking it is this release's on these ``n`` test rows; its
    own ε stands (a policy that changed ``evaluation_epsilon`` since publishes the kept one)."""
    try:
        estimate = PrivateAccuracy.from_metrics(record.get("metrics") or {})
    except RecordError:
        estimate = None
    if (
        record.get("schema") != ACCURACY_SCHEMA
        or record.get("release") != release
        or estimate is None
        or estimate.n != n
        or not 0 <= estimate.value <= 1
    ):
        raise IntegrityError(
            f"the stored test-accuracy draw of release {release!r} does not match its test "
            "rows; the audit record was altered (restore it from the audit bucket's versions)"
        )
    return estimate


def stored_accuracy(
    workspace: Workspace, release: str, accuracy: float, n: int, epsilon: float
) -> PrivateAccuracy:
    """The private test-accuracy estimate of ``release``: the stored one, else a new ε-DP
    estimate of ``accuracy`` on ``n`` rows (:func:`private_accuracy`) stored before use."""

    def draw() -> dict[str, Any]:
        estimate = private_accuracy(accuracy, n, epsilon)
        return {
            "schema": ACCURACY_SCHEMA,
            "release": release,
            "metrics": estimate.metrics(),
            "drawn_at": datetime.now(UTC).isoformat(),
        }

    return kept_once(workspace, release + ACCURACY_SUFFIX, draw, lambda r: _estimate(r, release, n))


def selection_key(parts: Any) -> str:
    """The key of a selection among ``parts`` (JSON: the candidates, target and options)."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return f"selection-{digest[:40]}"


def _selection(record: dict[str, Any], key: str, labels: Sequence[str]) -> tuple[int, Selection]:
    index = record.get("drawn_index")
    try:
        selection = Selection.from_dict(record.get("selection"))
    except RecordError:
        selection = None
    if (
        record.get("schema") != SELECTION_SCHEMA
        or record.get("key") != key
        or record.get("options") != list(labels)
        or selection is None
        or selection.key not in ("", key)
        or not isinstance(index, int)
        or isinstance(index, bool)
        or not 0 <= index < len(labels)
    ):
        raise IntegrityError(
            f"the stored selection {key!r} does not match its options; the audit record was "
            "altered (restore it from the audit bucket's versions)"
        )
    return index, replace(selection, key=key)  # draws kept before the key was recorded


def stored_selection(
    workspace: Workspace,
    key: str,
    labels: Sequence[str],
    counts: Sequence[float],
    n: int,
    epsilon: float,
) -> tuple[int, Selection]:
    """The option private tuning chose under ``key``: the stored choice (with the ε it was
    made at), else a new :func:`noisy_max` draw at ``epsilon`` on the validation ``counts`` of
    ``n`` rows, stored before use. The counts are not stored."""

    def draw() -> dict[str, Any]:
        index = noisy_max(counts, epsilon)
        return {
            "schema": SELECTION_SCHEMA,
            "key": key,
            "options": list(labels),
            "drawn_index": index,
            "selection": Selection(epsilon, n, len(labels), key=key).to_dict(),
            "drawn_at": datetime.now(UTC).isoformat(),
        }

    return kept_once(workspace, key, draw, lambda r: _selection(r, key, labels))
