"""The release ledger (docs/design.md#release-ledger) where a policy merge keeps it — S3 or the
local home — read so that damage fails closed and written so that concurrent writers lose
nothing.

* **Fail closed.** A ledger that cannot be read is an error, never an empty ledger; and the
  registry witnesses every release the ledger recorded (tag ``dp.released`` on the merged
  version), so a ledger that lacks one of them — lost with an S3 restart, rolled back, edited —
  is refused with the repair (:class:`LedgerIntegrityError`) instead of letting a cap pass.
* **Pinned records.** A candidate the ledger counted keeps the record it was counted with: a
  candidate of the same name with another record is refused with the repair, before the
  accountant meets two candidates of one name.
* **Concurrent writers.** In S3 every change is a conditional write on the ETag it read
  (``If-Match``; ``If-None-Match: *`` for the first), retried on a conflict with the change
  re-applied to the new content; locally, an exclusive lock on ``<home>/ledger.lock``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dpmerge.accounting.bounds import PairBound
from dpmerge.accounting.ledger import Release as LedgerRelease
from dpmerge.accounting.ledger import ReleaseLedger, release_of
from dpmerge.errors import IntegrityError, RecordError
from dpmerge.formatting import epsilon_text
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.release import MergeRequest
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import RegisteredCandidate, Registry
from dpmerge.storage import ObjectChangedError, ObjectExistsError

LEDGER_KEY = "ledger/releases.json"
MAX_WRITE_ATTEMPTS = 20
UNREADABLE = (RecordError, OSError, KeyError, TypeError, ValueError)
"""What reading a damaged ledger raises (malformed JSON, missing or mistyped fields)."""
T = TypeVar("T")


class LedgerIntegrityError(IntegrityError):
    """The release ledger is unreadable, lacks a release the registry says it recorded, or
    counted a candidate with another record."""


def _where(workspace: Workspace) -> str:
    store = workspace.store()
    return f"s3://{store.config.bucket}/{LEDGER_KEY}" if store else str(_local(workspace))


def _local(workspace: Workspace) -> Path:
    return workspace.home / "ledger.json"


@contextmanager
def _local_lock(workspace: Workspace) -> Iterator[None]:
    workspace.home.mkdir(parents=True, exist_ok=True)
    with (workspace.home / "ledger.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def read_ledger(workspace: Workspace) -> Iterator[ReleaseLedger]:
    """A read-only view of the ledger (a copy, for S3); errors reading it propagate."""
    store = workspace.store()
    if store is None:
        yield ReleaseLedger(_local(workspace))
        return
    with tempfile.TemporaryDirectory(prefix="dpmerge-ledger-") as scratch:
        path = Path(scratch) / "ledger.json"
        found = store.get_versioned(LEDGER_KEY)
        if found is not None:
            path.write_bytes(found[0])
        yield ReleaseLedger(path)


def update_ledger(workspace: Workspace, change: Callable[[ReleaseLedger], T]) -> T:
    """Apply ``change`` to the ledger and write it back without losing a concurrent writer's
    change (see the module docstring); returns what ``change`` returned."""
    store = workspace.store()
    if store is None:
        with _local_lock(workspace):
            return change(ReleaseLedger(_local(workspace)))
    for _ in range(MAX_WRITE_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="dpmerge-ledger-") as scratch:
            path = Path(scratch) / "ledger.json"
            found = store.get_versioned(LEDGER_KEY)
            if found is not None:
                path.write_bytes(found[0])
            result = change(ReleaseLedger(path))
            after = path.read_bytes() if path.exists() else None
            if after is None or (found is not None and after == found[0]):
                return result
            try:
                store.put_bytes(
                    LEDGER_KEY,
                    after,
                    content_type="application/json",
                    if_absent=found is None,
                    if_match=found[1] if found is not None else None,
                )
            except (ObjectChangedError, ObjectExistsError):
                continue  # another writer came first: apply the change to its ledger
            return result
    raise LedgerIntegrityError(
        f"release ledger {_where(workspace)}: {MAX_WRITE_ATTEMPTS} conflicting writes in a row; "
        "try again"
    )


def _record_hash(record: Any) -> str:
    data = json.dumps(record.model_dump(mode="json", exclude_none=True), sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LedgerEntry:
    """A release as the ledger counts it (``release``: its candidates with non-zero weight),
    with the published identifier of its dataset (whose registry witnesses the ledger) and
    where each candidate is registered (candidate name -> ``"<model> v<version>"``)."""

    release: LedgerRelease
    dataset: str
    versions: dict[str, str]


def check_ledger(
    workspace: Workspace, ledger: ReleaseLedger, registry: Registry, entry: LedgerEntry
) -> list[LedgerRelease]:
    """The ledger's releases, after checking that it is readable, holds every release the
    registry says it recorded for ``entry``'s dataset, and counted every candidate of
    ``entry`` with the same record. Raises :class:`LedgerIntegrityError`."""
    where = _where(workspace)
    try:
        releases = ledger.releases()
    except UNREADABLE as error:
        raise LedgerIntegrityError(
            f"release ledger {where} cannot be read ({error}); restore it from a backup (the "
            "S3 bucket's object versions) or rebuild it from the registry with "
            "`dpmerge ledger rebuild`"
        ) from None
    recorded = {r.release_id for r in releases}
    witnessed = {v.tags["dp.content_hash"] for v in registry.released_versions(entry.dataset)}
    missing = sorted(witnessed - recorded)
    if missing:
        raise LedgerIntegrityError(
            f"release ledger {where} lacks {len(missing)} release(s) that the registry records "
            f"as counted (e.g. {missing[0][:12]}…): it was lost or rolled back, so its "
            "cumulative bound would be too low; restore it from a backup (the S3 bucket's "
            "object versions) or rebuild it from the registry with `dpmerge ledger rebuild`"
        )
    counted = {c.name: (c, r.release_id) for r in releases for c in r.candidates}
    for candidate in entry.release.candidates:
        known = counted.get(candidate.name)
        if known is not None and known[0] != candidate:
            where_registered = entry.versions.get(candidate.name, candidate.name)
            raise LedgerIntegrityError(
                f"candidate {candidate.name!r} ({where_registered}) has record "
                f"{_record_hash(candidate)}, but release {known[1][:12]}… counted it with record "
                f"{_record_hash(known[0])}: its registered record changed after it was "
                f"released; take it out of use with `dpmerge registry quarantine "
                f"{where_registered.replace(' v', ' ')}` and merge without it"
            )
    return releases


def ledger_release(
    request: MergeRequest, candidates: Sequence[RegisteredCandidate], plan: PolicyPlan
) -> LedgerEntry:
    records = [c.model_dir.record for c in candidates]
    release = release_of(
        request.content_hash,
        plan.calibration.method,
        records,  # type: ignore[arg-type]
        plan.calibration.weights,
    )
    versions = {
        c.model_dir.record.name: f"{c.name} v{c.version}"
        for c in candidates
        if c.model_dir.record is not None
    }
    return LedgerEntry(release, request.pool.dataset, versions)


def ledger_summary(
    workspace: Workspace, entry: LedgerEntry, delta: float, cap: float | None
) -> tuple[dict[str, Any], str | None]:
    """The cumulative bound with ``entry`` added (for the card), and why the cap refuses it
    (``None`` when it does not). Reads the ledger through :func:`check_ledger`."""
    release = entry.release
    registry = workspace.registry()
    with read_ledger(workspace) as ledger:
        releases = check_ledger(workspace, ledger, registry, entry)
        others = [
            r
            for r in releases
            if r.dataset == release.dataset and r.release_id != release.release_id
        ]
        bound = ledger.check(release, delta, None)
    names = sorted({c.name for r in [*others, release] for c in r.candidates})
    refusal = None
    if cap is not None and bound.epsilon > cap:
        refusal = (
            f"release ledger: this release would raise the cumulative ε to "
            f"{epsilon_text(bound.epsilon)} (δ = {delta:g}, {bound.accountant}) above the cap "
            f"{cap:g}"
        )
    summary = {
        "epsilon": bound.epsilon,
        "delta": delta,
        "accountant": bound.accountant,
        "candidates": names,
        "releases": len(others) + 1,
        "cap": cap,
    }
    return summary, refusal


def record_release(
    workspace: Workspace, entry: LedgerEntry, delta: float, cap: float | None
) -> PairBound:
    """Add ``entry`` to the ledger under the cap (``RefusalError`` above it, e.g. after a
    concurrent release), checked like :func:`ledger_summary`, without losing a concurrent
    writer's release (:func:`update_ledger`)."""
    registry = workspace.registry()

    def add(ledger: ReleaseLedger) -> PairBound:
        check_ledger(workspace, ledger, registry, entry)
        return ledger.record(entry.release, delta, cap)

    return update_ledger(workspace, add)


def rebuild_ledger(workspace: Workspace) -> list[str]:
    """Rebuild the ledger from the registry (the repair for a lost or unreadable ledger): every
    merged version marked released becomes an entry again, its candidates read from their
    verified records. Entries of a readable ledger are kept. Returns the added release ids."""
    registry = workspace.registry()
    entries = []
    with tempfile.TemporaryDirectory(prefix="dpmerge-rebuild-") as scratch:
        for version in registry.released_versions():
            tags = version.tags
            parents = tags["dp.parents"].split(",")
            loaded = registry.load_candidates(
                tags["dp.parent_model"], parents, dest=Path(scratch) / version.version
            )
            by_version = {c.version: c.model_dir.record for c in loaded}
            records = [by_version[p] for p in parents]
            weights = json.loads(tags["dp.weights"])
            release = release_of(tags["dp.content_hash"], tags["dp.method"], records, weights)  # type: ignore[arg-type]
            entries.append((release, float(tags["dp.delta"])))

    def add(ledger: ReleaseLedger) -> list[str]:
        try:
            known = {r.release_id for r in ledger.releases()}
        except UNREADABLE:  # unreadable: replaced by what the registry knows
            ledger.path.write_text(json.dumps({"releases": []}))
            known = set()
        added = []
        for release, delta in entries:
            if release.release_id not in known:
                ledger.record(release, delta)
                added.append(release.release_id)
        return added

    return update_ledger(workspace, add)
