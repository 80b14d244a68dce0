"""The release ledger (SPEC §7) where a policy merge keeps it: S3 or the local home."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpmerge.accounting.ledger import Release as LedgerRelease
from dpmerge.accounting.ledger import ReleaseLedger, release_of
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.release import MergeRequest
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import RegisteredCandidate

LEDGER_KEY = "ledger/releases.json"


@contextmanager
def open_ledger(workspace: Workspace) -> Iterator[ReleaseLedger]:
    """The release ledger: ``s3://<bucket>/ledger/releases.json`` when S3 is configured, else
    ``<home>/ledger.json``. Changes are written back when the block ends without error. Writers
    are serialised by the merge deployment's concurrency limit of 1."""
    store = workspace.store()
    if store is None:
        workspace.home.mkdir(parents=True, exist_ok=True)
        yield ReleaseLedger(workspace.home / "ledger.json")
        return
    with tempfile.TemporaryDirectory(prefix="dpmerge-ledger-") as scratch:
        path = Path(scratch) / "ledger.json"
        before = None
        if store.exists(LEDGER_KEY):
            before = store.get_bytes(LEDGER_KEY)
            path.write_bytes(before)
        yield ReleaseLedger(path)
        if path.exists() and path.read_bytes() != before:
            store.put_bytes(LEDGER_KEY, path.read_bytes(), content_type="application/json")


def ledger_release(
    request: MergeRequest, candidates: Sequence[RegisteredCandidate], plan: PolicyPlan
) -> LedgerRelease:
    records = [c.model_dir.record for c in candidates]
    return release_of(
        request.content_hash,
        plan.calibration.method,
        records,  # type: ignore[arg-type]
        plan.calibration.weights,
    )


def ledger_summary(
    workspace: Workspace, release: LedgerRelease, delta: float, cap: float | None
) -> dict[str, Any]:
    """The cumulative bound with ``release`` added (for the card); no cap applied here."""
    with open_ledger(workspace) as ledger:
        others = [r for r in ledger.releases(release.dataset) if r.release_id != release.release_id]
        bound = ledger.check(release, delta, None)
    names = sorted({c.name for r in [*others, release] for c in r.candidates})
    return {
        "epsilon": bound.epsilon,
        "delta": delta,
        "accountant": bound.accountant,
        "candidates": names,
        "releases": len(others) + 1,
        "cap": cap,
    }
