"""The policy merge (dpmerge.policy_merge, no Prefect) on real digits candidates in an embedded
MLflow registry: candidate discovery, evaluation data, calibration with method auto, and the
state machine ``apply_policy`` itself — idempotent release, each gate, ledger cap, the serving
invariant (revoke, keep, keep a compliant release), version ordering, RS secrecy — with its
steps observed or replaced."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from factories import train_digits
from mlflow import MlflowClient

from dpmerge import policy_merge as pm
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.data import load_dataset
from dpmerge.errors import DatasetError
from dpmerge.evaluation import MergeAccuracy
from dpmerge.formatting import epsilon_text
from dpmerge.policies import Policy, policy_from_dict
from dpmerge.policy_merge.evaluation_data import _limits_for
from dpmerge.registry import Registry, RegistryError
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion, set_policy
from dpmerge.state.releases import keep_selection, read_release

DELTA = 1e-5
SIGMAS = (1.0, 1.6, 3.0)


@pytest.fixture(scope="module")
def registry_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    home = tmp_path_factory.mktemp("home")
    uri = f"sqlite:///{home / 'mlflow.db'}"
    registry = Registry(uri)
    root = tmp_path_factory.mktemp("candidates")
    epsilons = []
    for sigma in SIGMAS:
        path = train_digits(root, sigma)
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


def _store(workspace: pm.Workspace, policy: Policy) -> PolicyVersion:
    """``policy`` stored as a new version (the test applies it itself)."""
    fields = policy.event_payload()
    return set_policy(workspace.state(), policy.name, fields, source="test", rerun=True).version


def _apply(
    workspace: pm.Workspace, policy: Policy, steps: pm.PolicySteps = pm.LIBRARY_STEPS
) -> pm.PolicyOutcome:
    return pm.apply_policy(_store(workspace, policy), workspace, steps=steps).outcome


def _ledger(workspace: pm.Workspace, outcome: pm.PolicyOutcome) -> state_serving.DatasetState:
    dataset = _tags(workspace, outcome)["dp.dataset"]
    return state_serving.read_state(workspace.state(), dataset)


def _recording(calls: list[str], **replaced: Callable[..., Any]) -> pm.PolicySteps:
    """The library steps (or ``replaced`` ones), each noting its name in ``calls``."""

    def noted(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            calls.append(name)
            return step(*args)

        return run

    return pm.PolicySteps(
        **{
            f.name: noted(f.name, replaced.get(f.name, getattr(pm.LIBRARY_STEPS, f.name)))
            for f in dataclasses.fields(pm.PolicySteps)
        }
    )


def _client(workspace: pm.Workspace) -> MlflowClient:
    """MLflow itself, to check (or tamper with) what the registry stored."""
    return MlflowClient(workspace.tracking_uri, workspace.tracking_uri)


def _aliases(workspace: pm.Workspace, name: str) -> dict[str, str]:
    aliases = _client(workspace).get_registered_model(name).aliases
    return {k: str(v) for k, v in aliases.items()}


def _tags(workspace: pm.Workspace, outcome: pm.PolicyOutcome) -> dict[str, str]:
    return _client(workspace).get_model_version(outcome.merged_model, outcome.version).tags


@contextmanager
def _tampered(workspace: pm.Workspace, outcome: pm.PolicyOutcome, key: str, value: str):
    """The version's tag ``key`` set to ``value`` for the block (a registry whose tags say
    something else than the release), then put back."""
    client, name, version = _client(workspace), outcome.merged_model, outcome.version
    original = client.get_model_version(name, version).tags[key]
    client.set_model_version_tag(name, version, key, value)
    try:
        yield
    finally:
        client.set_model_version_tag(name, version, key, original)


def test_limits_for_recovers_the_row_limit() -> None:
    assert _limits_for(54_000) == [60_000]
    for limit in (600, 601, 1437, 59_999):
        assert limit in _limits_for(limit - round(limit * 0.1))


def test_find_candidates_and_refusals(workspace: pm.Workspace, registry_home, tmp_path) -> None:
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    assert pool.versions == ("1", "2", "3")
    assert pool.dataset.startswith("digits-hmac:")  # keyed: the fingerprint is never published
    assert pool.registered_model.endswith("-logreg-candidates")
    assert pool.merged_model == pool.registered_model.replace("-candidates", "-releases")
    with pytest.raises(RegistryError, match="no ready candidates"):
        pm.find_candidates(registry, "digits", "cnn")
    with pytest.raises(RegistryError, match="no ready candidates"):
        pm.find_candidates(registry, "fashion-mnist", "logreg")
    # a second training set of the same name makes the plain name ambiguous
    other = Registry(f"sqlite:///{tmp_path / 'other.db'}")
    for sigma in SIGMAS[:2]:
        other.register_candidate(train_digits(tmp_path, sigma))
    other.register_candidate(train_digits(tmp_path, 2.0, limit=600))
    with pytest.raises(RegistryError, match="several trainings"):
        pm.find_candidates(other, "digits", "logreg")
    full = pm.find_candidates(other, pool.dataset, "logreg")
    assert full.versions == ("1", "2")
    limited = load_dataset("digits", limit=600)
    # the fingerprint names the same candidates (turned into the identifier with the key)
    by_fingerprint = pm.find_candidates(other, limited.fingerprint, "logreg")
    assert by_fingerprint.versions == ("1",) and by_fingerprint.dataset != full.dataset
    # the limited training is recognised from its number of training rows
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


def test_auto_keeps_the_best_expected_noise_proxy_and_never_steers_by_accuracy(
    workspace: pm.Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The choice among RS, LC and the mixture, the subsets and the odds are data-independent:
    the same plan whatever the candidates' accuracies; by default the weights are too, and
    ``tune_weights`` changes only the weights within the chosen subset
    (docs/design.md#calibration)."""
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    candidates = registry.load_candidates(pool.registered_model, pool.versions, dest=tmp_path)
    record = candidates[0].model_dir.record
    data = pm.load_evaluation_data(record.dataset, record.dataset_size)
    plan = pm.calibrate_policy(_policy(target_epsilon=3.0), candidates, data)
    assert set(plan.compared) == {"rs", "lc", "mixture"}
    utilities = {m: c["expected_utility"] for m, c in plan.compared.items()}
    assert utilities[plan.method] == max(utilities.values())
    assert plan.calibration.epsilon <= 3.0 and plan.reason.startswith(plan.method)
    noisiest = max(
        range(len(candidates)), key=lambda i: candidates[i].model_dir.record.noise_multiplier
    )
    monkeypatch.setattr(MergeAccuracy, "accuracy", lambda self, w, split: w[noisiest])
    same = pm.calibrate_policy(_policy(target_epsilon=3.0), candidates, data)
    assert same.method == plan.method and same.calibration.report == plan.calibration.report
    # opted in: a validation set that rewards the noisiest candidate changes only the weights
    # within the chosen subset, never the method or the subset
    lc = _policy(target_epsilon=3.0, method="lc")
    untuned = pm.calibrate_policy(lc, candidates, data)
    tuned = pm.calibrate_policy(lc.model_copy(update={"tune_weights": True}), candidates, data)
    assert tuned.method == "lc" and tuned.calibration.epsilon <= 3.0
    used = [w > 0 for w in untuned.calibration.weights]
    assert [w > 0 for w in tuned.calibration.weights] == used
    only_rs = pm.calibrate_policy(_policy(target_epsilon=3.0, method="rs"), candidates, data)
    assert only_rs.method == "rs" and set(only_rs.compared) == {"rs"}
    structured = _policy(target_epsilon=3.0, method="auto", gating_bound="structured")
    plan = pm.calibrate_policy(structured, candidates, data)
    assert plan.compared["lc"]["bound"] == "structured"
    assert plan.compared["rs"]["bound"] == "selection"  # RS has its own bound
    assert plan.compared["mixture"]["bound"] == "mixture"
    assert plan.calibration.epsilon <= 3.0


NEW_RELEASE = [
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
REUSED = ["prepare", "calibrate", "plan_release", "serve", "read_card", "project"]


def test_apply_counts_serves_and_reuses(workspace: pm.Workspace, registry_home) -> None:
    target = registry_home["epsilons"][1] * 1.2
    policy = _policy(name="lc-one", target_epsilon=target, method="lc", min_accuracy=0.5)
    calls: list[str] = []
    result = pm.apply_policy(_store(workspace, policy), workspace, steps=_recording(calls))
    first = result.outcome
    assert calls == NEW_RELEASE  # LC: no audit record to store
    assert (first.status, first.previous_version, first.reasons) == (pm.Status.PROMOTED, None, ())
    assert first.serving == "serving" and first.serving_version == first.version
    assert not first.reused and first.epsilon <= target and first.method == "lc"
    assert _aliases(workspace, first.merged_model) == {"policy-lc-one": first.version}
    tags = _tags(workspace, first)
    assert tags["dp.policy"] == "lc-one" and tags["dp.method"] == "lc"
    description = _client(workspace).get_model_version(first.merged_model, first.version)
    assert result.card == description.description and "Release ledger (cumulative)" in result.card
    state = _ledger(workspace, first)
    assert [r.release_id for r in state.releases] == [tags["dp.content_hash"]]
    assert first.cumulative_epsilon == pytest.approx(state.cumulative(DELTA).epsilon)
    pointer = state.alias(first.merged_model, "policy-lc-one")
    assert (pointer.owner, pointer.serving, pointer.policy_version) == ("lc-one", "1", 1)
    assert first.to_dict()["status"] == "promoted"
    # the test rows are protected: what is published and gated is the stored ε-DP estimate
    kept = json.loads(
        (workspace.home / "audit" / f"{tags['dp.content_hash']}.test-accuracy.json").read_text()
    )["metrics"]
    metrics = _client(workspace).get_run(description.run_id).data.metrics
    assert float(tags["dp.accuracy"]) == kept["test_accuracy"] == first.test_accuracy
    assert metrics["test_accuracy"] == kept["test_accuracy"] and "test_loss" not in metrics
    assert kept["test_accuracy_epsilon"] == policy.evaluation_epsilon == 1.0
    assert kept["test_accuracy_delta"] == 0.0 and f"n_test = {kept['test_n']})" in result.card
    for split in ("training", "validation", "test"):
        assert f"| {split} | protected: " in result.card
    assert f"| test | protected: ε = {epsilon_text(1.0)}, δ = 0 (Laplace" in result.card
    # the ledger counts the test rows' spending: the kept estimate's ε and n_test
    (entry,) = state.releases
    assert entry.evaluation == Evaluation(kept["test_accuracy_epsilon"], kept["test_n"])
    assert "Test rows: ε = " in result.card and "One person, whichever split" in result.card
    # the same policy again: the registered release is reused, nothing is merged or drawn again
    calls.clear()
    again = pm.apply_policy(_store(workspace, policy), workspace, steps=_recording(calls)).outcome
    assert calls == REUSED
    assert again.status == pm.Status.UNCHANGED and again.reused
    assert (again.version, again.previous_version) == (first.version, first.version)
    assert len(_ledger(workspace, first).releases) == 1


def test_rs_draw_goes_only_to_the_private_audit_file(workspace: pm.Workspace, registry_home):
    target = registry_home["epsilons"][1] * 1.05
    policy = _policy(name="rs-one", target_epsilon=target, method="rs")
    before = set((workspace.home / "audit").glob("*.json"))
    calls: list[str] = []
    outcome = _apply(workspace, policy, steps=_recording(calls))
    assert outcome.status == pm.Status.PROMOTED
    assert calls == NEW_RELEASE
    audit, accuracy = sorted(set((workspace.home / "audit").glob("*.json")) - before)
    assert accuracy.name == audit.name.replace(".json", ".test-accuracy.json")
    assert audit.name == _tags(workspace, outcome)["dp.content_hash"] + ".json"
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    assert stat.S_IMODE((workspace.home / "audit").stat().st_mode) == 0o700
    record = json.loads(audit.read_text())
    assert record["schema"] == "dpmerge.rs_draw/1" and "drawn_index" in record
    client = _client(workspace)
    version = client.get_model_version(outcome.merged_model, outcome.version)
    run = client.get_run(version.run_id)
    public = json.dumps(
        [version.tags, version.description, run.data.params, run.data.tags, outcome.to_dict()]
    )
    for secret in ("drawn_index", "drawn_candidate", audit.name, str(workspace.home)):
        assert secret not in public


def test_each_gate_and_what_the_alias_serves_after_it(
    workspace: pm.Workspace, registry_home
) -> None:
    """Not promoted by the ledger cap (nothing merged) or by accuracy (registered and counted):
    the alias keeps its release while that release meets the new version, and is revoked when
    it does not; a tag changed after registration breaks the release's signature."""
    target = registry_home["epsilons"][2] * 1.5
    first = _apply(workspace, _policy(name="gated", target_epsilon=target, method="lc"))
    assert first.status == pm.Status.PROMOTED
    same = _policy(name="gated", target_epsilon=target * 1.01, method="rs")
    capped = _apply(workspace, same.model_copy(update={"cumulative_epsilon_cap": 0.01}))
    assert capped.status == pm.Status.NOT_PROMOTED and capped.version is None
    assert capped.reasons[0].startswith("release ledger: ") and capped.compliant
    assert capped.serving == "serving" and "keeps v" in capped.reasons[-1]
    assert _aliases(workspace, first.merged_model)["policy-gated"] == first.version
    strict = _apply(workspace, same.model_copy(update={"min_accuracy": 0.999}))
    assert strict.status == pm.Status.NOT_PROMOTED and not strict.reused
    assert strict.version not in (None, first.version)
    assert [r for r in strict.reasons if "below the minimum 0.999" in r]
    # the old release misses the new floor too: the serving invariant revokes it
    assert strict.serving == "revoked" and strict.revoked_version == first.version
    assert "policy-gated" not in _aliases(workspace, first.merged_model)
    # counted although not promoted: its evaluation was published when it was registered
    hashes = {r.release_id for r in _ledger(workspace, first).releases}
    assert _tags(workspace, strict)["dp.content_hash"] in hashes
    # every gate passes: the same release is served (reused, not merged or drawn again)
    passed = _apply(workspace, same)
    assert passed.status == pm.Status.PROMOTED and passed.reused, passed.reasons
    assert (passed.version, passed.previous_version) == (strict.version, None)
    assert _aliases(workspace, first.merged_model)["policy-gated"] == strict.version
    # a tag changed after registration breaks the release's signature: never reused again
    with _tampered(workspace, strict, "dp.accuracy", "0.99999"):
        again = _apply(workspace, same)
    assert again.status == pm.Status.PROMOTED and not again.reused
    assert again.version not in (strict.version, first.version)


def test_a_redraw_after_a_failed_gate_is_counted_and_on_the_card(
    workspace: pm.Workspace, registry_home
) -> None:
    """Redraw until pass: an RS release that fails its accuracy gate was evaluated — its
    evaluation published — so the ledger counts it, and the card of a release made after it
    for the same policy lists it as an earlier attempt."""
    target = registry_home["epsilons"][1] * 1.13  # releases no other test makes
    failed = _apply(
        workspace, _policy(name="redraw", target_epsilon=target, method="rs", min_accuracy=0.999)
    )
    assert not failed.reused
    assert failed.status == pm.Status.NOT_PROMOTED and failed.version is not None
    failed_hash = _tags(workspace, failed)["dp.content_hash"]
    assert _ledger(workspace, failed).entry(failed_hash) is not None  # counted, not served
    retry = _apply(workspace, _policy(name="redraw", target_epsilon=target * 1.005, method="rs"))
    assert retry.status == pm.Status.PROMOTED and retry.version != failed.version
    assert not retry.reused
    card = _client(workspace).get_model_version(retry.merged_model, retry.version).description
    assert "Earlier attempts for this policy:** 1 release(s)" in card
    assert failed_hash[:12] not in card  # the public card counts them; the internal one names
    internal = read_release(workspace.state(), _tags(workspace, retry)["dp.content_hash"])
    assert internal is not None and failed_hash[:12] in internal["card"]


def test_a_tightened_policy_revokes_or_flags_its_noncompliant_release(
    workspace: pm.Workspace, registry_home
) -> None:
    """The serving invariant: after a run, the alias serves a release that meets the policy's
    current version, or nothing; keeping a non-compliant model must be asked for, and shows."""
    target = registry_home["epsilons"][2] * 1.5
    promoted = _apply(workspace, _policy(name="tight", target_epsilon=target))
    assert promoted.status == pm.Status.PROMOTED
    # a floor no release reaches: not promoted, and the old release does not meet it either
    floor = _apply(workspace, _policy(name="tight", target_epsilon=target, min_accuracy=0.999))
    assert floor.status == pm.Status.NOT_PROMOTED and floor.serving == "revoked"
    assert floor.revoked_version == promoted.version and not floor.compliant
    assert "policy-tight" not in _aliases(workspace, promoted.merged_model)
    pointer = _ledger(workspace, promoted).alias(promoted.merged_model, "policy-tight")
    assert pointer.state == "revoked" and "does not meet version" in pointer.reason
    # back to a compliant policy, then tightened with on_noncompliant: keep
    _apply(workspace, _policy(name="tight", target_epsilon=target))
    kept = _apply(
        workspace,
        _policy(name="tight", target_epsilon=target, min_accuracy=0.999, on_noncompliant="keep"),
    )
    assert kept.status == pm.Status.NOT_PROMOTED and kept.serving == "noncompliant"
    assert kept.serving_version == promoted.version and not kept.compliant
    assert "KEEPS" in kept.reasons[-1]
    assert _aliases(workspace, promoted.merged_model)["policy-tight"] == promoted.version
    tag = _client(workspace).get_registered_model(promoted.merged_model).tags
    assert tag["dpmerge.serves.policy-tight"].startswith("NON-COMPLIANT")


def test_infeasible_target_revokes_or_keeps(workspace: pm.Workspace, registry_home) -> None:
    target = registry_home["epsilons"][2] * 1.5
    promoted = _apply(workspace, _policy(name="inf", target_epsilon=target))
    assert promoted.status == pm.Status.PROMOTED
    below = registry_home["epsilons"][0] / 2
    calls: list[str] = []
    keep = _store(workspace, _policy(name="inf", target_epsilon=below, on_noncompliant="keep"))
    kept = pm.apply_policy(keep, workspace, steps=_recording(calls))
    assert calls == ["prepare", "calibrate", "enforce", "project"]  # nothing merged or registered
    assert kept.card == "" and kept.outcome.status == pm.Status.INFEASIBLE
    assert kept.outcome.revoked_version is None and kept.outcome.serving == "noncompliant"
    low, high = kept.outcome.reachable_epsilon_range
    assert low == pytest.approx(registry_home["epsilons"][0]) and high >= low
    assert _aliases(workspace, promoted.merged_model)["policy-inf"] == promoted.version
    revoked = _apply(workspace, _policy(name="inf", target_epsilon=below))
    assert revoked.status == pm.Status.INFEASIBLE and revoked.revoked_version == promoted.version
    assert "policy-inf" not in _aliases(workspace, promoted.merged_model)
    again = _apply(workspace, _policy(name="inf", target_epsilon=below))
    assert again.revoked_version is None and again.reasons[-1].endswith("serves nothing (revoked)")


def test_an_older_version_never_moves_the_alias(workspace: pm.Workspace, registry_home):
    """Versions order a policy's runs: a run of an older version stops at once when a newer
    version is stored, and can never move an alias a newer version set."""
    older = _store(
        workspace, _policy(name="order", target_epsilon=registry_home["epsilons"][2] * 3)
    )
    newer = _store(
        workspace, _policy(name="order", target_epsilon=registry_home["epsilons"][2] * 2)
    )
    kept = pm.apply_policy(newer, workspace).outcome
    assert kept.status == pm.Status.PROMOTED
    calls: list[str] = []
    stale = pm.apply_policy(older, workspace, steps=_recording(calls)).outcome
    assert calls == ["prepare"]  # stopped before loading anything more
    assert stale.status == pm.Status.SUPERSEDED and "version 2" in stale.reasons[0]
    assert _aliases(workspace, kept.merged_model)["policy-order"] == kept.version


def test_a_later_version_during_the_merge_supersedes_serving(
    workspace: pm.Workspace, registry_home
) -> None:
    """A later version that sets the alias while this run merges (injected before the serve
    step) wins: this run ends superseded and changes nothing."""
    top = registry_home["epsilons"][2]
    first = _apply(workspace, _policy(name="race", target_epsilon=top * 1.2, method="lc"))
    assert first.status == pm.Status.PROMOTED
    middle = registry_home["epsilons"][1] * 1.1
    racing = _store(workspace, _policy(name="race", target_epsilon=middle, method="rs"))

    def later_version_first(ws: pm.Workspace, version: PolicyVersion, *rest: Any) -> Any:
        later = _store(ws, _policy(name="race", target_epsilon=top * 1.2, method="lc"))
        pm.apply_policy(later, ws)
        return pm.serve_release(ws, version, *rest)

    calls: list[str] = []
    outcome = pm.apply_policy(
        racing, workspace, steps=_recording(calls, serve=later_version_first)
    ).outcome
    assert calls[:6] == NEW_RELEASE[:6]
    assert outcome.status == pm.Status.SUPERSEDED and outcome.version != first.version
    assert "already exists or changed" in outcome.reasons[0]
    assert _aliases(workspace, first.merged_model)["policy-race"] == first.version


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


def _published(workspace: pm.Workspace, outcome: pm.PolicyOutcome, scratch: Path) -> str:
    """Everything MLflow holds of a release, as one text: the version's tags and description,
    its run's params, metrics and tags, and every file of its logged model and run."""
    client = _client(workspace)
    version = client.get_model_version(outcome.merged_model, outcome.version)
    run = client.get_run(version.run_id)
    parts = [json.dumps(version.tags), version.description or ""]
    parts += [json.dumps(run.data.params), json.dumps(run.data.metrics), json.dumps(run.data.tags)]
    model_files = Path(
        mlflow.artifacts.download_artifacts(version.source, dst_path=str(scratch / "m"))
    )
    run_files = Path(client.download_artifacts(version.run_id, "", str(scratch)))
    for root in (model_files, run_files):
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in (".json", ".md", ".txt", ".yaml", ""):
                parts.append(path.read_text(errors="replace"))
    names = {p.name for root in (model_files, run_files) for p in root.rglob("*")}
    assert "privacy.json" not in names  # the full report names the candidates
    return "\n".join(parts)


def test_a_mixture_release_draws_once_counts_both_merges_and_publishes_no_candidate(
    workspace: pm.Workspace, registry_home, tmp_path: Path
) -> None:
    """The mixture as a policy method: one stored draw (never drawn again), the ledger counts
    every member of either merge, and what MLflow publishes names no candidate — no name,
    version, record, lineage or metric; the internal record in the state store holds them."""
    registry = workspace.registry()
    pool = pm.find_candidates(registry, "digits", "logreg")
    candidates = registry.load_candidates(pool.registered_model, pool.versions, dest=tmp_path)
    records = [c.model_dir.record for c in candidates]
    low, high = registry_home["epsilons"][0], registry_home["epsilons"][-1]
    for target in (low + (high - low) * f for f in (0.3, 0.5, 0.7, 0.2, 0.8)):
        rungs = calibrate(records, "mixture", target, DELTA).report.rungs
        if len(rungs) == 2 and 0 < rungs[0].probability < 1:
            break
    else:
        pytest.fail("no target between two rungs")
    outcome = _apply(workspace, _policy(name="mix", target_epsilon=target, method="mixture"))
    assert outcome.status == pm.Status.PROMOTED and outcome.method == "mixture"
    assert outcome.weights is None and len(outcome.rungs) == 2
    assert outcome.epsilon <= target
    release = _tags(workspace, outcome)["dp.content_hash"]
    draw_file = workspace.private_dir("audit") / f"{release}.json"
    draw = json.loads(draw_file.read_text())
    assert draw["drawn_index"] in (0, 1) and len(draw["probabilities"]) == 2
    assert draw["candidates"][0].startswith("merge 1: ")
    # a rerun of the same release reuses it: no second draw, no second version
    again = _apply(workspace, _policy(name="mix", target_epsilon=target, method="mixture"))
    assert again.status == pm.Status.UNCHANGED and again.version == outcome.version
    assert json.loads(draw_file.read_text()) == draw
    members = {m for r in outcome.rungs for m in r["members"]}
    assert set(_ledger(workspace, outcome).entry(release).names) == members
    internal = read_release(workspace.state(), release)
    assert internal is not None and len(internal["merge"]["rungs"]) == 2
    assert internal["parents"] == [c.version for c in candidates]
    text = _published(workspace, outcome, tmp_path / "published")
    secrets_of_candidates = {pool.registered_model}
    # the release's own accuracies are published; a candidate's may equal one of them (a
    # one-member rung is that candidate; on 360 rows two models can score alike)
    own = {outcome.test_accuracy}
    accuracies = set()
    for c in candidates:
        published = c.published
        secrets_of_candidates |= {published.name, published.noise_lineage, published.batch_lineage}
        for key in ("test_accuracy", "validation_accuracy"):
            value = c.model_dir.metrics.get(key)
            if value is not None and float(value) not in own:
                accuracies.add(repr(float(value)))
    assert all(c.published.name in internal["card"] for c in candidates)  # the scan can fail
    found = sorted(s for s in secrets_of_candidates if s and s in text)
    numbers = set(re.findall(r"\d+\.\d+(?:e-?\d+)?", text))  # whole numbers, not digits of one
    found += sorted(accuracies & numbers)
    assert not found, f"published release mentions its candidates: {found}"
    assert "Which rows the guarantee protects" in text and "**not protected**" not in text


def test_repairs_act_on_fresh_state_and_leave_a_running_policys_alias_alone(
    workspace: pm.Workspace, registry_home, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Races forced (a burst on the stack lost an alias to them): a verify whose snapshot of
    the pointers predates another run's write does not remove that run's new alias, and an
    alias whose policy a run is applying is not moved under it — once the run is done, it is."""
    from dpmerge.policy_merge import verify as verify_mod
    from dpmerge.state.leases import lease

    outcome = _apply(workspace, _policy(name="fresh", target_epsilon=registry_home["epsilons"][-1]))
    model, alias = outcome.merged_model, "policy-fresh"
    assert _aliases(workspace, model)[alias] == outcome.version
    real = state_serving.read_state
    stale: list[str] = []

    def snapshot_before_the_write(store: Any, dataset: str) -> state_serving.DatasetState:
        found = real(store, dataset)
        if not stale:  # the first read: the pointer is not written yet
            stale.append(dataset)
            return dataclasses.replace(found, aliases={})
        return found

    monkeypatch.setattr(verify_mod.state_serving, "read_state", snapshot_before_the_write)
    findings = verify_mod.verify(workspace, repair=True)
    monkeypatch.undo()
    assert stale and not [f for f in findings if f.kind.value == "unmanaged_alias"]
    assert _aliases(workspace, model)[alias] == outcome.version

    def about_the_alias() -> Any:
        (found,) = [f for f in verify_mod.verify(workspace, repair=True) if alias in f.subject]
        return found

    _client(workspace).delete_registered_model_alias(model, alias)  # drift, mid-run
    taken, done = threading.Event(), threading.Event()

    def run_holding_the_lease() -> None:  # another holder, as another run's process is
        with lease(workspace.state(), "fresh", 5):
            taken.set()
            done.wait(60)

    holder = threading.Thread(target=run_holding_the_lease)
    holder.start()
    try:
        assert taken.wait(60)
        found = about_the_alias()
        assert found.kind.value == "alias_drift" and "a run of policy fresh" in str(found.repaired)
        assert alias not in _aliases(workspace, model)
    finally:
        done.set()
        holder.join()
    found = about_the_alias()
    assert found.repaired == f"alias set back to v{outcome.version}"
    assert _aliases(workspace, model)[alias] == outcome.version


def test_a_tuned_release_publishes_no_validation_metric_and_its_ledger_line_is_dated(
    workspace: pm.Workspace, registry_home, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tune_weights``: nothing MLflow holds of the release — card, tags, run metrics, files —
    names a validation metric (its accuracy and count are of unprotected rows); the card's ledger
    line says when it was read and names ``dpmerge ledger show``, which reads the same ledger
    now (docs/design.md#operator-trust)."""
    from dpmerge import cli

    target = registry_home["epsilons"][1] * 1.2
    policy = _policy(name="tuned", target_epsilon=target, method="lc", tune_weights=True)
    outcome = _apply(workspace, policy)
    assert outcome.status == pm.Status.PROMOTED, outcome.reasons
    text = _published(workspace, outcome, tmp_path / "published")
    assert "validation_accuracy" not in text and "validation_n" not in text
    assert "validation_loss" not in text and "test_accuracy" in text
    description = _client(workspace).get_model_version(outcome.merged_model, outcome.version)
    as_of = re.search(
        r"data source together \(every subset\) as of (\S+): training rows ε = ",
        description.description,
    )
    assert as_of is not None and "`dpmerge ledger show` shows it now" in description.description
    state = _ledger(workspace, outcome)
    assert datetime.fromisoformat(as_of.group(1)).utcoffset() == timedelta(0)
    argv = ["ledger", "show", "--tracking-uri", workspace.tracking_uri, "--delta", str(DELTA)]
    code = cli.main([*argv, "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["as_of"] >= as_of.group(1)
    (ledger,) = [g for g in shown["ledgers"] if state.dataset in g["datasets"]]
    assert ledger["source"] == "digits" and ledger["releases"] == len(state.ledger)
    assert ledger["epsilon"] == state.cumulative(ledger["delta"]).epsilon
    assert ledger["epsilon"] >= outcome.cumulative_epsilon - 1e-12
    statement = state.statement(ledger["delta"])
    assert ledger["test_rows"] == {
        "epsilon": statement.test.epsilon,
        "delta": 0.0,
        "composition": "sequential",
        "unrecorded": list(statement.test.unrecorded),
    }
    assert ledger["per_person"]["epsilon"] == statement.person.epsilon
    assert ledger["per_person"]["delta"] == ledger["delta"]
    assert ledger["per_person"]["accountant"] == ledger["accountant"]
    code = cli.main(["ledger", "show", "--tracking-uri", workspace.tracking_uri])
    out = capsys.readouterr().out
    assert code == 0 and "digits (every subset: " in out and "as of " in out
    assert "  test rows: " in out and "  one person, whichever split: " in out


def test_releases_of_two_subsets_of_one_source_are_charged_to_one_ledger(tmp_path: Path) -> None:
    """The audit's case end to end: a candidate on every digits training row and one on the
    first rows (another fingerprint, another published identifier, each released by its own
    policy). The second release's cumulative bound counts the first: it is at least the joint
    composition of both candidates, re-derived with dp_accounting."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    from dpmerge.accounting.records import candidate_from_dict

    home = tmp_path / "home"
    home.mkdir()
    uri = f"sqlite:///{home / 'mlflow.db'}"
    registry = Registry(uri)
    paths = [train_digits(tmp_path / "c", 1.0), train_digits(tmp_path / "c", 0.9, limit=800)]
    epsilons = [json.loads((p / "record.json").read_text())["privacy"]["epsilon"] for p in paths]
    for path in paths:
        registry.register_candidate(path)
    workspace = pm.Workspace(uri, home, None)
    client = MlflowClient(uri, uri)
    identifiers = sorted({v.tags["dp.dataset"] for v in client.search_model_versions("")})
    assert len(identifiers) == 2 and len({i.split("-hmac:")[0] for i in identifiers}) == 1
    outcomes = [
        _apply(
            workspace,
            _policy(name=f"s{i}", dataset=dataset, target_epsilon=max(epsilons) * 1.2, method="lc"),
        )
        for i, dataset in enumerate(identifiers)
    ]
    assert [o.status for o in outcomes] == [pm.Status.PROMOTED] * 2, [o.reasons for o in outcomes]
    state = state_serving.read_state(workspace.state(), identifiers[1])
    assert len(state.releases) == 1 and len(state.ledger) == 2
    records = [candidate_from_dict(c) for e in state.ledger for c in e.candidates]
    event = dp_event.ComposedDpEvent([r.dp_event() for r in records])
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    joint = accountant.compose(event).get_epsilon(DELTA)
    assert outcomes[1].cumulative_epsilon >= joint > max(o.epsilon for o in outcomes)
    assert state.cumulative(DELTA).epsilon >= joint


def test_private_tuning_releases_a_card_whose_validation_rows_are_protected(
    workspace: pm.Workspace, registry_home, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tune: private``: the release is chosen by the exponential mechanism on validation
    counts (docs/design.md#private-tuning); both cards' row tables read the validation rows
    protected with the selection's ε, the ledger entry records it and counts every candidate
    the selection consulted, and a rerun reuses the release (the selection is kept, not
    redrawn)."""
    target = registry_home["epsilons"][1] * 1.2
    policy = _policy(name="private", target_epsilon=target, tune="private", selection_epsilon=0.5)
    planned = pm.dry_run(_store(workspace, policy), workspace)  # spends nothing, says so
    assert "a dry run spends nothing" in planned.summary()
    assert not list(workspace.private_dir("audit").glob("selection-*"))
    result = pm.apply_policy(_store(workspace, policy), workspace)
    outcome = result.outcome
    assert outcome.status == pm.Status.PROMOTED, outcome.reasons
    row = "| validation | protected: ε = 0.5000, δ = 0 (private tuning: the exponential mechanism"
    assert row in result.card
    assert "Validation rows: ε = **0.5000** at δ = 0" in result.card
    public = _client(workspace).get_model_version(outcome.merged_model, outcome.version)
    assert row in _published(workspace, outcome, tmp_path / "published")
    assert "not protected" not in public.description.split("## Which rows")[1].split("##")[0]
    state = _ledger(workspace, outcome)
    (entry,) = [e for e in state.ledger if e.policy == "private"]
    (selection,) = entry.selections
    assert selection.epsilon == 0.5 and selection.key.startswith("selection-")
    assert f"n_validation = {selection.n}" in result.card
    assert len(list(workspace.private_dir("audit").glob("selection-*"))) == 1
    used = [n for n, w in zip(outcome.candidates, outcome.weights or (), strict=True) if w > 0]
    assert set(used) <= set(entry.names)  # the consulted candidates are all counted
    statement = state.statement(DELTA)
    assert statement.validation >= 0.5
    from dpmerge import cli

    argv = ["ledger", "show", "--tracking-uri", workspace.tracking_uri, "--json"]
    assert cli.main(argv) == 0
    ledgers = json.loads(capsys.readouterr().out)["ledgers"]
    (shown,) = [g for g in ledgers if g["source"] == "digits"]
    assert shown["validation_rows"] == {"epsilon": statement.validation, "delta": 0.0}
    again = pm.apply_policy(_store(workspace, policy), workspace).outcome
    assert again.version == outcome.version and again.reused
    # a ledger rolled back and rebuilt from the internal records still charges the selection
    # (and a second one kept for the same release: another policy's selection that chose the
    # same merge), counts every candidate they consulted and the test rows' estimate
    (kept,) = read_release(workspace.state(), entry.release_id)["selections"]
    assert kept == {"selection": selection.to_dict(), "consulted": sorted(entry.names)}
    other = dataclasses.replace(selection, epsilon=0.25, key="selection-" + "f" * 40)
    keep_selection(workspace.state(), entry.release_id, other, entry.names[:1])
    before = _ledger(workspace, outcome).statement(DELTA)
    assert pm.rebuild_ledger(workspace) == [entry.release_id]  # the second selection added
    assert pm.rebuild_ledger(workspace) == []  # nothing more to add
    (workspace.home / "state" / state_serving.dataset_key(entry.dataset)).unlink()
    assert entry.release_id in pm.rebuild_ledger(workspace)
    state = _ledger(workspace, outcome)
    (rebuilt,) = [e for e in state.ledger if e.release_id == entry.release_id]
    assert rebuilt.selections == (selection, other)
    assert rebuilt.evaluation == entry.evaluation is not None
    assert set(rebuilt.names) == set(entry.names)
    after = state.statement(DELTA)
    assert after.validation == before.validation + 0.25
    assert after.test.epsilon == before.test.epsilon is not None
