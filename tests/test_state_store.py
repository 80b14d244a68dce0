"""The release-state store (docs/design.md#release-state): create-once and compare-and-swap on
a real S3 server and on local files, so concurrent writers lose nothing; the worst interleavings
forced — six ledger writers whose reads all come before any write, two policies claiming one
alias at once — and the unconditional write of before shown to lose updates under the same
interleaving (so the tests can see a race); signed documents that fail closed and are
restored; policy versions; leases that a killed holder loses within the TTL."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from factories import make_record

from devstack import StackConfig
from dpmerge.accounting.ledger import release_of
from dpmerge.keys import WorkflowKey
from dpmerge.policies import PolicyError
from dpmerge.state import (
    AliasOwnershipError,
    CountedRelease,
    LocalBackend,
    S3Backend,
    StateIntegrityError,
    StateStore,
    serving,
)
from dpmerge.state import policies as stored_policies
from dpmerge.state.backend import Backend
from dpmerge.state.leases import LeaseTimeoutError, lease
from dpmerge.storage import S3Store

WRITERS = 6
DELTA = 1e-5
DATASET = "toy-hmac:" + "0" * 32
KEY = WorkflowKey.generate()


def _entry(i: int) -> CountedRelease:
    record = make_record(f"cand-{i}", 2.0, dataset=DATASET)
    return CountedRelease.of(
        release_of(f"release-{i}", "lc", [record], [1.0]),
        versions={},
        delta=DELTA,
        policy="p",
        policy_version=1,
    )


def _all_read_first(
    monkeypatch: pytest.MonkeyPatch, backend: type[Backend], count: int
) -> list[int]:
    """Every writer's first read waits for the others': the worst interleaving. Returns the
    list of threads that read (to check the barrier was met)."""
    barrier = threading.Barrier(count, timeout=120)
    seen: list[int] = []
    real = backend.read

    def read(self: Backend, key: str) -> Any:
        found = real(self, key)
        if threading.get_ident() not in seen:
            seen.append(threading.get_ident())
            barrier.wait()
        return found

    monkeypatch.setattr(backend, "read", read)
    return seen


@pytest.fixture
def s3_state(s3_mlflow: StackConfig) -> StateStore:
    """A store on the session's S3 server, in a versioned state bucket of its own."""
    config = dataclasses.replace(
        s3_mlflow.s3_config(), state_bucket=f"state-{secrets.token_hex(4)}"
    )
    store = S3Store(config)
    store.ensure_bucket(config.state_bucket, restricted=True)
    return StateStore(S3Backend(store), KEY)


@pytest.fixture
def local_state(tmp_path: Path) -> StateStore:
    return StateStore(LocalBackend(tmp_path / "state"), KEY)


def _stores(request: pytest.FixtureRequest) -> StateStore:
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["local_state", pytest.param("s3_state", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest) -> StateStore:
    return _stores(request)


def test_concurrent_ledger_writers_lose_no_release(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = [_entry(i) for i in range(WRITERS)]
    seen = _all_read_first(monkeypatch, type(store.backend), WRITERS)
    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda e: serving.count(store, e, None), entries))
    monkeypatch.undo()
    assert len(seen) == WRITERS  # every writer read before any wrote
    recorded = {r.release_id for r in serving.read_state(store, DATASET).releases}
    assert recorded == {e.release_id for e in entries}


@pytest.mark.integration
def test_the_unconditional_write_of_before_loses_releases(
    s3_state: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same interleaving with a plain read-modify-write (no If-Match) loses updates."""
    backend = s3_state.backend
    assert isinstance(backend, S3Backend)
    key = serving.dataset_key(DATASET)
    _all_read_first(monkeypatch, S3Backend, WRITERS)

    def unconditional(entry: CountedRelease) -> None:
        found = s3_state.read(key)
        state = (
            serving.DatasetState.from_dict(found.document, key)
            if found
            else serving.DatasetState(DATASET)
        )
        new = state.with_entry(entry, None)
        backend.store.put_bytes(
            key, json.dumps(s3_state.sign(new.to_dict())).encode(), bucket=backend.bucket
        )

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(unconditional, [_entry(i) for i in range(WRITERS)]))
    monkeypatch.undo()
    assert len(serving.read_state(s3_state, DATASET).releases) < WRITERS  # lost updates


def test_two_policies_racing_for_one_alias_one_wins(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both claims read the alias as free before either writes: exactly one compare-and-swap
    wins; the other retries, finds the owner and is refused — it changed nothing."""
    seen = _all_read_first(monkeypatch, type(store.backend), 2)
    results: dict[str, Any] = {}

    def claim(policy: str) -> None:
        try:
            results[policy] = serving.claim(store, DATASET, "m-releases", "shared", policy)
        except AliasOwnershipError as error:
            results[policy] = error

    threads = [threading.Thread(target=claim, args=(p,)) for p in ("eu", "us")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    assert len(seen) == 2
    won = [p for p, r in results.items() if not isinstance(r, Exception)]
    lost = [p for p, r in results.items() if isinstance(r, AliasOwnershipError)]
    assert len(won) == 1 and len(lost) == 1
    assert f"belongs to policy {won[0]!r}" in str(results[lost[0]])
    assert serving.read_state(store, DATASET).alias("m-releases", "shared").owner == won[0]


def test_count_and_point_is_one_write(store: StateStore) -> None:
    """Serving a release counts it in the same conditional write: the alias never names an
    uncounted release; the cap refuses before anything changes."""
    entry = _entry(0)
    guarantee = serving.Guarantee(0.5, DELTA, "generic", "pld", 0.8)
    done = serving.serve(
        store, entry, model="m", alias="a", version="3", guarantee=guarantee, cap=None, run="r1"
    )
    state = serving.read_state(store, DATASET)
    assert done.changed and state.entry(entry.release_id) is not None
    assert state.alias("m", "a").serving == "3" and state.alias("m", "a").run == "r1"
    before = store.read(serving.dataset_key(DATASET)).document
    with pytest.raises(Exception, match="above the cap"):
        serving.serve(
            store,
            _entry(1),
            model="m",
            alias="a",
            version="4",
            guarantee=guarantee,
            cap=0.01,
            run="r2",
        )
    assert store.read(serving.dataset_key(DATASET)).document == before
    later = dataclasses.replace(_entry(1), policy_version=5)
    serving.serve(
        store, later, model="m", alias="a", version="4", guarantee=guarantee, cap=None, run="r3"
    )
    with pytest.raises(serving.SupersededError):  # an older version cannot move it back
        serving.serve(
            store, entry, model="m", alias="a", version="3", guarantee=guarantee, cap=None, run="x"
        )
    assert serving.read_state(store, DATASET).alias("m", "a").serving == "4"


def test_signed_documents_fail_closed_and_are_restored(store: StateStore) -> None:
    serving.count(store, _entry(0), None)
    serving.count(store, _entry(1), None)
    key = serving.dataset_key(DATASET)
    good = store.read(key)
    edited = dict(good.document)
    edited["releases"] = edited["releases"][:1]  # an entry removed by hand: the cap would pass
    store.backend.replace(key, json.dumps(edited).encode(), good.tag)
    with pytest.raises(StateIntegrityError, match=r"does not match its signature.*state restore"):
        serving.read_state(store, DATASET)
    reader = StateStore(store.backend, None)  # an operator: reads, cannot verify or write
    assert len(serving.read_state(reader, DATASET).releases) == 1
    with pytest.raises(StateIntegrityError, match="needs the workflow's key"):
        serving.count(reader, _entry(2), None)
    assert store.restore(key) == 1  # one newer, unsigned content dropped
    assert len(serving.read_state(store, DATASET).releases) == 2
    assert store.restore(key) == 0


def test_policy_versions_are_create_once_and_partial(store: StateStore) -> None:
    base = {"target_epsilon": 2.0, "target_delta": DELTA, "dataset": "digits", "model": "logreg"}
    first = stored_policies.set_policy(store, "eu", {**base, "min_accuracy": 0.8}, source="t")
    assert first.written and first.version.version == 1
    assert (
        stored_policies.set_policy(store, "eu", {"target_epsilon": 2.0}, source="t").written
        is False
    )
    change = stored_policies.set_policy(store, "eu", {"target_epsilon": 1.5}, source="t")
    assert change.version.version == 2 and change.version.policy.min_accuracy == 0.8
    assert change.version.changes == {"target_epsilon": [2.0, 1.5]}
    # a stored policy keeps its alias: another is refused and nothing is written; naming the
    # alias it has (or the default, which it is) is no change
    with pytest.raises(PolicyError, match="its alias is 'policy-eu' and cannot become"):
        stored_policies.set_policy(store, "eu", {"alias": "policy-other"}, source="t")
    assert stored_policies.newest_number(store, "eu") == 2
    for alias in ("policy-eu", "", None):
        same = stored_policies.set_policy(store, "eu", {"alias": alias}, source="t")
        assert same.written is False
    with pytest.raises(PolicyError, match="target_epsilon"):
        stored_policies.set_policy(
            store, "new", {"dataset": "digits", "model": "logreg"}, source="t"
        )
    # concurrent changes get distinct version numbers (create-once), none is lost
    targets = [1.0 + i / 10 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        done = list(
            pool.map(
                lambda t: stored_policies.set_policy(
                    store, "eu", {"target_epsilon": t}, source="t"
                ),
                targets,
            )
        )
    numbers = sorted(c.version.version for c in done)
    assert numbers == [3, 4, 5, 6]
    # a hand-written version that is not valid never supersedes the valid ones
    store.create(stored_policies.version_key("eu", 7), {"schema": "x"})
    assert stored_policies.latest(store, "eu").version == 6
    assert isinstance(stored_policies.versions(store, "eu")[-1], PolicyError)
    assert (
        stored_policies.set_policy(store, "eu", {"target_epsilon": 9.0}, source="t").version.version
        == 8
    )


LEASE_HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from dpmerge.state import LocalBackend, StateStore
from dpmerge.state.leases import lease
store = StateStore(LocalBackend({root!r}), None)
with lease(store, "eu", 10):
    print("held", flush=True)
    time.sleep(3600)
"""


def test_a_killed_holder_loses_its_lease_within_the_ttl(tmp_path: Path) -> None:
    """A run killed while it holds its policy's lease (SIGKILL: no cleanup) stops blocking the
    next run of the policy within the lease's TTL (30 s), not minutes."""
    root = str(tmp_path / "state")
    code = LEASE_HOLDER.format(tests=str(Path(__file__).parent), root=root)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        store = StateStore(LocalBackend(root), None)
        with pytest.raises(LeaseTimeoutError), lease(store, "eu", 1.0):
            pass  # a live holder keeps it
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        with lease(store, "eu", 60.0):
            waited = time.monotonic() - killed
    finally:
        holder.kill()
        holder.wait()
    assert waited <= 31.0
