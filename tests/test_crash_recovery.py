"""Crash a policy run at every step boundary — a real SIGKILL of the process, not an exception —
on a real S3 server and MLflow server, then check SPEC §9's invariants and that a rerun of the
same policy version converges (docs/design.md#release-state):

* served ⇒ counted: every alias MLflow shows, and every serving pointer, names a release the
  ledger counts;
* one draw per release: the RS draw stored before the crash is the one the rerun uses;
* the rerun ends promoted (or unchanged), its alias where its serving pointer is, and
  ``registry verify`` finds nothing.

Also on the stack: two policies racing for one alias through ``apply_policy`` (forced
interleaving: exactly one serves, the other is refused with nothing changed), and six RS
policies served at once (none fails, the ledger lacks none)."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import DELTA, train_digits

from devstack import StackConfig
from dpmerge import policy_merge as pm
from dpmerge.policies import policy_from_dict
from dpmerge.policy_merge.draws import SCHEMA as RS_SCHEMA
from dpmerge.policy_merge.verify import verify
from dpmerge.state import AliasOwnershipError, S3Backend
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion, set_policy
from dpmerge.storage import S3Store

pytestmark = pytest.mark.integration

BOUNDARIES = [
    "prepare",
    "calibrate",
    "plan_release",
    "merge",
    "count",
    "register",
    "serve",
    "read_card",
    "project",
]
"""The steps of a new RS release in the order they run; the run is killed just before one."""

CRASHING_RUN = """
import dataclasses, os, signal, sys
sys.path.insert(0, {tests!r})
from dpmerge import policy_merge as pm
from dpmerge.state.policies import read_version
import torch
torch.set_num_threads(1)
workspace = pm.Workspace.from_env({home!r})
workspace.use_caches()
version = read_version(workspace.state(), {name!r}, 1)

def killing(name, step):
    def run(*args):
        if name == {boundary!r}:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally, no exception
        return step(*args)
    return run

steps = pm.PolicySteps(**{{
    f.name: killing(f.name, getattr(pm.LIBRARY_STEPS, f.name))
    for f in dataclasses.fields(pm.PolicySteps)
}})
pm.apply_policy(version, workspace, run="crashing", steps=steps)
print("not killed", flush=True)
"""


@pytest.fixture(scope="module")
def stack_workspace(
    s3_mlflow: StackConfig, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Digits candidates registered on the session's MLflow server; a state bucket and an
    audit bucket of this module's own on the session's S3 server."""
    torch.set_num_threads(1)
    suffix = secrets.token_hex(4)
    config = dataclasses.replace(
        s3_mlflow.s3_config(), state_bucket=f"state-{suffix}", audit_bucket=f"audit-{suffix}"
    )
    store = S3Store(config)
    store.ensure_bucket(config.state_bucket, restricted=True)
    store.ensure_bucket(config.audit_bucket, restricted=True)
    home = tmp_path_factory.mktemp("crash-home")
    workspace = pm.Workspace(s3_mlflow.mlflow_url, home, config)
    root = tmp_path_factory.mktemp("crash-candidates")
    registry = workspace.registry()
    for sigma in (1.0, 1.6, 3.0):
        registry.register_candidate(train_digits(root, sigma, suffix=f"-crash-{suffix}"))
    pool = pm.find_candidates(registry, "digits", "logreg", workspace.state())
    epsilons = sorted(
        float(registry.get_version(pool.registered_model, v).tags["dp.epsilon"])
        for v in pool.versions
    )
    env = {
        **s3_mlflow.client_env(),
        "MLFLOW_TRACKING_URI": s3_mlflow.mlflow_url,
        "DPMERGE_S3_STATE_BUCKET": config.state_bucket,
        "DPMERGE_S3_AUDIT_BUCKET": config.audit_bucket,
        "DPMERGE_SECRET_KEY": os.environ["DPMERGE_SECRET_KEY"],
        # this module's own buckets were made by the stack's S3 identity (the workflow's
        # reaches only the stack's state and audit buckets): the crashing run uses it too
        "AWS_ACCESS_KEY_ID": config.access_key_id,
        "AWS_SECRET_ACCESS_KEY": config.secret_access_key,
    }
    return {"workspace": workspace, "pool": pool, "epsilons": epsilons, "env": env}


def _store_version(workspace: pm.Workspace, **fields: Any) -> PolicyVersion:
    policy = policy_from_dict({"dataset": "digits", "model": "logreg", **fields})
    return set_policy(workspace.state(), policy.name, policy.event_payload(), source="t").version


def _audit(workspace: pm.Workspace) -> dict[str, int]:
    """Release hash → stored RS draw, from the audit bucket."""
    store = workspace.store()
    assert store is not None
    found = {}
    for key in store.list_keys("releases/", bucket=store.config.audit_bucket):
        record = json.loads(store.get_bytes(key, bucket=store.config.audit_bucket))
        if record.get("schema") == RS_SCHEMA:  # not a test-accuracy draw
            found[record["release"]] = record["drawn_index"]
    return found


def _served_implies_counted(workspace: pm.Workspace, pool: pm.CandidatePool) -> None:
    registry = workspace.registry()
    state = state_serving.read_state(workspace.state(), pool.dataset)
    counted = {r.release_id for r in state.releases}
    for alias in state.aliases.values():
        if alias.serving is not None:
            assert alias.release in counted, f"pointer {alias.alias} serves an uncounted release"
    if registry.model_exists(pool.merged_model):
        for alias, version in registry.aliases(pool.merged_model).items():
            facts = registry.release_facts(registry.get_version(pool.merged_model, version))
            assert facts.content_hash in counted, f"MLflow alias {alias} serves it uncounted"


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_run_killed_at_any_step_boundary_leaves_nothing_served_uncounted(
    stack_workspace: dict[str, Any], boundary: str
) -> None:
    workspace, pool = stack_workspace["workspace"], stack_workspace["pool"]
    index = BOUNDARIES.index(boundary)
    name = f"crash-{index}"
    target = stack_workspace["epsilons"][1] * (1.02 + 0.01 * index)  # a release of its own
    version = _store_version(
        workspace, name=name, target_epsilon=target, target_delta=DELTA, method="rs"
    )
    home = str(workspace.home)  # the module's caches (candidates, splits, PLDs) are shared
    code = CRASHING_RUN.format(
        tests=str(Path(__file__).parent), home=home, name=name, boundary=boundary
    )
    env = {**os.environ, **stack_workspace["env"], "DPMERGE_HOME": home}
    killed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    _served_implies_counted(workspace, pool)
    draws_before = _audit(workspace)
    workspace.use_caches()
    result = pm.apply_policy(version, workspace, run="rerun").outcome
    assert result.status in (pm.Status.PROMOTED, pm.Status.UNCHANGED), result.reasons
    assert workspace.registry().aliases(pool.merged_model)[f"policy-{name}"] == result.version
    _served_implies_counted(workspace, pool)
    draws_after = _audit(workspace)
    for release, index_drawn in draws_before.items():  # one draw per release: never redrawn
        assert draws_after[release] == index_drawn
    release = workspace.registry().get_version(pool.merged_model, result.version)
    assert release.tags["dp.content_hash"] in draws_after  # its draw was stored before use
    assert verify(workspace, dataset=pool.dataset) == []


def test_two_policies_racing_for_one_alias_one_serves_one_is_refused(
    stack_workspace: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two policies name the same new alias; both runs read the dataset document before either
    writes (forced): one compare-and-swap wins, the other run is refused — AliasOwnershipError,
    which the flow ends as ``Rejected`` — and the alias serves the winner's release."""
    workspace, pool = stack_workspace["workspace"], stack_workspace["pool"]
    top = stack_workspace["epsilons"][2] * 1.5
    versions = {
        name: _store_version(
            workspace, name=name, target_epsilon=top, target_delta=DELTA, alias="contested"
        )
        for name in ("left", "right")
    }
    key = state_serving.dataset_key(pool.dataset)
    barrier = threading.Barrier(2, timeout=300)
    waited: set[int] = set()
    real = S3Backend.read

    def read(self: S3Backend, wanted: str) -> Any:
        found = real(self, wanted)
        if wanted == key and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait()  # both runs' first read of the document, before either writes
        return found

    monkeypatch.setattr(S3Backend, "read", read)
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = pm.apply_policy(versions[name], workspace).outcome
        except AliasOwnershipError as error:
            results[name] = error

    with ThreadPoolExecutor(2) as pool_:
        list(pool_.map(run, versions))
    monkeypatch.undo()
    refused = [n for n, r in results.items() if isinstance(r, AliasOwnershipError)]
    served = [n for n, r in results.items() if not isinstance(r, Exception)]
    assert len(refused) == 1 and len(served) == 1, results
    winner = results[served[0]]
    assert winner.status == pm.Status.PROMOTED
    state = state_serving.read_state(workspace.state(), pool.dataset)
    assert state.alias(pool.merged_model, "contested").owner == served[0]
    assert workspace.registry().aliases(pool.merged_model)["contested"] == winner.version


def test_six_rs_policies_served_at_once_all_succeed_and_are_counted(
    stack_workspace: dict[str, Any],
) -> None:
    """Concurrent promotions: every run serves, none fails on a ledger another one changed,
    and the ledger counts every release."""
    workspace, pool = stack_workspace["workspace"], stack_workspace["pool"]
    low = stack_workspace["epsilons"][1]
    versions = [
        _store_version(
            workspace,
            name=f"many-{i}",
            target_epsilon=low * (1.2 + 0.03 * i),
            target_delta=DELTA,
            method="rs",
        )
        for i in range(6)
    ]
    with ThreadPoolExecutor(6) as executor:
        outcomes = list(executor.map(lambda v: pm.apply_policy(v, workspace).outcome, versions))
    assert [o.status for o in outcomes] == [pm.Status.PROMOTED] * 6, [o.reasons for o in outcomes]
    counted = {
        r.release_id for r in state_serving.read_state(workspace.state(), pool.dataset).releases
    }
    registry = workspace.registry()
    for outcome in outcomes:
        stored = registry.get_version(outcome.merged_model, outcome.version)
        assert stored.tags["dp.content_hash"] in counted
    _served_implies_counted(workspace, pool)
