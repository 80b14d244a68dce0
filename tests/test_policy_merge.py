"""The policy merge steps (dpmerge.policy_merge, no Prefect) on real digits candidates in an
embedded MLflow registry: candidate discovery, evaluation data, calibration with method auto,
idempotent release, gates, ledger cap, infeasible targets, event ordering, RS secrecy."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dpmerge import policy_merge as pm
from dpmerge.accounting.ledger import ReleaseLedger
from dpmerge.data import load_dataset
from dpmerge.errors import DatasetError, InfeasibleTargetError
from dpmerge.policies import Policy, policy_from_dict
from dpmerge.policy_merge.evaluation_data import _limits_for
from dpmerge.registry import GateError, Registry, RegistryError
from dpmerge.storage import ObjectNotFoundError, StorageError
from dpmerge.training import TrainConfig, save_candidate, train_candidate

DELTA = 1e-5
SIGMAS = (1.0, 1.6, 3.0)


def _train(root: Path, sigma: float, limit: int | None = None) -> Path:
    data = load_dataset("digits", limit=limit)
    config = TrainConfig(
        dataset="digits",
        model="logreg",
        noise_multiplier=sigma,
        epochs=3,
        batch_size=64,
        learning_rate=1.0,
        name=f"digits-s{sigma}{'-l' if limit else ''}",
    )
    return save_candidate(train_candidate(config, data), root / config.name, DELTA)


@pytest.fixture(scope="module")
def registry_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    home = tmp_path_factory.mktemp("home")
    uri = f"sqlite:///{home / 'mlflow.db'}"
    registry = Registry(uri)
    root = tmp_path_factory.mktemp("candidates")
    epsilons = []
    for sigma in SIGMAS:
        path = _train(root, sigma)
        registry.register_candidate(path)
        epsilons.append(json.loads((path / "record.json").read_text())["privacy"]["epsilon"])
    return {"home": home, "uri": uri, "epsilons": sorted(epsilons)}


@pytest.fixture
def workspace(registry_home: dict[str, Any]) -> pm.Workspace:
    return pm.Workspace(registry_home["uri"], registry_home["home"], None)


def _policy(**fields: Any) -> Policy:
    base = {
        "name": "p",
        "target_epsilon": 5.0,
        "target_delta": DELTA,
        "dataset": "digits",
        "model": "logreg",
    }
    return policy_from_dict({**base, **fields})


def _apply(workspace: pm.Workspace, policy: Policy, when: datetime | None = None) -> Any:
    """The flow's step sequence (flows/merge.py), without Prefect."""
    when = when or datetime.now(UTC)
    registry = workspace.registry()
    pool = pm.find_candidates(registry, policy.dataset, policy.model)
    scratch = workspace.scratch()
    try:
        candidates = registry.load_candidates(pool.registered_model, pool.versions, dest=scratch)
        data = pm.load_evaluation_data(
            pool.dataset,
            candidates[0].model_dir.record.dataset_size,
            cache_dir=workspace.cache_dir,
        )
        try:
            plan = pm.calibrate_policy(policy, candidates, data)
        except InfeasibleTargetError as error:
            return pm.handle_infeasible(registry, policy, pool, error, when), None
        request = pm.merge_request(policy, pool, candidates, plan)
        entry = pm.ledger_release(request, candidates, plan)
        registered = pm.find_release(registry, request)
        if registered is None:
            release = pm.merge_release(
                request, candidates, plan, data, scratch, audit_dir=workspace.private_dir("audit")
            )
            pm.store_audit(workspace, release)
            ledger = pm.ledger_summary(workspace, entry, policy.target_delta, None)
            registered = pm.register_release(registry, request, release, ledger)
        status, previous, reasons, cumulative = pm.promote_release(
            workspace, registry, policy, registered, entry, when
        )
        return (status, previous, reasons, cumulative), registered
    finally:
        pm.remove_tree(scratch)


def _aliases(workspace: pm.Workspace, name: str) -> dict[str, str]:
    aliases = workspace.registry().client.get_registered_model(name).aliases
    return {k: str(v) for k, v in aliases.items()}


def test_limits_for_recovers_the_row_limit() -> None:
    assert _limits_for(54_000) == [60_000]
    for limit in (600, 601, 1437, 59_999):
        assert limit in _limits_for(limit - round(limit * 0.1))


def test_find_candidates_and_refusals(workspace: pm.Workspace, registry_home, tmp_path) -> None:
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    assert pool.versions == ("1", "2", "3")
    assert pool.dataset.startswith("digits-sha256:")
    assert pool.merged_model == f"{pool.registered_model}-merged"
    with pytest.raises(RegistryError, match="no ready candidates"):
        pm.find_candidates(registry, "digits", "cnn")
    with pytest.raises(RegistryError, match="no ready candidates"):
        pm.find_candidates(registry, "fashion-mnist", "logreg")
    # a second training set of the same name makes the plain name ambiguous
    other = Registry(f"sqlite:///{tmp_path / 'other.db'}")
    for sigma in SIGMAS[:2]:
        other.register_candidate(_train(tmp_path, sigma))
    other.register_candidate(_train(tmp_path, 2.0, limit=600))
    with pytest.raises(RegistryError, match="several trainings"):
        pm.find_candidates(other, "digits", "logreg")
    full = pm.find_candidates(other, pool.dataset, "logreg")
    assert full.versions == ("1", "2")
    # the limited training is recognised from its number of training rows
    limited = load_dataset("digits", limit=600)
    found = pm.load_evaluation_data(limited.fingerprint, limited.dataset_size)
    assert torch.equal(found.validation.features, limited.validation.features)
    assert len(found.validation) == round(600 * 0.1)


def test_candidates_are_cached_by_content_hash(workspace: pm.Workspace, tmp_path: Path) -> None:
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    cache = tmp_path / "cache"
    first = pm.load_candidates(registry, pool, tmp_path / "a", cache_dir=cache)
    assert [c.version for c in first] == list(pool.versions)
    assert len(list(cache.iterdir())) == len(pool.versions)
    assert not any(c.model_dir.path.is_relative_to(cache) for c in first)  # downloaded
    again = pm.load_candidates(registry, pool, tmp_path / "b", cache_dir=cache)
    assert all(c.model_dir.path.is_relative_to(cache) for c in again)  # from the cache
    assert not (tmp_path / "b").exists()
    for old, new in zip(first, again, strict=True):
        assert old.model_dir.record == new.model_dir.record
        weights = new.model_dir.weights.items()
        assert all(torch.equal(old.model_dir.weights[k], v) for k, v in weights)
    # a tampered cache entry no longer matches its content hash: downloaded again
    tampered = again[0].model_dir.path / "weights.safetensors"
    tampered.write_bytes(tampered.read_bytes()[:-1] + b"0")
    third = pm.load_candidates(registry, pool, tmp_path / "c", cache_dir=cache)
    assert not third[0].model_dir.path.is_relative_to(cache)
    assert third[1].model_dir.path.is_relative_to(cache)
    fourth = pm.load_candidates(registry, pool, tmp_path / "d", cache_dir=cache)
    assert all(c.model_dir.path.is_relative_to(cache) for c in fourth)  # repaired


def test_evaluation_data_found_by_fingerprint_and_cached(tmp_path: Path) -> None:
    data = load_dataset("digits")
    found = pm.load_evaluation_data(data.fingerprint, data.dataset_size, cache_dir=tmp_path)
    assert torch.equal(found.validation.features, data.validation.features)
    assert torch.equal(found.test.labels, data.test.labels)
    assert len(list(tmp_path.iterdir())) == 1
    again = pm.load_evaluation_data(data.fingerprint, data.dataset_size, cache_dir=tmp_path)
    assert torch.equal(again.validation.features, data.validation.features)
    assert torch.equal(again.test.features, data.test.features)
    with pytest.raises(DatasetError, match="fingerprint"):
        pm.load_evaluation_data("digits-sha256:" + "0" * 32, data.dataset_size)


def test_auto_keeps_the_better_expected_validation_accuracy(
    workspace: pm.Workspace, tmp_path: Path
) -> None:
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    candidates = registry.load_candidates(pool.registered_model, pool.versions, dest=tmp_path)
    data = pm.load_evaluation_data(pool.dataset, candidates[0].model_dir.record.dataset_size)
    plan = pm.calibrate_policy(_policy(target_epsilon=3.0), candidates, data)
    assert set(plan.compared) == {"rs", "lc"}
    best = max(plan.compared.values(), key=lambda c: c["expected_validation_accuracy"])
    assert plan.compared[plan.method] == best
    assert plan.calibration.epsilon <= 3.0
    only_rs = pm.calibrate_policy(_policy(target_epsilon=3.0, method="rs"), candidates, data)
    assert only_rs.method == "rs" and set(only_rs.compared) == {"rs"}
    structured = _policy(target_epsilon=3.0, method="auto", gating_bound="structured")
    plan = pm.calibrate_policy(structured, candidates, data)
    assert plan.compared["lc"]["bound"] == "structured"
    assert plan.compared["rs"]["bound"] == "selection"  # RS has its own bound
    assert plan.calibration.epsilon <= 3.0


def test_apply_promotes_records_ledger_and_reuses(workspace: pm.Workspace, registry_home) -> None:
    target = registry_home["epsilons"][1] * 1.2
    policy = _policy(name="lc-one", target_epsilon=target, method="lc", min_accuracy=0.5)
    (status, previous, reasons, cumulative), registered = _apply(workspace, policy)
    assert (status, previous, reasons) == ("promoted", None, ())
    assert not registered.reused and registered.epsilon <= target
    assert _aliases(workspace, registered.name) == {"policy-lc-one": registered.version}
    client = workspace.registry().client
    version = client.get_model_version(registered.name, registered.version)
    assert version.tags["dp.policy"] == "lc-one" and version.tags["dp.method"] == "lc"
    assert "Release ledger (cumulative)" in version.description
    ledger = ReleaseLedger(workspace.home / "ledger.json")
    assert [r.release_id for r in ledger.releases()] == [registered.content_hash]
    assert cumulative == pytest.approx(
        ledger.cumulative(ledger.releases()[0].dataset, DELTA).epsilon
    )
    # the same policy again: the registered release is reused, nothing new is merged
    (status, _, _, _), again = _apply(workspace, policy)
    assert status == "unchanged" and again.reused and again.version == registered.version
    assert len(ReleaseLedger(workspace.home / "ledger.json").releases()) == 1


def test_rs_draw_goes_only_to_the_private_audit_file(workspace: pm.Workspace, registry_home):
    target = registry_home["epsilons"][1] * 1.05
    policy = _policy(name="rs-one", target_epsilon=target, method="rs")
    before = set((workspace.home / "audit").glob("*.json"))
    (status, *_), registered = _apply(workspace, policy)
    assert status == "promoted"
    (audit,) = set((workspace.home / "audit").glob("*.json")) - before
    assert audit.name.startswith(registered.content_hash)
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    assert stat.S_IMODE((workspace.home / "audit").stat().st_mode) == 0o700
    record = json.loads(audit.read_text())
    assert record["method"] == "rs" and "drawn_index" in record
    client = workspace.registry().client
    version = client.get_model_version(registered.name, registered.version)
    run = client.get_run(version.run_id)
    public = json.dumps([version.tags, version.description, run.data.params, run.data.tags])
    for secret in ("drawn_index", "drawn_candidate", audit.name, str(workspace.home)):
        assert secret not in public


def test_failed_gates_leave_the_alias(workspace: pm.Workspace, registry_home) -> None:
    target = registry_home["epsilons"][2] * 1.5
    good = _policy(name="gated", target_epsilon=target)
    (status, *_), first = _apply(workspace, good)
    assert status == "promoted"
    strict = _policy(name="gated", target_epsilon=target * 1.01, min_accuracy=0.999)
    (status, _, reasons, _), second = _apply(workspace, strict)
    assert status == "not_promoted" and second.version != first.version
    assert any("below the minimum" in r for r in reasons)
    assert _aliases(workspace, first.name)["policy-gated"] == first.version
    capped = _policy(name="gated", target_epsilon=target * 1.02, cumulative_epsilon_cap=0.01)
    (status, _, reasons, _), _ = _apply(workspace, capped)
    assert status == "not_promoted" and "release ledger" in reasons[0]
    assert _aliases(workspace, first.name)["policy-gated"] == first.version


def test_infeasible_target_revokes_or_keeps(workspace: pm.Workspace, registry_home) -> None:
    target = registry_home["epsilons"][2] * 1.5
    (status, *_), registered = _apply(workspace, _policy(name="inf", target_epsilon=target))
    assert status == "promoted"
    below = registry_home["epsilons"][0] / 2
    kept, _ = _apply(workspace, _policy(name="inf", target_epsilon=below, on_infeasible="keep"))
    assert kept.status == "infeasible" and kept.revoked_version is None
    low, high = kept.reachable_epsilon_range
    assert low == pytest.approx(registry_home["epsilons"][0]) and high >= low
    assert _aliases(workspace, registered.name)["policy-inf"] == registered.version
    revoked, _ = _apply(workspace, _policy(name="inf", target_epsilon=below))
    assert revoked.status == "infeasible" and revoked.revoked_version == registered.version
    assert "policy-inf" not in _aliases(workspace, registered.name)


def test_an_older_event_never_moves_the_alias_back(workspace: pm.Workspace, registry_home):
    now = datetime.now(UTC)
    newer = _policy(name="order", target_epsilon=registry_home["epsilons"][2] * 2)
    (status, *_), kept = _apply(workspace, newer, now)
    assert status == "promoted"
    older = _policy(name="order", target_epsilon=registry_home["epsilons"][2] * 3)
    (status, _, reasons, _), _ = _apply(workspace, older, now - timedelta(seconds=5))
    assert status == "superseded" and "later policy event" in reasons[0]
    assert _aliases(workspace, kept.name)["policy-order"] == kept.version
    below = registry_home["epsilons"][0] / 2
    stale, _ = _apply(workspace, _policy(name="order", target_epsilon=below), now - timedelta(1))
    assert stale.status == "superseded"
    assert _aliases(workspace, kept.name)["policy-order"] == kept.version


def test_a_failed_ledger_write_moves_the_alias_back(
    workspace: pm.Workspace, registry_home, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = registry_home["epsilons"][2] * 1.5
    (status, *_), first = _apply(workspace, _policy(name="ledger", target_epsilon=target))
    assert status == "promoted"

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ReleaseLedger, "record", broken)
    with pytest.raises(OSError, match="disk full"):
        _apply(workspace, _policy(name="ledger", target_epsilon=target * 1.1))
    assert _aliases(workspace, first.name)["policy-ledger"] == first.version


def test_pld_file_cache_is_bit_identical(tmp_path: Path) -> None:
    from dpmerge.accounting import pld, profiles

    args = (1.3, 1 / 21, 40, 1e-3)
    pld.set_disk_cache(tmp_path)
    try:
        built = pld.subsampled_gaussian_pld(*args)
        (stored,) = tmp_path.iterdir()
        cached = pld.subsampled_gaussian_pld(*args)
        assert cached is not built
        for delta in (1e-3, 1e-5, 1e-7):
            assert profiles.epsilon_for_delta(cached, delta) == profiles.epsilon_for_delta(
                built, delta
            )
        for side in ("_pmf_remove", "_pmf_add"):
            assert getattr(cached, side)._lower_loss == getattr(built, side)._lower_loss
            assert (getattr(cached, side)._probs == getattr(built, side)._probs).all()
        stored.write_bytes(b"not a cache file")  # unreadable: rebuilt, not trusted
        rebuilt = pld.subsampled_gaussian_pld(*args)
        assert profiles.epsilon_for_delta(rebuilt, 1e-5) == profiles.epsilon_for_delta(built, 1e-5)
        other = pld.subsampled_gaussian_pld(1.3, 1 / 21, 41, 1e-3)  # another key, another file
        assert len(list(tmp_path.iterdir())) == 2 and other is not None
    finally:
        pld.set_disk_cache(None)


def test_transient_errors_are_told_apart() -> None:
    assert pm.is_transient(ConnectionError("reset"))
    assert pm.is_transient(RegistryError("MLflow server http://x unreachable (refused)"))
    assert pm.is_transient(StorageError("S3 endpoint http://x unreachable while reading"))
    assert not pm.is_transient(ObjectNotFoundError("not found while reading"))
    assert not pm.is_transient(GateError("m", "1", ["accuracy 0.1 is below the minimum 0.8"]))
    assert not pm.is_transient(RegistryError("m v3 does not exist"))
    assert not pm.is_transient(ValueError("bad"))


def test_workspace_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ("MLFLOW_TRACKING_URI", "DPMERGE_S3_ENDPOINT_URL", "DPMERGE_S3_BUCKET"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DPMERGE_HOME", str(tmp_path / "h"))
    ws = pm.Workspace.from_env()
    assert ws.tracking_uri == f"sqlite:///{tmp_path / 'h' / 'mlflow.db'}" and ws.s3 is None
    monkeypatch.setenv("DPMERGE_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:2")
    ws = pm.Workspace.from_env()
    assert ws.tracking_uri == "http://127.0.0.1:2" and ws.s3 is not None
    scratch = ws.scratch()
    assert stat.S_IMODE(os.stat(scratch).st_mode) == 0o700
