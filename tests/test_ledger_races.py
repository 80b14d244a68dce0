"""Concurrent writers of the release ledger (docs/design.md#release-ledger) lose nothing: in S3
(a real S3 server) by conditional writes on the ETag, locally by a file lock. The same
interleaving with an unconditional read-modify-write — what the ledger did before — loses
releases, which shows the test can see the race."""

from __future__ import annotations

import dataclasses
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from factories import make_record

from devstack import StackConfig
from dpmerge import policy_merge as pm
from dpmerge.accounting.ledger import ReleaseLedger, release_of
from dpmerge.policy_merge import release_ledger
from dpmerge.storage import S3Store

WRITERS = 6
DELTA = 1e-5


def _entries() -> list[pm.LedgerEntry]:
    return [
        pm.LedgerEntry(
            release_of(f"release-{i}", "lc", [make_record(f"cand-{i}", 2.0)], [1.0]),
            dataset="toy-hmac:" + "0" * 32,
            versions={},
        )
        for i in range(WRITERS)
    ]


def _all_read_first(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Every writer's first read of the ledger waits for the others': the worst interleaving."""
    barrier = threading.Barrier(count, timeout=120)
    seen: set[int] = set()
    real = S3Store.get_versioned

    def read(self: S3Store, key: str, **kwargs: Any) -> Any:
        found = real(self, key, **kwargs)
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            barrier.wait()
        return found

    monkeypatch.setattr(S3Store, "get_versioned", read)


@pytest.fixture
def s3_workspace(s3_mlflow: StackConfig, tmp_path: Path) -> pm.Workspace:
    """A workspace on the session's S3 server, with a bucket of its own."""
    config = dataclasses.replace(s3_mlflow.s3_config(), bucket=f"ledger-{secrets.token_hex(4)}")
    S3Store(config).ensure_bucket()
    workspace = pm.Workspace(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path, config)
    workspace.registry().released_versions()  # the registry's database exists before the race
    return workspace


@pytest.mark.integration
def test_concurrent_s3_writers_lose_no_release(
    s3_workspace: pm.Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = _entries()
    _all_read_first(monkeypatch, WRITERS)
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda e: pm.record_release(s3_workspace, e, DELTA, None), entries))
    monkeypatch.undo()
    with pm.read_ledger(s3_workspace) as ledger:
        recorded = {r.release_id for r in ledger.releases()}
    assert recorded == {e.release.release_id for e in entries}


@pytest.mark.integration
def test_the_unconditional_write_of_before_loses_releases(
    s3_workspace: pm.Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = s3_workspace.store()
    assert store is not None
    _all_read_first(monkeypatch, WRITERS)

    def unconditional(entry: pm.LedgerEntry) -> None:  # read, modify, put: no If-Match
        path = tmp_path / f"{entry.release.release_id}.json"
        found = store.get_versioned(release_ledger.LEDGER_KEY)
        if found is not None:
            path.write_bytes(found[0])
        ReleaseLedger(path).record(entry.release, DELTA)
        store.put_bytes(release_ledger.LEDGER_KEY, path.read_bytes())

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(unconditional, _entries()))
    monkeypatch.undo()
    with pm.read_ledger(s3_workspace) as ledger:
        assert len(ledger.releases()) < WRITERS  # lost updates


def test_concurrent_local_writers_lose_no_release(tmp_path: Path) -> None:
    workspace = pm.Workspace(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path, None)
    workspace.registry().released_versions()
    entries = _entries()
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda e: pm.record_release(workspace, e, DELTA, None), entries))
    recorded = {r.release_id for r in ReleaseLedger(tmp_path / "ledger.json").releases()}
    assert recorded == {e.release.release_id for e in entries}
