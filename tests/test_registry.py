"""The MLflow registry adapter against a real MLflow server (S3 artifacts on the local store)
and against an embedded sqlite store: registration, privacy card, gates (the card against the tags),
idempotency, RS secrecy, search quoting, and which failures are transient."""

from __future__ import annotations

import json
import random
import sqlite3
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlflow
import pytest
import requests
import torch
from factories import make_record, synthetic_candidates
from mlflow import MlflowClient
from safetensors.torch import load_file

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelSpec, save_model_dir
from dpmerge.cli import main
from dpmerge.errors import is_transient
from dpmerge.exits import exit_code
from dpmerge.keys import WorkflowKey
from dpmerge.manifests import ReleaseSignatureError, file_digests
from dpmerge.merging import merge_model_dirs
from dpmerge.policies import Policy
from dpmerge.publication import dataset_id, lineage_id
from dpmerge.registry import (
    CARD_JSON,
    CARD_MARKDOWN,
    STATUS_FAILED,
    GateError,
    RegisteredVersion,
    Registry,
    RegistryError,
    RegistryFailureError,
    RegistryUnavailableError,
    candidate_model_name,
    merged_model_name,
)
from dpmerge.registry.catalog import open_catalog
from dpmerge.registry.errors import registry_error
from dpmerge.registry.filters import search_filter
from dpmerge.registry.shown_card import check_shown_card
from dpmerge.storage import S3Store
from dpmerge.vocabulary import CardCheck, ExitCode

DELTA = 1e-5
DATASET = "toy-sha256:0123456789abcdef0123"
SPEC = ModelSpec("logreg", (1, 4, 4), 3)
KEY = WorkflowKey.from_env()  # the session's key (tests/conftest.py)
PUBLIC_DATASET = dataset_id(DATASET, KEY)
CANDIDATES = candidate_model_name(PUBLIC_DATASET, "logreg")
MERGED = merged_model_name(PUBLIC_DATASET, "logreg")
POLICY = {"id": "policy-1", "target_epsilon": 5.0, "target_delta": DELTA}
SIGMAS = {"cand-a": 1.0, "cand-b": 1.5, "cand-c": 2.0}


def _record(name: str, sigma: float) -> MechanismRecord:
    return make_record(
        name, sigma, steps=100, sample_rate=0.01, learning_rate=0.5, batch=100.0, dataset=DATASET
    )


@pytest.fixture(scope="module")
def candidate_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return synthetic_candidates(tmp_path_factory.mktemp("candidates"), SIGMAS, DATASET)


def _merge(
    dirs: Sequence[Path], method: str, weights: Sequence[float], out: Path, **kw: Any
) -> Path:
    return merge_model_dirs(dirs, method, weights, out, delta=DELTA, **kw).path


def _accuracy(accuracy: float) -> Any:
    return lambda spec, weights: {"test_accuracy": accuracy, "test_loss": 0.5}


@pytest.fixture(scope="module")
def server_registry(mlflow_server: str) -> Registry:
    return Registry(mlflow_server)


@pytest.fixture(scope="module")
def registered(server_registry: Registry, candidate_dirs: list[Path]) -> list[str]:
    return [server_registry.register_candidate(d).version for d in candidate_dirs]


@pytest.mark.integration
def test_rest_catalog_reads_what_the_client_reads(
    server_registry: Registry, registered: list[str]
) -> None:
    catalog = open_catalog(server_registry.tracking_uri)
    assert catalog.rows() == server_registry.list_versions() != []
    assert catalog.detail(CANDIDATES, registered[0]).stored.tags["dp.role"] == "candidate"
    assert catalog.aliases("dpmerge-no-such-model") == {}
    inventory = catalog.inventory()
    assert inventory.counts[(PUBLIC_DATASET, "logreg")] >= len(registered)


@pytest.mark.integration
def test_candidates_registered_with_tags_and_artifacts_in_s3(
    server_registry: Registry,
    registered: list[str],
    candidate_dirs: list[Path],
    s3_store: S3Store,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    client = MlflowClient(server_registry.tracking_uri)
    for version, path in zip(registered, candidate_dirs, strict=True):
        tags = client.get_model_version(CANDIDATES, version).tags
        record = _record(path.name, SIGMAS[path.name])
        bound = candidate_bound(record, DELTA)
        assert tags["dp.role"] == "candidate" and tags["dp.status"] == "ready"
        assert float(tags["dp.epsilon"]) == bound.epsilon
        assert (tags["dp.delta"], tags["dp.accountant"]) == (repr(DELTA), bound.accountant)
        assert float(tags["dp.noise_multiplier"]) == record.noise_multiplier
        assert (tags["dp.sample_rate"], tags["dp.steps"]) == ("0.01", "100")
        public = (PUBLIC_DATASET, lineage_id(record.noise_lineage, KEY))
        assert (tags["dp.dataset"], tags["dp.noise_lineage"]) == public
        assert len(tags["dp.content_hash"]) == 64
        assert tags["dp.accuracy_metric"] == "test_accuracy"
    again = server_registry.register_candidate(candidate_dirs[0])
    assert again.reused and again.version == registered[0]
    experiment = MlflowClient(server_registry.tracking_uri).get_experiment_by_name(
        "dpmerge-candidates"
    )
    assert experiment.artifact_location == f"mlflow-artifacts:/{experiment.experiment_id}"
    keys = s3_store.list_keys(f"mlartifacts/{experiment.experiment_id}/")  # the candidates' own
    assert any(k.endswith("/extra_files/weights.safetensors") for k in keys)
    assert any(k.endswith("/data/model.pt2") for k in keys)
    loaded = server_registry.load_candidates(CANDIDATES, registered, dest=tmp_path / "dl")
    assert [c.version for c in loaded] == sorted(registered, key=int)
    for item, path in zip(loaded, candidate_dirs, strict=True):
        assert item.model_dir.record == _record(path.name, SIGMAS[path.name])
        expected = load_file(str(path / "weights.safetensors"))
        assert all(torch.equal(item.model_dir.weights[k], v) for k, v in expected.items())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server_registry.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{CANDIDATES}/{registered[0]}")
    assert model(torch.zeros(7, 1, 4, 4)).shape == (7, 3)  # dynamic batch dimension


def _gates(**given: float) -> dict[str, float]:
    return {"target_epsilon": 5.0, "target_delta": DELTA, "min_accuracy": 0.0, **given}


@pytest.mark.integration
def test_merged_version_card_gates_and_alias(
    server_registry: Registry,
    registered: list[str],
    candidate_dirs: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server_registry.tracking_uri)
    merged = _merge(candidate_dirs, "lc", [0.2, 0.3, 0.5], tmp_path / "lc", metrics=_accuracy(0.8))
    result = _register(server_registry, merged, registered, POLICY)
    client = MlflowClient(server_registry.tracking_uri)
    version = client.get_model_version(MERGED, result.version)
    report = json.loads((merged / "privacy.json").read_text())
    tags = version.tags
    assert tags["dp.role"] == "merged" and tags["dp.method"] == "lc"
    # the candidates and weights are internal: on the release's internal record only
    assert not {"dp.weights", "dp.parents", "dp.parent_model"} & set(tags)
    internal = server_registry.prepare_merged(merged, parents=registered, policy=POLICY).internal()
    assert internal["merge"]["weights"] == [0.2, 0.3, 0.5]
    assert internal["parents"] == registered and internal["release"] == result.content_hash
    assert tags["dp.gating_bound"] == "generic"
    assert float(tags["dp.epsilon"]) == report["epsilon"]
    assert float(tags["dp.generic_epsilon"]) == report["bounds"]["generic"]["epsilon"]
    assert tags["dp.accountant"] == report["accountant"] and tags["dp.status"] == "ready"
    assert version.description.startswith("# Privacy card")
    card = json.loads(mlflow.artifacts.load_text(f"runs:/{version.run_id}/{CARD_JSON}"))
    assert card["guarantee"]["epsilon"] == report["epsilon"]
    markdown = mlflow.artifacts.load_text(f"runs:/{version.run_id}/{CARD_MARKDOWN}")
    assert "structured (the DP model merging paper's analysis)" in markdown
    catalog = open_catalog(server_registry.tracking_uri)  # the server's get-artifact route
    assert catalog.run_card(version.run_id) == card
    detail = catalog.detail(MERGED, result.version)
    shown = check_shown_card(catalog, detail, server_registry.public_key)
    assert shown.check == CardCheck.SIGNED and shown.facts["dp.epsilon"] == tags["dp.epsilon"]

    # idempotent: the same request reuses the version
    again = _register(server_registry, merged, registered, POLICY)
    assert again.reused and again.version == result.version

    # the gates read the version's signed facts and change nothing
    with pytest.raises(GateError, match="exceeds the target"):
        server_registry.check_gates(MERGED, result.version, **_gates(target_epsilon=0.01))
    with pytest.raises(GateError, match="below the minimum"):
        server_registry.check_gates(MERGED, result.version, **_gates(min_accuracy=0.9))
    facts = server_registry.check_gates(MERGED, result.version, **_gates(min_accuracy=0.75))
    assert (facts.epsilon, facts.accuracy) == (report["epsilon"], 0.8)
    assert server_registry.set_alias(MERGED, "production", result.version) is None
    assert client.get_registered_model(MERGED).aliases["production"] == result.version
    assert server_registry.set_alias(MERGED, "production", result.version) == result.version

    # a candidate is never released: signed too, but not a merged version
    with pytest.raises(GateError, match="only merged versions"):
        server_registry.check_gates(CANDIDATES, registered[0], **_gates(target_epsilon=99.0))

    # a version that failed after creation is marked and never aliased; a re-run registers anew
    class FailingVerify(Registry):
        def _verify(self, *args: Any, **kwargs: Any) -> None:
            raise RegistryError("injected failure after the version was created")

    other_policy = {**POLICY, "id": "policy-2"}
    another = _merge(
        candidate_dirs, "lc", [0.3, 0.3, 0.4], tmp_path / "lc2", metrics=_accuracy(0.8)
    )
    with pytest.raises(RegistryError, match="injected"):
        _register(FailingVerify(server_registry.tracking_uri), another, registered, other_policy)
    failed = max(client.search_model_versions(f"name = '{MERGED}'"), key=lambda v: int(v.version))
    assert failed.tags["dp.status"] == STATUS_FAILED
    with pytest.raises(GateError, match=r"dp\.status is 'failed'"):
        server_registry.check_gates(MERGED, failed.version, **_gates())
    assert client.get_registered_model(MERGED).aliases["production"] == result.version
    rerun = _register(server_registry, another, registered, other_policy)
    assert not rerun.reused and int(rerun.version) > int(failed.version)
    # another policy asking for the same merge gets the same release (the key is the release)
    shared = _register(server_registry, merged, registered, other_policy)
    assert shared.reused and shared.version == result.version

    # removing the alias (a revoked serving pointer's projection); again is a no-op
    assert server_registry.set_alias(MERGED, "production", None) == result.version
    assert server_registry.set_alias(MERGED, "production", None) is None
    assert "production" not in client.get_registered_model(MERGED).aliases


@pytest.mark.integration
def test_parents_must_be_the_merges_candidates(
    server_registry: Registry, registered: list[str], candidate_dirs: list[Path], tmp_path: Path
) -> None:
    merged = _merge(candidate_dirs[:2], "lc", [0.5, 0.5], tmp_path / "two")
    with pytest.raises(RegistryError, match="the merge used"):
        _register(server_registry, merged, registered, POLICY)
    with pytest.raises(RegistryError, match="target_epsilon"):
        _register(server_registry, merged, registered[:2], {"id": "x"})
    with pytest.raises(RegistryError, match="v999 does not exist"):
        _register(server_registry, merged, ["999", registered[1]], POLICY)


def _register(
    registry: Registry, merged: Path, parents: list[str], policy: Any
) -> RegisteredVersion:
    """Register a merged directory as a policy merge does (prepared, then registered)."""
    return registry.register_merged(registry.prepare_merged(merged, parents=parents, policy=policy))


def _released_text(registry: Registry, name: str, version: str, dest: Path) -> dict[str, str]:
    """Every tag, the description and every text artifact of a version (model and run)."""
    client = MlflowClient(registry.tracking_uri, registry.tracking_uri)
    mv = client.get_model_version(name, version)
    texts = {f"tag:{k}": v for k, v in mv.tags.items()}
    texts["description"] = mv.description or ""
    model_dir = Path(
        mlflow.artifacts.download_artifacts(
            mv.source,
            dst_path=str(dest / "model"),
            tracking_uri=registry.tracking_uri,
        )
    )
    run_dir = Path(
        mlflow.artifacts.download_artifacts(
            run_id=mv.run_id, dst_path=str(dest / "run"), tracking_uri=registry.tracking_uri
        )
    )
    for root, prefix in ((model_dir, "model"), (run_dir, "run")):
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            if path.suffix in (".md", ".json", ".txt", ".yaml") or path.name == "MLmodel":
                texts[f"{prefix}:{path.relative_to(root)}"] = path.read_text()
    params = client.get_run(mv.run_id).data.params
    texts.update({f"param:{k}": v for k, v in params.items()})
    return texts


def _normalise(texts: dict[str, str]) -> dict[str, str]:
    """Drop what differs between any two registrations (ids, times, paths, file sizes)."""
    volatile = ("MLmodel", "registered_model_meta", "input_example")  # random, see _log_model
    return {k: v for k, v in texts.items() if not any(part in k for part in volatile)}


def test_rs_draw_appears_nowhere(
    mlflow_embedded: str, candidate_dirs: list[Path], tmp_path: Path
) -> None:
    """Two RS releases of one request with different draws publish identical metadata (tags,
    description, card, records, params); the draw exists only in the audit record."""
    pi = [0.2, 0.3, 0.5]
    draws: dict[int, Path] = {}
    seed = 0
    while len(draws) < 2:  # a test hook: real releases draw once from the OS's CSPRNG
        out, audit = tmp_path / f"rs-{seed}", tmp_path / f"audit-{seed}.json"
        _merge(candidate_dirs, "rs", pi, out, rng=random.Random(seed), audit_path=audit)
        draws.setdefault(json.loads(audit.read_text())["drawn_index"], out)
        seed += 1
    released = []
    for drawn, out in draws.items():  # each release in a registry of its own, one name
        registry = Registry(f"sqlite:///{tmp_path / f'registry-{drawn}' / 'mlflow.db'}")
        versions = [registry.register_candidate(d).version for d in candidate_dirs]
        result = _register(registry, out, versions, POLICY)
        texts = _released_text(registry, MERGED, result.version, tmp_path / f"dl-{drawn}")
        audit_keys = ("drawn_index", "drawn_candidate", "drawn_at", "weights_sha256")
        assert not [k for k, v in texts.items() if any(w in v for w in audit_keys)]
        # the signed manifest: the same facts, card and release whichever draw; its file
        # digests are of freshly written files (a nonce, a random input example), never a
        # candidate's, so no digest names the drawn candidate
        manifest = json.loads(texts.pop("tag:dp.manifest"))
        texts.pop("tag:dp.signature")
        weights = {file_digests(d)["weights.safetensors"] for d in candidate_dirs}
        assert manifest["files"]["extra_files/weights.safetensors"] not in weights
        texts["manifest"] = json.dumps(
            {k: manifest[k] for k in ("facts", "card_digest", "release", "model")}
        )
        released.append(_normalise(texts))
    assert released[0] == released[1]
    for key in (
        "tag:dp.card_digest",
        "manifest",
        "description",
        "model:extra_files/record.json",
        "run:privacy_card.md",
    ):
        assert key in released[0]


def test_embedded_registry_and_ls_cli(
    mlflow_embedded: str, candidate_dirs: list[Path], tmp_path: Path, capsys: Any
) -> None:
    registry = Registry(mlflow_embedded)
    versions = [registry.register_candidate(d).version for d in candidate_dirs]
    assert versions == ["1", "2", "3"]
    assert (tmp_path / "mlartifacts").is_dir()  # artifacts beside the database
    loaded = registry.load_candidates(CANDIDATES, dest=tmp_path / "dl")
    assert [c.model_dir.record.name for c in loaded] == list(SIGMAS)
    merged = _merge(candidate_dirs, "lc", [0.2, 0.3, 0.5], tmp_path / "lc", metrics=_accuracy(0.8))
    policy = Policy(
        name="toy-eps5", target_epsilon=5.0, target_delta=DELTA, dataset="toy", model="logreg"
    )
    result = _register(registry, merged, versions, policy)
    version = MlflowClient(mlflow_embedded, mlflow_embedded).get_model_version(MERGED, "1")
    assert "policy `toy-eps5`" in version.description and version.tags["dp.policy"] == "toy-eps5"
    registry.set_alias(MERGED, "production", result.version)

    assert main(["registry", "ls", "--tracking-uri", mlflow_embedded, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    where = {"uri": mlflow_embedded, "kind": "embedded", "source": "--tracking-uri"}
    assert listed["registry"] == where  # every answer names the registry it read
    rows = listed["versions"]
    assert [(r["role"], r["version"]) for r in rows] == [
        ("candidate", "1"),
        ("candidate", "2"),
        ("candidate", "3"),
        ("merged", "1"),
    ]
    assert rows[3]["aliases"] == ["production"] and rows[3]["accuracy"] == 0.8
    assert [r["accuracy"] for r in rows[:3]] == [None, None, None]  # candidates' are internal
    assert main(["registry", "ls", "--tracking-uri", mlflow_embedded, "--json", "--internal"]) == 0
    internal = json.loads(capsys.readouterr().out)["versions"]
    assert [r["accuracy"] for r in internal[:3]] == [0.7, 0.71, 0.72]
    assert rows[3]["policy"] == "toy-eps5" and rows[3]["target_epsilon"] == 5.0
    assert main(["registry", "ls", "--tracking-uri", mlflow_embedded]) == 0
    table = capsys.readouterr().out
    assert table.startswith(f"registry: {mlflow_embedded} (embedded; from --tracking-uri)\n")
    assert "production" in table and "pld" in table.lower() and "toy-eps5" in table
    # the catalog (sqlite read-only, no MLflow import) reads what the MLflow client reads
    assert open_catalog(mlflow_embedded).rows() == registry.list_versions()
    assert (
        main(["registry", "show", f"{MERGED}@production", "--tracking-uri", mlflow_embedded]) == 0
    )
    shown = capsys.readouterr().out
    assert shown.startswith(
        f"registry: {mlflow_embedded} (embedded; from --tracking-uri)\n"
        f"{MERGED} v1 — merged, ready; aliases: production"
    )
    assert "# Privacy card" in shown and "policy `toy-eps5`" in shown
    assert main(["registry", "show", "@production", "--tracking-uri", mlflow_embedded]) == 0
    assert capsys.readouterr().out == shown  # the release model that carries the alias
    assert main(["registry", "show", f"{CANDIDATES}/2", "--tracking-uri", mlflow_embedded]) == 0
    assert "Candidate cand-b" in capsys.readouterr().out
    for missing in (f"{MERGED}@nope", f"{MERGED}/9", "dpmerge-none"):
        assert main(["registry", "show", missing, "--tracking-uri", mlflow_embedded]) == 2
        assert capsys.readouterr().err.count("\n") == 1  # one line


def test_registrations_from_threads(
    mlflow_embedded: str, candidate_dirs: list[Path], tmp_path: Path
) -> None:
    """Candidates register concurrently (a flow's threads, each with its own registry): the
    registry serialises the pt2 export, which is not thread-safe."""
    start = threading.Barrier(len(candidate_dirs))

    def register(path: Path) -> str:
        start.wait()
        return Registry(mlflow_embedded).register_candidate(path).version

    with ThreadPoolExecutor(len(candidate_dirs)) as pool:
        versions = list(pool.map(register, candidate_dirs))
    assert sorted(versions) == ["1", "2", "3"]
    loaded = Registry(mlflow_embedded).load_candidates(CANDIDATES, dest=tmp_path / "dl")
    assert sorted(c.model_dir.record.name for c in loaded) == sorted(SIGMAS)


def test_unreachable_server_is_a_clear_transient_error() -> None:
    with pytest.raises(RegistryUnavailableError, match=r"unreachable.*dpmerge stack up") as down:
        Registry("http://127.0.0.1:9")
    assert is_transient(down.value)


def test_a_card_or_tag_changed_after_registration_fails_the_gates(
    mlflow_embedded: str, candidate_dirs: list[Path], tmp_path: Path
) -> None:
    """The gates read a merged version's signed facts and compare the stored privacy card with
    them: a version whose tags or card were changed after registration never passes."""
    registry = Registry(mlflow_embedded)
    parents = [registry.register_candidate(d).version for d in candidate_dirs]
    merged = _merge(candidate_dirs, "lc", [0.2, 0.3, 0.5], tmp_path / "lc", metrics=_accuracy(0.8))
    version = _register(registry, merged, parents, POLICY).version
    client = MlflowClient(mlflow_embedded, mlflow_embedded)
    mv = client.get_model_version(MERGED, version)
    epsilon = mv.tags["dp.epsilon"]
    card_file = Path(client.download_artifacts(mv.run_id, CARD_JSON, str(tmp_path)))
    card = json.loads(card_file.read_text())
    assert card["guarantee"]["epsilon"] == float(epsilon)

    gates = _gates(min_accuracy=0.5)
    client.set_model_version_tag(MERGED, version, "dp.epsilon", repr(float(epsilon) / 2))
    with pytest.raises(ReleaseSignatureError, match="differ from the signed manifest"):
        registry.check_gates(MERGED, version, **gates)  # the tags claim less than signed
    client.set_model_version_tag(MERGED, version, "dp.epsilon", epsilon)
    client.log_text(mv.run_id, json.dumps({**card, "guarantee": {"epsilon": 0.01}}), CARD_JSON)
    with pytest.raises(GateError) as gate:  # the card claims less than the signed facts
        registry.check_gates(MERGED, version, **gates)
    assert gate.value.reasons == ("the stored privacy card disagrees with the version's signed ε",)
    stored = registry.get_version(MERGED, version)
    manifest, root = registry.verified_model(MERGED, version, tmp_path / "v", registry.public_key)
    with pytest.raises(ReleaseSignatureError, match="run differs from its signed privacy card"):
        registry.check_card(stored, manifest, root)
    client.log_text(mv.run_id, json.dumps(card), CARD_JSON)
    assert registry.check_gates(MERGED, version, **gates).epsilon == float(epsilon)
    registry.check_card(stored, manifest, root)  # the card consumers read is the signed one


def test_search_filters_quote_values_as_mlflow_reads_them(
    mlflow_embedded: str, tmp_path: Path
) -> None:
    """One quoting function for every search: MLflow's parser strips the quotes and unescapes
    nothing, so a value with an apostrophe is double-quoted and found."""
    from mlflow.utils.search_utils import SearchModelVersionUtils

    for value in ("plain", "it's", 'say "hi"', "back\\slash"):
        (term,) = SearchModelVersionUtils.parse_search_filter(search_filter(tags={"k": value}))
        assert (term["key"], term["value"]) == ("k", value)
    with pytest.raises(RegistryError, match="both kinds of quote"):
        search_filter(name="""it's "both\"""")
    record = _record("cand-it's", 1.0)
    path = save_model_dir(
        tmp_path / "quoted",
        {"linear.weight": torch.zeros(3, 16), "linear.bias": torch.zeros(3)},
        SPEC,
        record=record,
        candidate_privacy=candidate_bound(record, DELTA).to_dict(),
        metrics={"test_accuracy": 0.5},
    )
    registry = Registry(mlflow_embedded)
    registered = registry.register_candidate(path)
    (found,) = registry.ready_candidates(candidate="cand-it's")
    assert (found.name, found.version) == (registered.name, registered.version)
    assert registry.ready_candidates(model="logreg") == [found]
    assert registry.ready_candidates(candidate="cand-its") == []


def test_mlflow_failures_are_transient_by_type_code_or_status() -> None:
    """What MLflow raises is classified by its error code (its HTTP status) or by the network
    error it was raised from, never by its text."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import (
        DEADLINE_EXCEEDED,
        INVALID_PARAMETER_VALUE,
        RESOURCE_DOES_NOT_EXIST,
        TEMPORARILY_UNAVAILABLE,
    )

    def from_rest_client(cause: Exception) -> MlflowException:
        """As MLflow's REST client raises it: inside its ``except`` block."""
        try:
            try:
                raise cause
            except Exception:
                raise MlflowException(f"API request to x failed with exception {cause}")  # noqa: B904
        except MlflowException as error:
            return error

    transient = {
        "sqlite locked": MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE),
        "504": MlflowException("slow", error_code=DEADLINE_EXCEEDED),
        "429": RestException({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "slow down"}),
        "refused": from_rest_client(requests.exceptions.ConnectionError("refused")),
        "timeout": from_rest_client(requests.exceptions.ReadTimeout("read timed out")),
        "retries": from_rest_client(requests.exceptions.RetryError("too many 502 responses")),
    }
    refused = {  # MLflow's answer that the request is wrong: bad input, exit 2
        "missing": MlflowException("no such model", error_code=RESOURCE_DOES_NOT_EXIST),
        "invalid": MlflowException("database is locked", error_code=INVALID_PARAMETER_VALUE),
    }
    failed = {  # the server failed, but not temporarily: an outage or a bug, exit 1
        "text only": MlflowException("failed with error code 503 (database is locked)"),
        "bad url": from_rest_client(requests.exceptions.InvalidURL("no host")),
        "not mlflow": OSError("disk full"),
    }
    for what, error in transient.items():
        translated = registry_error(f"reading m: {what}", error)
        assert isinstance(translated, RegistryUnavailableError), what
        assert is_transient(translated) and str(translated) == f"reading m: {what}"
        assert exit_code(translated) == ExitCode.FAILURE
    for what, error in refused.items():
        translated = registry_error(what, error)
        assert type(translated) is RegistryError and not is_transient(translated), what
        assert exit_code(translated) == ExitCode.REFUSED
    for what, error in failed.items():
        translated = registry_error(what, error)
        assert type(translated) is RegistryFailureError and not is_transient(translated), what
        assert exit_code(translated) == ExitCode.FAILURE


@pytest.mark.slow
def test_a_locked_database_is_transient(mlflow_embedded: str) -> None:
    """A sqlite file locked by another writer (MLflow waits 20 s for it) is worth retrying."""
    registry = Registry(mlflow_embedded)
    assert not registry.model_exists(MERGED)  # the database now exists, unlocked
    database = sqlite3.connect(mlflow_embedded.removeprefix("sqlite:///"), isolation_level=None)
    try:
        database.execute("BEGIN EXCLUSIVE")
        with pytest.raises(RegistryUnavailableError, match="database is locked") as locked:
            registry.set_model_tag(MERGED, "dpmerge.serves.production", "v1")
        assert is_transient(locked.value)
    finally:
        database.execute("ROLLBACK")
        database.close()


def test_a_cancellation_during_registration_is_not_a_registry_error(
    mlflow_embedded: str, candidate_dirs: list[Path]
) -> None:
    """Prefect cancels a run by raising ``TerminationSignal`` (a ``BaseException``) in it: the
    registration marks its version failed and lets the signal through as it is, so the run is
    cancelled rather than failed with a registry error."""
    from prefect.exceptions import TerminationSignal

    class Cancelled(Registry):
        def _verify(self, *args: Any, **kwargs: Any) -> None:
            raise TerminationSignal(15)

    with pytest.raises(TerminationSignal):
        Cancelled(mlflow_embedded).register_candidate(candidate_dirs[0])
    (version,) = MlflowClient(mlflow_embedded, mlflow_embedded).search_model_versions(
        f"name = '{CANDIDATES}'"
    )
    assert version.tags["dp.status"] == STATUS_FAILED


def test_readers_configuration_is_strict() -> None:
    from dpmerge.registry.readers import READERS_ENV, configured_readers, format_readers

    readers = {"dpmerge-releases": ("operator", "consumer"), "dpmerge-candidates": ("operator",)}
    assert configured_readers({READERS_ENV: format_readers(readers)}) == readers
    assert configured_readers({}) == {} == configured_readers({READERS_ENV: " "})
    for bad in ("dpmerge-releases", "=operator", "dpmerge-releases=operator,,consumer"):
        with pytest.raises(RegistryError, match="EXPERIMENT=USER"):
            configured_readers({READERS_ENV: bad})
