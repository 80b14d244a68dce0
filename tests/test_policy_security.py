"""The policy merge's security contract (docs/design.md#security,
docs/design.md#release-state) on real digits candidates in an embedded registry: forged and
unsigned records (quarantine, no re-signing), fixed seeds and fingerprints never published,
MLflow tags an insider flips never trusted, alias ownership, a damaged or rolled-back ledger,
one RS draw per release and every evaluated draw counted, gates before side effects, one
version per release, abandoned registrations, and what MLflow shows. Each test starts from its
own registry (a fresh home) unless it only reads."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from factories import DELTA, train_digits
from mlflow import MlflowClient

from dpmerge import manifests, model_signature, serving_statement
from dpmerge import policy_merge as pm
from dpmerge.cli import main
from dpmerge.data import load_dataset
from dpmerge.errors import RefusalError
from dpmerge.formatting import epsilon_text
from dpmerge.keys import WorkflowKey
from dpmerge.policies import Policy, PolicyError, policy_from_dict
from dpmerge.policy_merge import draws
from dpmerge.policy_merge import release as release_step
from dpmerge.policy_merge.promotion import publish
from dpmerge.policy_merge.verify import verify as verify_drift
from dpmerge.registry import RecordIntegrityError, Registry, candidate_content_hash
from dpmerge.registry.tags import STATEMENT_TAG
from dpmerge.serving_statement import ServingStatementError
from dpmerge.state import AliasOwnershipError, StateIntegrityError
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion, set_policy
from dpmerge.state.serving import dataset_key
from dpmerge.vocabulary import FindingKind

SIGMAS = (1.0, 1.6, 3.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trained")
    dirs = [train_digits(root, sigma) for sigma in SIGMAS]
    epsilons = sorted(
        json.loads((d / "record.json").read_text())["privacy"]["epsilon"] for d in dirs
    )
    seeded = train_digits(root, 2.0, noise_seed=7, batch_seed=7, suffix="-fixed")
    return {"dirs": dirs, "epsilons": epsilons, "seeded": seeded}


def _fresh(tmp_path: Path, dirs: list[Path]) -> pm.Workspace:
    """A new home whose registry holds ``dirs`` as candidates."""
    home = tmp_path / "home"
    workspace = pm.Workspace(f"sqlite:///{home / 'mlflow.db'}", home, None)
    registry = workspace.registry()
    for path in dirs:
        registry.register_candidate(path)
    return workspace


@pytest.fixture
def fresh(tmp_path: Path, trained: dict[str, Any]) -> pm.Workspace:
    return _fresh(tmp_path, trained["dirs"])


def _policy(**fields: Any) -> Policy:
    base = {"name": "p", "target_epsilon": 5.0, "target_delta": DELTA}
    return policy_from_dict({**base, "dataset": "digits", "model": "logreg", **fields})


def _store(ws: pm.Workspace, policy: Policy) -> PolicyVersion:
    fields = policy.event_payload()
    return set_policy(ws.state(), policy.name, fields, source="test", rerun=True).version


def _apply(ws: pm.Workspace, policy: Policy, **steps: Any) -> Any:
    return pm.apply_policy(_store(ws, policy), ws, steps=_steps(**steps)).outcome


def _state_file(ws: pm.Workspace) -> Path:
    return ws.home / "state" / dataset_key(_pool(ws).dataset)


def _steps(calls: list[str] | None = None, **replaced: Callable[..., Any]) -> pm.PolicySteps:
    def noted(name: str, step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            if calls is not None:
                calls.append(name)
            return step(*args)

        return run

    fields = dataclasses.fields(pm.PolicySteps)
    return pm.PolicySteps(
        **{
            f.name: noted(f.name, replaced.get(f.name, getattr(pm.LIBRARY_STEPS, f.name)))
            for f in fields
        }
    )


def _client(ws: pm.Workspace) -> MlflowClient:
    return MlflowClient(ws.tracking_uri, ws.tracking_uri)


def _pool(ws: pm.Workspace) -> pm.CandidatePool:
    return pm.find_candidates(ws.registry(), "digits", "logreg", ws.state())


def _aliases(ws: pm.Workspace, name: str) -> dict[str, str]:
    return {k: str(v) for k, v in _client(ws).get_registered_model(name).aliases.items()}


def _versions(ws: pm.Workspace, name: str) -> list[Any]:
    return _client(ws).search_model_versions(f"name = '{name}'")


def _stored_dir(ws: pm.Workspace, name: str, version: str) -> Path:
    """The candidate's files in the artifact store (a local directory when embedded)."""
    source = _client(ws).get_model_version(name, version).source
    return Path(urlparse(source).path) / "extra_files"


# --- item 1: forged records ------------------------------------------------------------------


def test_a_forged_record_is_refused_and_only_quarantine_repairs_it(
    fresh: pm.Workspace, capsys
) -> None:
    """σ edited ×10 in the stored record, its content-hash tag rewritten to match (what an
    artifact-store and registry writer can do): the merge is refused with the repair, nothing
    is registered; nothing re-signs a record after the fact (no `registry sign`); quarantining
    the version — in the release-state store — lets the policy run without it, and flipping
    MLflow's status tag back does not undo the quarantine."""
    pool = _pool(fresh)
    model, forged = pool.registered_model, pool.versions[0]
    stored = _stored_dir(fresh, model, forged)
    document = json.loads((stored / "record.json").read_text())
    document["record"]["noise_multiplier"] *= 10
    (stored / "record.json").write_text(json.dumps(document))
    _client(fresh).set_model_version_tag(
        model, forged, "dp.content_hash", candidate_content_hash(stored)
    )
    with pytest.raises(RecordIntegrityError, match="fails verification") as refused:
        _apply(fresh, _policy())
    assert f"dpmerge registry quarantine {model} {forged}" in str(refused.value)
    assert "registry sign" not in str(refused.value)
    assert not fresh.registry().model_exists(pool.merged_model)
    uri = ["--tracking-uri", fresh.tracking_uri]
    with pytest.raises(SystemExit) as no_sign:  # no laundering path: nothing re-signs a record
        main(["registry", "sign", model, forged, *uri])
    assert no_sign.value.code == 2 and "invalid choice: 'sign'" in capsys.readouterr().err
    assert main(["registry", "quarantine", model, forged, *uri]) == 0
    assert (fresh.home / "state" / "quarantine" / model / f"{int(forged):08d}.json").is_file()
    _client(fresh).set_model_version_tag(model, forged, "dp.status", "ready")  # an insider
    outcome = _apply(fresh, _policy())
    assert outcome.status == pm.Status.PROMOTED and forged not in _pool(fresh).versions


def test_an_unsigned_record_is_refused_until_quarantined(fresh: pm.Workspace) -> None:
    pool = _pool(fresh)
    model, version = pool.registered_model, pool.versions[1]
    _client(fresh).delete_model_version_tag(model, version, "dp.signature")
    with pytest.raises(RecordIntegrityError, match=r"unsigned.*quarantine.*retrain"):
        _apply(fresh, _policy())
    assert (
        main(["registry", "quarantine", model, version, "--tracking-uri", fresh.tracking_uri]) == 0
    )
    assert _apply(fresh, _policy()).status == pm.Status.PROMOTED


# --- sharp edges: fixed seeds, fingerprints ---------------------------------------------------


def test_fixed_seed_candidates_are_refused_and_their_seeds_never_published(
    tmp_path: Path, trained: dict[str, Any], capsys
) -> None:
    ws = _fresh(tmp_path, [*trained["dirs"], trained["seeded"]])
    pool = _pool(ws)
    seeded = max(pool.versions, key=int)
    version = _client(ws).get_model_version(pool.registered_model, seeded)
    run = _client(ws).get_run(version.run_id)
    published = json.dumps([version.tags, run.data.params, version.description])
    assert "noise-seed" not in published and "poisson-seed" not in published
    assert "lineage-hmac:" in published
    with pytest.raises(RefusalError, match=rf"fixed seed.*v{seeded} \(noise and batches\)"):
        _apply(ws, _policy())
    uri = ["--tracking-uri", ws.tracking_uri]
    assert main(["registry", "quarantine", pool.registered_model, seeded, *uri]) == 0
    assert _apply(ws, _policy()).status == pm.Status.PROMOTED


def test_nothing_published_carries_the_training_fingerprint(fresh: pm.Workspace) -> None:
    """Names, tags, params, the public merge record, the card and the dataset inputs carry the
    keyed identifier; the fingerprint (a membership oracle) appears nowhere; the evaluation
    split is still found by it."""
    fingerprint = load_dataset("digits").fingerprint
    secret = fingerprint.split("-sha256:")[1]
    outcome = _apply(fresh, _policy(method="rs", target_epsilon=3.0))
    assert outcome.status == pm.Status.PROMOTED and outcome.test_accuracy > 0.5
    client = _client(fresh)
    texts = []
    for model in client.search_registered_models():
        texts += [model.name, json.dumps(model.tags)]
        for version in _versions(fresh, model.name):
            run = client.get_run(version.run_id)
            inputs = [
                (d.dataset.name, d.dataset.digest, d.dataset.source)
                for d in run.inputs.dataset_inputs
            ]
            texts += [json.dumps([version.tags, version.description, run.data.params, inputs])]
    merged = _stored_dir(fresh, outcome.merged_model, outcome.version)
    texts += [(merged / name).read_text() for name in ("record.json", "privacy_card.json")]
    assert not [t for t in texts if secret in t]
    assert any(_pool(fresh).dataset in t for t in texts)


# --- what an MLflow writer changes is never trusted -------------------------------------------


def test_mlflow_tags_and_aliases_an_insider_sets_are_not_trusted(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """The facts a gate trusts come from the release-state store or a signature: an alias
    time tag set in the future freezes nothing (runs are ordered by stored policy versions),
    an alias moved by hand is found by `registry verify` and moved back by the next run."""
    first = _apply(fresh, _policy(target_epsilon=trained["epsilons"][2] * 1.5, method="lc"))
    client = _client(fresh)
    client.set_registered_model_tag(first.merged_model, "dp.alias_time.policy-p", "2999-01-01")
    later = _apply(fresh, _policy(target_epsilon=trained["epsilons"][1] * 1.05, method="rs"))
    assert later.status == pm.Status.PROMOTED and later.version != first.version
    assert _aliases(fresh, first.merged_model)["policy-p"] == later.version
    client.set_registered_model_alias(first.merged_model, "policy-p", first.version)  # by hand
    uri = ["--tracking-uri", fresh.tracking_uri]
    assert main(["registry", "verify", *uri]) == 1
    out = capsys.readouterr().out
    assert f"alias_drift: {first.merged_model}@policy-p" in out and "1 finding(s)" in out
    assert main(["registry", "show", f"{first.merged_model}@policy-p", *uri]) == 0
    assert f"serving pointer says v{later.version}" in capsys.readouterr().out
    assert main(["registry", "verify", "--repair", *uri]) == 1
    assert f"repaired: alias set back to v{later.version}" in capsys.readouterr().out
    assert _aliases(fresh, first.merged_model)["policy-p"] == later.version
    assert main(["registry", "verify", *uri]) == 0
    capsys.readouterr()


def test_swapped_served_weights_are_found_by_the_reconciler_and_refused_by_consumers(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """The served release's weights replaced in the artifact store by a candidate's (what a
    storage writer can do): `registry verify` reports the files mismatch, and a consumer's
    `dpmerge verify @ALIAS` — public key only — refuses the model; both pass before."""
    served = _apply(fresh, _policy(name="swap", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    assert main(["verify", "@policy-swap", *key, *uri]) == 0
    assert f"= {served.merged_model} v{served.version}" in capsys.readouterr().out
    assert main(["registry", "verify", *uri]) == 0
    capsys.readouterr()
    weights = _stored_dir(fresh, served.merged_model, served.version) / "weights.safetensors"
    candidate = _stored_dir(fresh, _pool(fresh).registered_model, "1") / "weights.safetensors"
    weights.write_bytes(candidate.read_bytes())
    assert main(["registry", "verify", *uri]) == 1
    out = capsys.readouterr().out
    assert f"files_mismatch: {served.merged_model}" in out
    assert main(["verify", "@policy-swap", *key, *uri]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "weights.safetensors" in err


# --- issue 28 item 3: a release is its files ---------------------------------------------------


def test_a_copy_of_a_served_releases_signed_tags_on_another_model_is_refused_on_reuse(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """Issue 28 row A, what the workflow's MLflow credential alone can do: a new version of
    the releases model whose files are a candidate's (a larger ε), with every tag (its
    signature included) and the card of the served release copied onto it, and the served
    one marked failed, so that a rerun finds the copy, whose signature alone verifies. The
    rerun refuses to reuse it (its files are not the model its manifest names) and the alias
    keeps the verified release; a consumer's verify refuses the copy too."""
    policy = _policy(name="bind", target_epsilon=trained["epsilons"][2] * 1.5)
    served = _apply(fresh, policy)
    assert served.status == pm.Status.PROMOTED
    name, client = served.merged_model, _client(fresh)
    candidate = client.get_model_version(_pool(fresh).registered_model, "1")  # the largest ε
    original = client.get_model_version(name, served.version)
    copy = client.create_model_version(
        name,
        source=candidate.source,
        run_id=original.run_id,
        tags=dict(original.tags),
        description=original.description,
    )
    forged = str(copy.version)
    client.set_model_version_tag(name, served.version, "dp.status", "failed")
    registry = fresh.registry()
    found = registry.find_ready_version(name, original.tags["dp.content_hash"])
    assert found is not None and found.version == forged and registry.signed(found)
    again = _apply(fresh, policy)
    assert (again.status, again.version, again.reused) == (pm.Status.REFUSED, forged, True)
    assert "reads its files from" in again.reasons[0] and "signed manifest" in again.reasons[0]
    assert f"quarantine {name} {forged}" in again.reasons[0]
    assert f"keeps v{served.version}, which meets the policy" in again.reasons[-1]
    assert (again.serving, again.serving_version) == ("serving", served.version)
    assert _aliases(fresh, name) == {"policy-bind": served.version}
    state = state_serving.read_state(fresh.state(), _pool(fresh).dataset)
    assert state.alias(name, "policy-bind").serving == served.version
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    assert main(["verify", f"models:/{name}/{forged}", *key, *uri]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "reads its files from" in err
    assert main(["verify", f"models:/{name}/{served.version}", *key, *uri]) == 0
    capsys.readouterr()
    client.set_model_version_tag(name, forged, "dp.status", "failed")
    client.set_model_version_tag(name, served.version, "dp.status", "ready")
    assert _apply(fresh, policy).status == pm.Status.UNCHANGED


def test_weights_swapped_under_the_served_release_are_refused_and_revoked_on_rerun(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    """Issue 28 row I: the served release's weights replaced in the artifact store. The rerun
    that would say "unchanged" refuses it and revokes the alias — even under
    ``on_noncompliant: keep`` (a release that is not its files is never kept) — and a later
    run that needs the alias refuses the same version again instead of serving it."""
    policy = _policy(
        name="swapped", target_epsilon=trained["epsilons"][2] * 1.5, on_noncompliant="keep"
    )
    served = _apply(fresh, policy)
    assert served.status == pm.Status.PROMOTED
    assert _apply(fresh, policy).status == pm.Status.UNCHANGED  # intact: a plain rerun
    weights = _stored_dir(fresh, served.merged_model, served.version) / "weights.safetensors"
    candidate = _stored_dir(fresh, _pool(fresh).registered_model, "1") / "weights.safetensors"
    weights.write_bytes(candidate.read_bytes())
    rerun = _apply(fresh, policy)
    assert (rerun.status, rerun.version) == (pm.Status.REFUSED, served.version)
    assert (
        "weights.safetensors" in rerun.reasons[0] and "differ from the signed" in rerun.reasons[0]
    )
    assert (rerun.serving, rerun.serving_version) == ("revoked", None)
    assert rerun.revoked_version == served.version and not rerun.compliant
    assert _aliases(fresh, served.merged_model) == {}
    pointer = state_serving.read_state(fresh.state(), _pool(fresh).dataset)
    assert pointer.alias(served.merged_model, "policy-swapped").serving is None
    again = _apply(fresh, policy)
    assert (again.status, again.serving_version) == (pm.Status.REFUSED, None)
    shutil.rmtree(weights.parent.parent)  # every file of the release gone: refused, no crash
    gone = _apply(fresh, policy)
    assert (gone.status, gone.serving_version) == (pm.Status.REFUSED, None), gone.reasons


def _model_signing_verify(directory: Path, public_pem: Path) -> subprocess.CompletedProcess:
    """OpenSSF's own verifier, as a consumer runs it on a downloaded release."""
    return subprocess.run(
        [
            *(sys.executable, "-m", "model_signing", "verify", "key", str(directory)),
            *("--signature", str(directory / model_signature.SIGNATURE_FILE)),
            *("--public_key", str(public_pem)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_release_verifies_with_openssf_model_signing_and_both_verifiers_refuse_a_change(
    fresh: pm.Workspace, trained: dict[str, Any], tmp_path: Path, capsys
) -> None:
    """Issue 28 item 3: a registered release directory (its card and record inside it) carries
    ``model.sig``, an OpenSSF model-signing bundle in key mode, under the P-256 key derived
    from the workflow's key: `python -m model_signing verify key` passes on the downloaded
    release beside `dpmerge verify`. A changed, an extra or a missing file in the artifact
    store is refused by both, naming the file."""
    served = _apply(fresh, _policy(name="oss", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    name, version, registry = served.merged_model, served.version, fresh.registry()
    pem = tmp_path / "release.pem"
    pem.write_bytes(model_signature.public_key_pem(fresh.workflow_key()))
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    manifest, downloaded = registry.verified_model(name, version, tmp_path / "ok", key[1])
    assert model_signature.SIGNATURE_FILE in manifest.files  # the Ed25519 manifest covers it
    assert {"extra_files/record.json", "extra_files/privacy_card.json"} <= manifest.files.keys()
    passed = _model_signing_verify(downloaded, pem)
    assert passed.returncode == 0, passed.stderr
    assert main(["verify", f"models:/{name}/{version}", *key, *uri]) == 0
    capsys.readouterr()
    other = tmp_path / "other.pem"
    other.write_bytes(model_signature.public_key_pem(WorkflowKey.generate()))
    assert _model_signing_verify(downloaded, other).returncode != 0  # another key
    stored = Path(urlparse(_client(fresh).get_model_version(name, version).source).path)
    card = stored / "extra_files" / "privacy_card.json"
    original = card.read_bytes()
    tampers = {
        "changed": lambda: card.write_bytes(original.replace(b'"epsilon"', b'"epsilon" ')),
        "extra": lambda: (stored / "extra_files" / "evil.json").write_text("{}"),
        "missing": card.unlink,
    }
    restores = {
        "changed": lambda: card.write_bytes(original),
        "extra": (stored / "extra_files" / "evil.json").unlink,
        "missing": lambda: card.write_bytes(original),
    }
    for kind, tamper in tampers.items():
        tamper()
        try:
            raw = registry.download_model(name, version, tmp_path / kind)
            refused = _model_signing_verify(raw, pem)
            code = main(["verify", f"models:/{name}/{version}", *key, *uri])
        finally:
            restores[kind]()
        out, err = capsys.readouterr()
        assert refused.returncode != 0, kind
        named = "evil.json" if kind == "extra" else "privacy_card.json"
        assert named in refused.stdout + refused.stderr, (kind, refused.stdout, refused.stderr)
        said = {"changed": "changed: ", "extra": "added: ", "missing": "missing: "}[kind]
        assert code == 2 and out == "" and f"{said}extra_files/{named}" in err, (kind, err)
    assert main(["verify", f"models:/{name}/{version}", *key, *uri]) == 0
    capsys.readouterr()


# --- issue 28 item 4: consumers verify what they serve -----------------------------------------


def test_a_forged_description_is_refused_by_consumers_and_found_by_the_reconciler(
    fresh: pm.Workspace,
    trained: dict[str, Any],
    tmp_path: Path,
    capsys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Row F: the workflow credential edits the served version's description (the card the MLflow
    UI shows) to claim a smaller ε. `dpmerge verify` derives the description from the signed
    card and refuses it in one line; `registry verify` reports the card; both pass once the
    signed description is back."""
    monkeypatch.delenv(manifests.PUBLIC_KEY_ENV, raising=False)
    served = _apply(fresh, _policy(name="card", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    name, version, client = served.merged_model, served.version, _client(fresh)
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    assert main(["verify", "@policy-card", *key, *uri]) == 0
    capsys.readouterr()
    signed = f"signed record (key {manifests.fingerprint(key[1])}): ε = "
    assert main(["registry", "show", "@policy-card", *key, *uri]) == 0
    out = capsys.readouterr().out
    assert signed in out and "the card below is the signed one" in out and "WARNING" not in out
    genuine = client.get_model_version(name, version).description
    forged = re.sub(r"ε = [0-9.]+", "ε = 0.01", genuine, count=1)
    assert forged != genuine
    client.update_model_version(name, version, description=forged)
    assert main(["verify", "@policy-card", *key, *uri]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "description" in err
    assert f"signed ε = {client.get_model_version(name, version).tags['dp.epsilon']})" in err
    assert main(["registry", "verify", *uri]) == 1
    assert f"card_mismatch: {name}" in capsys.readouterr().out
    assert main(["registry", "show", "@policy-card", *key, *uri]) == 0
    out = capsys.readouterr().out
    tag = client.get_model_version(name, version).tags["dp.epsilon"]
    assert f"{signed}{epsilon_text(float(tag))}," in out and "ε = 0.01" in out
    assert "WARNING: the description or the run's privacy_card.json differs" in out
    assert main(["registry", "show", "@policy-card", *uri]) == 0  # no key: nothing certified
    assert "signed record: not checked" in capsys.readouterr().out
    with pytest.raises(manifests.ReleaseSignatureError, match="description"):
        fresh.registry().load_verified(f"models:/{name}@policy-card", tmp_path / "load", key[1])
    client.update_model_version(name, version, description=genuine)
    assert main(["verify", "@policy-card", *key, *uri]) == 0
    assert fresh.registry().load_verified(f"models:/{name}@policy-card", tmp_path / "ok", key[1])
    assert main(["registry", "verify", *uri]) == 0
    capsys.readouterr()


def test_verify_download_leaves_exactly_the_verified_files_for_serving(
    fresh: pm.Workspace, trained: dict[str, Any], tmp_path: Path, capsys
) -> None:
    """Row H: `dpmerge verify --download DIR` leaves the verified model in DIR — every file's
    SHA-256 the signed manifest's — and prints `mlflow models serve -m DIR`, so nothing resolves
    the alias again: weights swapped in the store after the check do not reach DIR. Bad input
    (DIR not empty, not under a directory, not writable) and a refused release leave one line,
    exit 2 and nothing behind."""
    served = _apply(fresh, _policy(name="dl", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    name, version = served.merged_model, served.version
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    place = tmp_path / "place"
    place.mkdir()
    target = place / "served"
    assert main(["verify", "@policy-dl", "--download", str(target), *key, *uri]) == 0
    assert f"mlflow models serve -m {target} " in capsys.readouterr().out
    manifest, _ = fresh.registry().verified_model(name, version, tmp_path / "ref", key[1])

    def digests() -> dict[str, str]:
        found = manifests.file_digests(target)
        return {k: v for k, v in found.items() if k not in manifests.MLFLOW_BOOKKEEPING}

    assert digests() == manifest.files
    assert [p.name for p in place.iterdir()] == ["served"]  # no scratch left beside it
    weights = _stored_dir(fresh, name, version) / "weights.safetensors"
    candidate = _stored_dir(fresh, _pool(fresh).registered_model, "1") / "weights.safetensors"
    weights.write_bytes(candidate.read_bytes())  # a swap after the check
    assert digests() == manifest.files
    bad = {
        "not empty": target,
        "under a file": place / "served" / "MLmodel" / "x",
        "not writable": Path("/proc/dpmerge-verify-test"),
        "empty": "",  # the working directory: not empty
        "refused": place / "refused",  # the swapped weights
    }
    for why, where in bad.items():
        code = main(["verify", "@policy-dl", "--download", str(where), *key, *uri])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.count("\n") == 1, (why, err)
        assert sorted(p.name for p in place.iterdir()) == ["served"], why
        assert not Path("/proc/dpmerge-verify-test").exists()
    assert digests() == manifest.files


def test_serve_verifies_once_then_serves_exactly_the_verified_directory(
    fresh: pm.Workspace, trained: dict[str, Any], capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dpmerge serve @ALIAS` resolves the alias once, verifies into a private directory and
    starts `mlflow models serve -m DIR` on exactly those files (the server is replaced here by
    a recorder); a refused release starts nothing and leaves one line."""
    served = _apply(fresh, _policy(name="srv", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    name, version = served.merged_model, served.version
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    manifest, _ = fresh.registry().verified_model(name, version, fresh.home / "ref", key[1])
    resolved: list[str] = []
    resolve = Registry.resolve
    monkeypatch.setattr(Registry, "resolve", lambda self, u: resolved.append(u) or resolve(self, u))
    started: list[tuple[list[str], dict[str, str], int]] = []

    def server(command: list[str], env: dict[str, str]) -> int:
        directory = Path(command[command.index("-m") + 1])
        found = manifests.file_digests(directory)
        files = {k: v for k, v in found.items() if k not in manifests.MLFLOW_BOOKKEEPING}
        started.append((command, files, directory.parent.stat().st_mode & 0o777))
        return 0

    monkeypatch.setattr(subprocess, "call", server)
    assert main(["serve", "@policy-srv", "--port", "8123", *key, *uri]) == 0
    ((command, files, mode),) = started
    assert command[1:4] == ["models", "serve", "-m"] and "models:/" not in " ".join(command)
    assert command[5:] == ["--env-manager", "local", "--host", "127.0.0.1", "--port", "8123"]
    assert files == manifest.files and mode == 0o700
    assert resolved == [f"models:/{name}@policy-srv"]  # once
    assert not Path(command[4]).exists()  # removed when the server stopped
    assert f"serving models:/{name}@policy-srv = {name} v{version}" in capsys.readouterr().out
    _client(fresh).delete_registered_model_tag(name, STATEMENT_TAG + "policy-srv")
    assert main(["serve", "@policy-srv", *key, *uri]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no serving statement" in err
    assert main(["serve", "@policy-srv", "--port", "70000", *key, *uri]) == 2
    assert "not a TCP port" in capsys.readouterr().err
    assert len(started) == 1  # nothing started


# --- issue 28 item 4, row G: the signed serving statement --------------------------------------


def _verify_line(alias: str, key: list[str], uri: list[str], capsys) -> tuple[int, str]:
    code = main(["verify", alias, *key, *uri])
    out, err = capsys.readouterr()
    assert code == 0 or (out == "" and err.count("\n") == 1), err
    return code, err


def test_an_alias_moved_to_an_older_or_another_policys_release_is_refused_by_consumers(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """Row G: the workflow's MLflow credential moves `policy-eu` back to an older signed release
    of the same policy, or to another policy's release. Every release is signed, so only the
    workflow's serving statement tells them apart: `dpmerge verify @policy-eu` refuses both in
    one line naming the version the statement names; the explicit version still verifies;
    `verify-state`'s repair moves the alias back and re-issues the statement."""
    e2 = trained["epsilons"][2]
    older = _apply(fresh, _policy(name="eu", method="lc", target_epsilon=40.0))
    current = _apply(fresh, _policy(name="eu", method="rs", target_epsilon=e2 * 1.05))
    other = _apply(fresh, _policy(name="us", method="mixture", target_epsilon=40.0))
    assert {o.status for o in (older, current, other)} == {pm.Status.PROMOTED}
    assert len({older.version, current.version, other.version}) == 3
    assert older.epsilon > e2 * 1.05  # the older release does not meet eu's current target
    name = current.merged_model
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    assert _verify_line("@policy-eu", key, uri, capsys)[0] == 0
    client = _client(fresh)
    for moved in (older.version, other.version):
        client.set_registered_model_alias(name, "policy-eu", moved)
        code, err = _verify_line("@policy-eu", key, uri, capsys)
        assert code == 2
        assert f"the alias serves v{moved} but the workflow's statement (issued" in err
        assert f"names v{current.version} (policy 'eu'" in err
        with pytest.raises(ServingStatementError):
            fresh.registry().load_verified(f"models:/{name}@policy-eu", fresh.home / "l", key[1])
        assert _verify_line(f"models:/{name}/{moved}", key, uri, capsys)[0] == 0
    findings = verify_drift(fresh, repair=True)
    assert [f.kind for f in findings] == [FindingKind.ALIAS_DRIFT]
    assert _aliases(fresh, name)["policy-eu"] == current.version
    assert _verify_line("@policy-eu", key, uri, capsys)[0] == 0
    assert _verify_line("@policy-us", key, uri, capsys)[0] == 0


def test_a_serving_statement_expires_needs_the_release_key_and_is_reissued_by_verify_state(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """An expired statement (issued over its TTL ago: a frozen workflow), one signed with
    another key, one for another alias, or none at all is refused; `registry verify` reports a
    statement consumers refuse, and `verify-state` (repair) re-issues a valid one on every run,
    so consumers never see one expire while it runs."""
    served = _apply(fresh, _policy(name="ttl", target_epsilon=trained["epsilons"][2] * 1.5))
    assert served.status == pm.Status.PROMOTED
    name, tag = served.merged_model, STATEMENT_TAG + "policy-ttl"
    uri = ["--tracking-uri", fresh.tracking_uri]
    key = ["--public-key", manifests.public_key_hex(fresh.workflow_key())]
    record = state_serving.read_state(fresh.state(), _pool(fresh).dataset).alias(name, "policy-ttl")
    assert record is not None and record.serving == served.version
    registry, client = fresh.registry(), _client(fresh)
    now = datetime.now(UTC)
    publish(registry, record, now - serving_statement.TTL - serving_statement.SKEW / 2)
    assert _verify_line("@policy-ttl", key, uri, capsys)[0] == 0  # within the skew
    publish(registry, record, now - serving_statement.TTL - 2 * serving_statement.SKEW)
    code, err = _verify_line("@policy-ttl", key, uri, capsys)
    assert code == 2 and "expired at" in err
    issued = json.loads(client.get_registered_model(name).tags[tag])["statement"]
    assert json.loads(issued)["policy"] == "ttl"
    forged = serving_statement.issue(
        name, "policy-ttl", served.version, "ttl", 1, WorkflowKey.generate()
    )
    client.set_registered_model_tag(name, tag, forged)
    code, err = _verify_line("@policy-ttl", key, uri, capsys)
    assert code == 2 and "signature does not verify" in err
    elsewhere = serving_statement.issue(
        name, "policy-x", served.version, "ttl", 1, fresh.workflow_key()
    )
    client.set_registered_model_tag(name, tag, elsewhere)
    code, err = _verify_line("@policy-ttl", key, uri, capsys)
    assert code == 2 and f"is for {name}@policy-x" in err
    client.delete_registered_model_tag(name, tag)
    code, err = _verify_line("@policy-ttl", key, uri, capsys)
    assert code == 2 and "no serving statement" in err
    (found,) = verify_drift(fresh)  # the operator sees what consumers refuse
    assert (found.kind, found.repaired) == (FindingKind.SERVING_STATEMENT, None)
    assert "no serving statement" in found.detail
    (found,) = verify_drift(fresh, repair=True)
    assert found.kind == FindingKind.SERVING_STATEMENT and found.repaired
    assert verify_drift(fresh) == []
    assert verify_drift(fresh, repair=True) == []  # re-issued on every run, no finding
    value = client.get_registered_model(name).tags[tag]
    statement = serving_statement.check(
        value, key[1], model=name, alias="policy-ttl", version=served.version
    )
    assert datetime.fromisoformat(statement.issued) >= now.replace(microsecond=0)
    assert _verify_line("@policy-ttl", key, uri, capsys)[0] == 0


# --- item 3: alias ownership ------------------------------------------------------------------


def test_a_policy_cannot_touch_another_policys_alias(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    eu = _apply(fresh, _policy(name="eu", target_epsilon=trained["epsilons"][2] * 1.5))
    assert eu.status == pm.Status.PROMOTED
    calls: list[str] = []
    hijack = _store(fresh, _policy(name="evil", alias="policy-eu", target_epsilon=50.0))
    with pytest.raises(AliasOwnershipError, match="belongs to policy 'eu'"):
        pm.apply_policy(hijack, fresh, steps=_steps(calls))
    assert calls == ["prepare"]  # refused before anything was loaded or changed
    revoke = _policy(name="evil", alias="policy-eu", target_epsilon=trained["epsilons"][0] / 2)
    with pytest.raises(AliasOwnershipError):
        _apply(fresh, revoke)
    assert _aliases(fresh, eu.merged_model) == {"policy-eu": eu.version}
    # a stored policy keeps the alias it named; its own alias takes a policy of its own
    with pytest.raises(PolicyError, match="cannot become 'policy-evil'"):
        _store(fresh, _policy(name="evil", target_epsilon=50.0))
    own = _apply(fresh, _policy(name="own", target_epsilon=50.0, method="lc"))
    assert own.status == pm.Status.PROMOTED
    assert _aliases(fresh, eu.merged_model) == {"policy-eu": eu.version, "policy-own": own.version}
    state = state_serving.read_state(fresh.state(), _pool(fresh).dataset)
    assert state.alias(eu.merged_model, "policy-own").owner == "own"


# --- a damaged, edited or rolled-back ledger ------------------------------------------------


def test_a_damaged_or_edited_ledger_fails_closed_and_is_restored(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """The dataset document (ledger and serving pointers) is signed: unreadable or edited —
    e.g. a field renamed so a cap no longer sees a release — it fails closed naming the
    repair, and `dpmerge state restore` brings back its newest signed version."""
    target = trained["epsilons"][2] * 1.5
    first = _apply(fresh, _policy(target_epsilon=target, method="lc"))
    assert first.status == pm.Status.PROMOTED
    document = _state_file(fresh)
    saved = document.read_bytes()
    capped = _policy(target_epsilon=target * 3, method="rs", cumulative_epsilon_cap=100.0)
    edited = json.loads(saved)
    edited["releases"][0]["dataset"] = "someone-else"
    for damage in (b"", b"{not json", json.dumps(edited).encode()):
        document.write_bytes(damage)
        with pytest.raises(StateIntegrityError, match=r"state restore"):
            _apply(fresh, capped)
    assert len(_versions(fresh, first.merged_model)) == 1  # nothing merged or registered
    uri = ["--tracking-uri", fresh.tracking_uri]
    assert main(["state", "restore", *uri]) == 0
    assert "restored the newest signed version" in capsys.readouterr().out
    assert json.loads(document.read_bytes())["releases"] == json.loads(saved)["releases"]
    assert _apply(fresh, capped).status == pm.Status.PROMOTED


def test_a_rolled_back_ledger_fails_closed_and_is_rebuilt(
    fresh: pm.Workspace, trained: dict[str, Any], capsys
) -> None:
    """A ledger replaced by an older signed version (or lost) lacks a release MLflow holds a
    signed version of: refused with the repair; `dpmerge ledger rebuild` counts it again."""
    target = trained["epsilons"][2] * 1.5
    first = _apply(fresh, _policy(target_epsilon=target, method="lc"))
    _state_file(fresh).unlink()  # lost: not an empty ledger
    capped = _policy(target_epsilon=target * 3, method="rs", cumulative_epsilon_cap=100.0)
    with pytest.raises(pm.LedgerIntegrityError, match=r"lacks 1 published.*ledger rebuild"):
        _apply(fresh, capped)
    assert len(_versions(fresh, first.merged_model)) == 1
    assert main(["ledger", "rebuild", "--tracking-uri", fresh.tracking_uri]) == 0
    assert "1 release(s) added back" in capsys.readouterr().out
    assert _apply(fresh, capped).status == pm.Status.PROMOTED


def test_a_changed_record_of_a_released_candidate_is_named(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    """The ledger pins the records it counted: a same-named candidate with another record is
    refused with the repair, not left to an accountant error that needs hand surgery."""
    first = _apply(fresh, _policy(target_epsilon=trained["epsilons"][2] * 1.5, method="lc"))
    store = fresh.state()
    key = dataset_key(_pool(fresh).dataset)
    document = store.read(key).document
    counted = document["releases"][0]["candidates"][0]
    counted["clip_norm"] *= 2
    _state_file(fresh).write_text(json.dumps(store.sign(document)))  # signed: the workflow's
    with pytest.raises(StateIntegrityError, match=rf"{counted['name']}.*registry quarantine"):
        _apply(fresh, _policy(target_epsilon=50.0, method="rs"))
    assert len(_versions(fresh, first.merged_model)) == 1


# --- items 6 and 8: one draw per release, gates before side effects ----------------------------


def _count_draws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    drawn: list[int] = []
    real = draws.draw_index

    def counted(probabilities: Any) -> int:
        drawn.append(real(probabilities))
        return drawn[-1]

    monkeypatch.setattr(draws, "draw_index", counted)
    return drawn


def test_a_retried_rs_release_draws_once(
    fresh: pm.Workspace, trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry after a crash past the merge uses the stored RS draw and publishes the stored
    test-accuracy estimate: neither is drawn again (docs/design.md#row-protection)."""
    drawn = _count_draws(monkeypatch)
    estimates: list[Any] = []
    real = draws.private_accuracy

    def estimated(*args: Any) -> Any:
        estimates.append(real(*args))
        return estimates[-1]

    monkeypatch.setattr(draws, "private_accuracy", estimated)
    policy = _policy(target_epsilon=trained["epsilons"][1] * 1.05, method="rs")

    def crash(*args: Any) -> Any:
        raise ConnectionError("MLflow went away after the merge")

    with pytest.raises(ConnectionError):
        _apply(fresh, policy, register=crash)
    outcome = _apply(fresh, policy)  # the re-run of the same request
    assert outcome.status == pm.Status.PROMOTED and len(drawn) == 1
    audit = _audit_files(fresh, outcome_hash(fresh, outcome))
    assert json.loads(audit[0].read_text())["drawn_index"] == drawn[0]
    assert len(estimates) == 1 and outcome.test_accuracy == estimates[0].value
    assert json.loads(audit[1].read_text())["metrics"] == estimates[0].metrics()


def _audit_files(ws: pm.Workspace, release: str) -> list[Path]:
    """The release's two audit records, the RS draw first; any other is another release's
    accuracy estimate (an LC warm-up's), never a second RS draw."""
    audit = sorted((ws.home / "audit").glob("*.json"))
    mine = [a for a in audit if a.name.startswith(release)]
    assert [a.name for a in mine] == [f"{release}.json", f"{release}.test-accuracy.json"]
    assert all(a.name.endswith(".test-accuracy.json") for a in audit if a not in mine)
    return mine


def outcome_hash(ws: pm.Workspace, outcome: Any) -> str:
    return (
        _client(ws).get_model_version(outcome.merged_model, outcome.version).tags["dp.content_hash"]
    )


def test_concurrent_runs_of_one_rs_release_use_one_draw_and_register_once(
    fresh: pm.Workspace, trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two policies whose calibration gives the same RS merge, applied at once. The race is
    forced: each run draws before either stores (the draw waits for the other run's draw), so
    both find no stored draw, and the two draws differ. One record is stored first; the other
    run's draw is discarded unused — one version, built from the stored index, serves both."""
    drawn: list[int] = []
    drawing = threading.Lock()
    both_drawn = threading.Barrier(2, timeout=120)

    def racing(probabilities: Any) -> int:
        assert len(probabilities) >= 2
        with drawing:  # the two runs draw different candidates: 0, then 1
            index = len(drawn)
            drawn.append(index)
        both_drawn.wait()
        return index

    used: list[int] = []
    real_stored = release_step.stored_draw

    def recorded(*args: Any) -> int:
        used.append(real_stored(*args))
        return used[-1]

    target = trained["epsilons"][1] * 1.05
    _apply(fresh, _policy(name="warm", target_epsilon=target, method="lc"))  # export warmed
    monkeypatch.setattr(draws, "draw_index", racing)
    monkeypatch.setattr(release_step, "stored_draw", recorded)
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        results[name] = _apply(fresh, _policy(name=name, target_epsilon=target, method="rs"))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {r.status for r in results.values()} == {pm.Status.PROMOTED} and drawn == [0, 1]
    assert results["one"].version == results["two"].version
    versions = _versions(fresh, results["one"].merged_model)
    assert len([v for v in versions if v.tags["dp.status"] == "ready"]) == 2  # LC warm-up + RS
    audit = _audit_files(fresh, outcome_hash(fresh, results["one"]))
    stored = json.loads(audit[0].read_text())["drawn_index"]
    assert stored in drawn and used == [stored, stored]  # both merges used the stored draw


def test_a_cap_refusal_merges_draws_and_registers_nothing(
    fresh: pm.Workspace, trained: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = _count_draws(monkeypatch)
    calls: list[str] = []
    policy = _policy(
        method="rs", target_epsilon=trained["epsilons"][1] * 1.05, cumulative_epsilon_cap=0.01
    )
    outcome = pm.apply_policy(_store(fresh, policy), fresh, steps=_steps(calls)).outcome
    assert outcome.status == pm.Status.NOT_PROMOTED and "above the cap 0.01" in outcome.reasons[0]
    assert calls == ["prepare", "calibrate", "plan_release", "enforce", "project"]
    assert drawn == []
    assert not fresh.registry().model_exists(outcome.merged_model)
    assert not list((fresh.home / "audit").glob("*.json"))


# --- issue 10 item 6: one version per release -------------------------------------------------


def test_two_targets_with_one_merge_share_one_version_and_say_why(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    first = _apply(fresh, _policy(name="a", target_epsilon=40.0, method="lc"))
    second = _apply(fresh, _policy(name="b", target_epsilon=80.0, method="lc"))
    assert (first.status, second.status) == (pm.Status.PROMOTED, pm.Status.PROMOTED)
    assert second.reused and second.version == first.version
    assert len(_versions(fresh, first.merged_model)) == 1
    for outcome, target in ((first, 40), (second, 80)):
        (note,) = outcome.notes
        assert f"of the target ε* = {target}" in note and "peaks at ε =" in note
    card = fresh.registry().card_text(first.merged_model, first.version)
    assert "peaks at ε =" in card


# --- item 10: an abandoned registration -------------------------------------------------------


def test_a_version_left_registering_by_a_dead_process_is_marked_failed(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    pool = _pool(fresh)
    registry = fresh.registry()
    policy = _policy(target_epsilon=trained["epsilons"][2] * 1.5, method="lc")
    dead = subprocess.Popen(["true"])  # a process that is gone
    dead.wait()
    orphan = {}

    def crash_while_registering(ws: pm.Workspace, request: Any, release: Any, ledger: Any) -> Any:
        client = _client(ws)
        client.create_registered_model(pool.merged_model)
        version = client.create_model_version(
            pool.merged_model,
            source=str(release.path),
            tags={
                "dp.role": "merged",
                "dp.content_hash": request.content_hash,
                "dp.status": "registering",
                "dp.registering_by": f"{socket.gethostname()}:{dead.pid}",
            },
        )
        orphan["version"] = version.version
        raise KeyboardInterrupt  # the process dies mid-registration

    with pytest.raises(KeyboardInterrupt):
        _apply(fresh, policy, register=crash_while_registering)
    outcome = _apply(fresh, policy)
    assert outcome.status == pm.Status.PROMOTED and outcome.version != orphan["version"]
    tags = registry.get_version(pool.merged_model, orphan["version"]).tags
    assert tags["dp.status"] == "failed" and "abandoned" in tags["dp.failure"]


# --- issue 10 item 7: MLflow the way its users expect ------------------------------------------


def test_runs_show_privacy_metrics_dataset_timing_and_names(fresh: pm.Workspace, trained) -> None:
    outcome = _apply(fresh, _policy(name="eu", target_epsilon=trained["epsilons"][2] * 1.5))
    client = _client(fresh)
    pool = _pool(fresh)
    candidate = client.get_model_version(pool.registered_model, pool.versions[0])
    merged = client.get_model_version(outcome.merged_model, outcome.version)
    experiments = {}
    for version, name in ((candidate, "dpmerge-candidates"), (merged, "dpmerge-releases")):
        run = client.get_run(version.run_id)
        experiment = client.get_experiment(run.info.experiment_id)
        assert experiment.name == name and experiment.artifact_location.endswith(name.split("-")[1])
        experiments[name] = experiment.artifact_location
        metrics = run.data.metrics
        assert metrics["epsilon"] == float(version.tags["dp.epsilon"]) and metrics["delta"] == DELTA
        assert {"epsilon_pld", "epsilon_rdp", "test_accuracy"} <= set(metrics)
        (data_input,) = run.inputs.dataset_inputs
        assert data_input.dataset.name == "digits"
        assert data_input.dataset.digest == pool.dataset.split(":")[-1][:32]
    assert len(set(experiments.values())) == 2  # two artifact prefixes
    candidate_run = client.get_run(candidate.run_id)
    record = json.loads((trained["dirs"][0] / "metrics.json").read_text())
    duration_s = (candidate_run.info.end_time - candidate_run.info.start_time) / 1000
    assert candidate_run.info.run_name == "train σ=1"
    assert abs(duration_s - record["train_seconds"]) < 0.01
    curve = client.get_metric_history(candidate.run_id, "validation_accuracy")
    assert [m.step for m in curve] == list(range(1, len(record["history"]) + 1))
    assert [m.value for m in curve] == [e["validation_accuracy"] for e in record["history"]]
    merge_run = client.get_run(merged.run_id)
    assert merge_run.info.run_name == f"policy-eu ε*={outcome.target_epsilon:g}"
    assert "epsilon_generic" in merge_run.data.metrics
    assert "**Accuracy** of this model: test" in merged.description


def test_bad_inputs_to_the_repair_commands_change_nothing(
    fresh: pm.Workspace, tmp_path: Path, capsys
) -> None:
    pool = _pool(fresh)
    uri = ["--tracking-uri", fresh.tracking_uri]
    before = [(v.version, v.tags) for v in _versions(fresh, pool.registered_model)]
    bad = [
        ["registry", "quarantine", pool.registered_model, "abc", *uri],
        ["registry", "quarantine", pool.registered_model, "0", *uri],
        ["registry", "quarantine", pool.registered_model, "-1", *uri],
        ["registry", "quarantine", pool.registered_model, "99", *uri],
        ["registry", "quarantine", "no-such-model", "1", *uri],
        ["registry", "quarantine", pool.registered_model, *uri],
        ["registry", "quarantine", pool.registered_model, "x" * 5000, *uri],
        ["ledger", "rebuild", "--tracking-uri", f"sqlite:///{tmp_path / 'nowhere' / 'm.db'}"],
        ["ledger", "rebuild", "--bogus"],
        ["state", "restore", "--tracking-uri", f"sqlite:///{tmp_path / 'nowhere' / 'm.db'}"],
        ["state", "bogus"],
    ]
    accepted = []
    for argv in bad:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        if code != 2 or len(err.strip().splitlines()) != 1 or len(err) > 400:
            accepted.append((argv, code, err[-300:]))
    assert accepted == []
    assert [(v.version, v.tags) for v in _versions(fresh, pool.registered_model)] == before
    assert not (tmp_path / "nowhere").exists()


# --- issue 28: operators' writes are untrusted input (rows E, K) -----------------------------


def test_a_bad_quarantine_object_is_a_finding_and_merges_go_on(
    fresh: pm.Workspace, trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Row E: objects under quarantine/ that are no quarantine record (a key of another shape,
    a body nested 40,000 deep) never fail a merge run; they are `registry verify` findings."""
    model = _pool(fresh).registered_model
    store = fresh.state()
    bad = [f"quarantine/{model}/evil.json", f"quarantine/{model}/00000001.json"]
    store.backend.create(bad[0], b'{"reason": "veto"}')
    store.backend.create(bad[1], b"[" * 40_000 + b"]" * 40_000)
    outcome = _apply(fresh, _policy(name="e", target_epsilon=trained["epsilons"][2] * 1.5))
    assert outcome.status == pm.Status.PROMOTED, outcome.reasons
    uri = ["--tracking-uri", fresh.tracking_uri]
    capsys.readouterr()
    assert main(["registry", "verify", "--json", *uri]) == 1
    out, err = capsys.readouterr()
    findings = json.loads(out)["findings"]
    rejected = {f["subject"]: f["detail"] for f in findings if f["kind"] == "request_rejected"}
    assert sorted(rejected) == sorted(bad) and "Traceback" not in err
    assert "field 'key'" in rejected[bad[0]] and "field 'body'" in rejected[bad[1]]


def test_policy_set_refuses_what_a_run_would_before_storing(
    fresh: pm.Workspace, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row K: δ* ≥ 1/n of the ready candidates' dataset, and a number spelt `1_0` (Python's
    float reads 10), are refused in one line, exit 2, nothing stored."""
    from flows import runtime
    from flows.cli import main as dpmerge_main

    monkeypatch.setattr(runtime, "configure_embedded", lambda *args, **kwargs: {})
    base = ["policy", "set", "--name", "k", "--dataset", "digits", "--home", str(fresh.home)]
    refused = {
        "1/n = ": ["--target-epsilon", "5", "--delta", "0.5"],  # n = the digits training rows
        "'1_0'": ["--target-epsilon", "1_0", "--delta", str(DELTA)],
    }
    for said, given in refused.items():
        try:
            code = dpmerge_main([*base, *given])
        except SystemExit as exited:  # argparse refuses an option's value this way
            code = exited.code
        assert code == 2
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and said in err, err
        assert "Traceback" not in out + err
    assert not (fresh.home / "state" / "policies").exists()


# --- issue 28 row J: a served release resting on a quarantined candidate ---------------------


def _serve_one_candidate(ws: pm.Workspace, trained: dict[str, Any], name: str) -> Any:
    """A policy whose target only the lowest-ε candidate meets alone (LC), kept on purpose when
    non-compliant; served. Its outcome and the served release's parents."""
    policy = _policy(
        name=name, method="lc", target_epsilon=trained["epsilons"][0] * 1.05, on_noncompliant="keep"
    )
    served = _apply(ws, policy)
    assert served.status == pm.Status.PROMOTED, served.reasons
    state = state_serving.read_state(ws.state(), _pool(ws).dataset)
    alias = state.alias(served.merged_model, f"policy-{name}")
    parents = state.entry(alias.release).parents()
    assert [m for m, _ in parents] == [_pool(ws).registered_model]
    return policy, served, parents[0]


def test_a_run_never_keeps_a_release_whose_candidate_is_quarantined(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    """Row J: the only candidate that meets the target is quarantined; the rerun finds the
    target infeasible, and the alias is revoked instead of "keeps v1, which meets the policy"
    — even under ``on_noncompliant: keep``."""
    policy, served, (model, version) = _serve_one_candidate(fresh, trained, "j")
    uri = ["--tracking-uri", fresh.tracking_uri]
    assert main(["registry", "quarantine", model, version, *uri]) == 0
    rerun = _apply(fresh, policy)
    assert rerun.status == pm.Status.INFEASIBLE, rerun.reasons
    assert (rerun.serving, rerun.serving_version) == ("revoked", None)
    assert rerun.revoked_version == served.version
    assert any(f"its candidate {model} v{version} is quarantined" in r for r in rerun.reasons)
    assert _aliases(fresh, served.merged_model) == {}


def test_a_served_release_on_a_quarantined_candidate_is_revoked_by_verify_repair(
    fresh: pm.Workspace, trained: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """Row J on the reconciler: the quarantine is requested through the inbox and recorded as
    the dispatcher records it; deleting the request and flipping MLflow's tag back undo
    nothing: `registry verify --repair` sets the tag back, revokes the alias and reports both."""
    from dpmerge.state import inbox
    from dpmerge.state.quarantine import quarantined

    _, served, (model, version) = _serve_one_candidate(fresh, trained, "jv")
    store = fresh.state()
    key = inbox.submit_quarantine(store, model, version, "row J")
    assert inbox.handle(store, key).rejection is None
    (fresh.home / "state" / key).unlink()  # the operator deletes the request
    _client(fresh).set_model_version_tag(model, version, "dp.status", "ready")  # and flips
    assert version in quarantined(store, model)
    uri = ["--tracking-uri", fresh.tracking_uri]
    capsys.readouterr()
    assert main(["registry", "verify", "--repair", "--json", *uri]) == 1
    out, err = capsys.readouterr()
    findings = {f["kind"]: f for f in json.loads(out)["findings"]}
    assert findings["quarantine_drift"]["repaired"] == "tag set back to quarantined"
    found = findings["quarantined_parent"]
    assert f"its candidate {model} v{version} is quarantined" in found["detail"]
    assert found["repaired"].startswith("alias 'policy-jv' revoked") and "Traceback" not in err
    assert _client(fresh).get_model_version(model, version).tags["dp.status"] == "quarantined"
    assert _aliases(fresh, served.merged_model) == {}
    pointer = state_serving.read_state(store, _pool(fresh).dataset)
    assert pointer.alias(served.merged_model, "policy-jv").state.value == "revoked"
    assert main(["registry", "verify", "--json", *uri]) == 0  # nothing left to find


# --- issue 28 item 2: a run that ended without an outcome ------------------------------------


def test_after_a_lost_run_the_alias_is_made_to_meet_its_version(
    fresh: pm.Workspace, trained: dict[str, Any]
) -> None:
    """What the dispatcher does for a version whose run ended Failed, Crashed or Cancelled
    without an outcome (``promotion.hold``): the served release does not meet the tightened
    version, so the alias is flagged under ``on_noncompliant: keep``, else revoked, with the
    reason on the pointer; a policy that serves nothing is left as it is."""
    from dpmerge.policy_merge.promotion import hold

    target = trained["epsilons"][2] * 1.5
    served = _apply(fresh, _policy(name="lost", target_epsilon=target))
    assert served.status == pm.Status.PROMOTED
    lost = "its run r-1 ended Crashed without an outcome"
    tight = {"name": "lost", "target_epsilon": target, "min_accuracy": 0.999}
    kept = hold(fresh, _store(fresh, _policy(**tight, on_noncompliant="keep")), (lost,), "r-1")
    assert kept.startswith("alias 'policy-lost' KEEPS v") and "below 0.999" in kept
    assert _aliases(fresh, served.merged_model)["policy-lost"] == served.version
    tags = _client(fresh).get_registered_model(served.merged_model).tags
    assert tags["dpmerge.serves.policy-lost"].startswith("NON-COMPLIANT")
    revoked = hold(fresh, _store(fresh, _policy(**tight)), (lost,), "r-2")
    assert revoked.startswith(f"alias 'policy-lost' revoked (was v{served.version}: ")
    assert "below 0.999" in revoked
    assert "policy-lost" not in _aliases(fresh, served.merged_model)
    pointer = state_serving.read_state(fresh.state(), _pool(fresh).dataset)
    alias = pointer.alias(served.merged_model, "policy-lost")
    assert (alias.state.value, alias.run) == ("revoked", "r-2") and lost in alias.reason
    never = _store(fresh, _policy(name="never-served", target_epsilon=target))
    assert (
        hold(fresh, never, (lost,), "r-3") == "alias 'policy-never-served' serves nothing (not set)"
    )
