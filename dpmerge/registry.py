"""A thin adapter over ``MlflowClient``: candidates and merged models with their privacy records.

Layout. Candidates of one dataset and architecture form one registered model
(``dpmerge-<dataset>-<model>``); the merges released from them form another
(``dpmerge-<dataset>-<model>-merged``), which carries the serving alias. Keeping them apart
lets access rules differ: candidate weights are internal (publishing them voids every
guarantee, and for RS comparing weights would reveal the secret draw).

A version holds an MLflow ``pytorch`` model in the ``pt2`` format (``torch.export``: no pickle,
loadable without dpmerge, dynamic batch dimension from a batch-4 input example) and, in its
``extra_files/``, the dpmerge model directory (``weights.safetensors``, ``model.json``,
``record.json``, ``metrics.json``, ``privacy.json``) from which :meth:`Registry.load_candidates`
rebuilds exact weights. Metrics go to the run; the privacy record to version tags (``dp.*``,
key scalars only) and JSON artifacts.

Safety rules. A version is written fully, verified, and only then tagged
``dp.status=ready``; a failure after creation tags it ``dp.status=failed``. Promotion moves an
alias only to a ready merged version whose gates pass, so an alias never points at a failed or
half-registered version. ``dp.content_hash`` makes registration idempotent: for a merge it
hashes the merge *request* (parent versions, method, weights, δ, policy), never the weights
(an RS output equals one candidate's weights, so a weight hash would leak the drawn index).
The merge record is reduced to its public keys before logging, and no tag, description or
artifact receives the RS draw.

The same code serves an MLflow server (``http://127.0.0.1:5000``, artifacts proxied to S3) and
the embedded default (a ``sqlite:///`` file with local artifacts).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pytorch
import numpy as np
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus, Metric, Param
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from pydantic import BaseModel
from torch import nn

from dpmerge.accounting.records import candidate_from_dict
from dpmerge.artifacts import (
    METRICS_FILE,
    MODEL_FILE,
    PRIVACY_FILE,
    RECORD_FILE,
    WEIGHTS_FILE,
    ModelDir,
    ModelSpec,
    load_model_dir,
)
from dpmerge.errors import DPMergeError, RecordError
from dpmerge.privacy_card import CardCandidate, PrivacyCard, build_privacy_card

ROLE_CANDIDATE, ROLE_MERGED = "candidate", "merged"
STATUS_REGISTERING, STATUS_READY, STATUS_FAILED = "registering", "ready", "failed"
DEFAULT_EXPERIMENT = "dpmerge-registry"
MODEL_ARTIFACT = "model"
EXTRA_DIR = "extra_files"  # where mlflow.pytorch.log_model puts extra_files
CARD_MARKDOWN, CARD_JSON = "privacy_card.md", "privacy_card.json"
PUBLIC_MERGE_KEYS = ("method", "weights", "bound", "candidates", "calibration")
INPUT_EXAMPLE_BATCH = 4  # > 1 so that pt2 export keeps the batch dimension dynamic
TAG_VALUE_LIMIT = 5000  # bytes every MLflow backend stores for a tag value

ModuleBuilder = Callable[[ModelSpec], nn.Module]


class RegistryError(DPMergeError):
    """A registry operation failed or was refused; the message names model and version."""


class GateError(RegistryError):
    """Promotion refused: a gate failed. The alias was not moved."""

    def __init__(self, name: str, version: str, reasons: Sequence[str]) -> None:
        super().__init__(f"{name} v{version} not promoted: " + "; ".join(reasons))
        self.reasons = tuple(reasons)


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    content_hash: str
    run_id: str | None
    reused: bool


@dataclass(frozen=True)
class RegisteredCandidate:
    """A ready candidate version and its model directory, downloaded and checked."""

    name: str
    version: str
    model_dir: ModelDir


@dataclass(frozen=True)
class Promotion:
    name: str
    alias: str
    version: str
    previous: str | None
    changed: bool


@dataclass(frozen=True)
class VersionSummary:
    """One row of ``dpmerge registry ls``."""

    name: str
    version: str
    role: str
    status: str | None
    epsilon: float | None
    delta: float | None
    accountant: str | None
    bound: str | None
    accuracy: float | None
    method: str | None
    parents: str | None
    aliases: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "aliases": list(self.aliases)}


# --- names and hashes ----------------------------------------------------------------------


def slug(text: str, limit: int = 40) -> str:
    """Lower-case ``text`` with runs of other characters turned into ``-``."""
    value = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")
    if not value:
        raise RegistryError(f"cannot make a registered-model name from {text!r}")
    return value


def dataset_slug(dataset: str) -> str:
    """``fashion-mnist-sha256:3f2a…`` -> ``fashion-mnist-3f2a9c1b``: readable, yet distinct
    for different training data."""
    match = re.fullmatch(r"(.+)-sha256:([0-9a-f]{8,})", dataset)
    return f"{slug(match[1])}-{match[2][:8]}" if match else slug(dataset)


def candidate_model_name(dataset: str, model: str) -> str:
    return f"dpmerge-{dataset_slug(dataset)}-{slug(model)}"


def merged_model_name(dataset: str, model: str) -> str:
    return f"{candidate_model_name(dataset, model)}-merged"


def _canonical(document: Any) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), default=str).encode()


def _dir_hash(path: Path, files: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        with (path / name).open("rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def candidate_content_hash(path: str | Path) -> str:
    """Identity of a candidate directory: its weights, architecture and record files."""
    return _dir_hash(Path(path), (WEIGHTS_FILE, MODEL_FILE, RECORD_FILE))


def merge_request_hash(
    *,
    parent_model: str,
    parents: Sequence[str],
    method: str,
    weights: Sequence[float],
    delta: float,
    bound: str,
    policy: Mapping[str, Any],
) -> str:
    """Identity of a merge *request*; ``parents`` in the order of ``weights``. Independent of
    the merged weights, so for RS it carries nothing about the draw."""
    return hashlib.sha256(
        _canonical(
            {
                "schema": "dpmerge.merge_request/1",
                "parent_model": parent_model,
                "parents": [str(v) for v in parents],
                "method": method,
                "weights": [float(w) for w in weights],
                "delta": float(delta),
                "bound": bound,
                "policy": dict(policy),
            }
        )
    ).hexdigest()


# --- small helpers -------------------------------------------------------------------------


def _tag(value: Any) -> str:
    text = repr(float(value)) if isinstance(value, float) else str(value)
    if len(text.encode()) > TAG_VALUE_LIMIT:
        raise RegistryError(f"tag value longer than {TAG_VALUE_LIMIT} bytes: {text[:60]}…")
    return text


def _tags(values: Mapping[str, Any]) -> dict[str, str]:
    return {k: _tag(v) for k, v in values.items() if v is not None}


def _float(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def _scalar_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Finite numeric leaves of a (nested) metrics dict, keys joined with dots."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_scalar_metrics(value, f"{name}."))
        elif (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ):
            flat[name] = float(value)
    return flat


def _is_not_found(error: MlflowException) -> bool:
    return error.error_code == "RESOURCE_DOES_NOT_EXIST"


class Registry:
    """Register candidates and merges, load candidates, promote and revoke aliases.

    ``tracking_uri`` defaults to MLflow's (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``
    in the working directory). For a ``sqlite:///`` URI the experiment's artifacts go next to
    the database (``<db dir>/mlartifacts``) unless ``artifact_location`` says otherwise; a server
    decides for itself. ``build_module`` turns a :class:`ModelSpec` into a module to load the
    weights into (default ``dpmerge.models.build_model``). The accuracy that promotion gates on
    is the first of ``accuracy_keys`` found in a model's metrics.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        artifact_location: str | None = None,
        build_module: ModuleBuilder | None = None,
        accuracy_keys: Sequence[str] = ("test_accuracy", "accuracy"),
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(self.tracking_uri, self.tracking_uri)
        self.experiment = experiment
        self.artifact_location = artifact_location or _default_artifact_location(self.tracking_uri)
        self.accuracy_keys = tuple(accuracy_keys)
        self.ready_timeout_s = ready_timeout_s
        self._build_module = build_module
        self._experiment_id: str | None = None
        if self.tracking_uri.startswith(("http://", "https://")):
            _check_server(self.tracking_uri)

    # --- registration ------------------------------------------------------------------

    def register_candidate(
        self, model_dir: str | Path, *, name: str | None = None
    ) -> RegisteredVersion:
        """Register a trained candidate directory (idempotent on its content hash)."""
        loaded = load_model_dir(model_dir)
        record = loaded.record
        if record is None:
            raise RegistryError(f"{loaded.path} is a merged model; use register_merged")
        privacy = loaded.candidate_privacy
        if not privacy or privacy.get("epsilon") is None:
            raise RegistryError(
                f"{loaded.path}/{RECORD_FILE} holds no candidate bound ('privacy' with epsilon); "
                "ε is derived by the accountant at training time, never typed in"
            )
        name = name or candidate_model_name(record.dataset, loaded.spec.name)
        tags = _tags(
            {
                "dp.role": ROLE_CANDIDATE,
                "dp.candidate": record.name,
                "dp.kind": record.kind,
                "dp.dataset": record.dataset,
                "dp.model": loaded.spec.name,
                "dp.epsilon": privacy.get("epsilon"),
                "dp.delta": privacy.get("delta"),
                "dp.accountant": privacy.get("accountant"),
                "dp.epsilon_pld": privacy.get("epsilon_pld"),
                "dp.epsilon_rdp": privacy.get("epsilon_rdp"),
                "dp.neighbouring": record.neighbouring,
                "dp.noise_multiplier": getattr(record, "noise_multiplier", None),
                "dp.sample_rate": getattr(record, "sample_rate", None),
                "dp.steps": getattr(record, "steps", None),
                "dp.clip_norm": getattr(record, "clip_norm", None),
                "dp.noise_lineage": getattr(record, "noise_lineage", None),
                "dp.batch_lineage": getattr(record, "batch_lineage", None),
                **self._accuracy_tags(loaded.metrics),
            }
        )
        params = record.model_dump(mode="json", exclude_none=True)
        return self._register(
            name,
            loaded,
            content_hash=candidate_content_hash(loaded.path),
            run_name=record.name,
            tags=tags,
            params=params,
            record_bytes=(loaded.path / RECORD_FILE).read_bytes(),
            description=(
                f"Candidate {record.name}: (ε = {privacy['epsilon']:.4f}, "
                f"δ = {privacy['delta']:g}) under {str(privacy.get('accountant')).upper()}. "
                "Internal: publishing these weights voids every guarantee of merges built from "
                "them."
            ),
            card=None,
        )

    def register_merged(
        self,
        model_dir: str | Path,
        *,
        parents: Sequence[str | int],
        policy: Mapping[str, Any] | BaseModel,
        parent_model: str | None = None,
        name: str | None = None,
        ledger: Mapping[str, Any] | None = None,
    ) -> RegisteredVersion:
        """Register a merged directory with its privacy card (idempotent on the request hash).

        ``parents`` are the candidate versions (of ``parent_model``, default the candidates'
        registered model) the merge used, one per report candidate. ``policy`` (a
        ``dpmerge.policies.Policy`` or a mapping) needs ``target_epsilon`` and ``target_delta``;
        its ``name`` (or ``id``) is shown on the card, and all of it enters the request hash.
        ``ledger`` is the cumulative release bound to show (see :func:`build_privacy_card`).
        """
        if isinstance(policy, BaseModel):
            policy = policy.model_dump(mode="json")
        loaded = load_model_dir(model_dir)
        if loaded.merge is None or loaded.privacy is None:
            raise RegistryError(f"{loaded.path} is not a merged model directory with privacy.json")
        report, merge = loaded.privacy, loaded.merge
        try:
            target_epsilon = float(policy["target_epsilon"])
            target_delta = float(policy["target_delta"])
        except (KeyError, TypeError, ValueError):
            raise RegistryError(
                "policy needs numeric 'target_epsilon' and 'target_delta'"
            ) from None
        records = [
            (candidate_from_dict(entry["record"]), entry.get("privacy"))
            for entry in merge.get("candidates", [])
            if isinstance(entry, Mapping) and "record" in entry
        ]
        names = list(report.get("candidates", []))
        if [r.name for r, _ in records] != names:
            raise RegistryError(
                f"{loaded.path}: the merge record's candidates do not match privacy.json's {names}"
            )
        dataset = records[0][0].dataset
        parent_model = parent_model or candidate_model_name(dataset, loaded.spec.name)
        versions = self._parent_versions(parent_model, [str(p) for p in parents], names)
        content_hash = merge_request_hash(
            parent_model=parent_model,
            parents=[versions[n] for n in names],
            method=report["method"],
            weights=report["weights"],
            delta=report["delta"],
            bound=report["bound"],
            policy=policy,
        )
        name = name or merged_model_name(dataset, loaded.spec.name)
        policy_id = str(policy.get("name") or policy.get("id") or "") or None
        card = build_privacy_card(
            report,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            candidates=[CardCandidate.from_record(r, p, versions[r.name]) for r, p in records],
            model_name=name,
            policy_id=policy_id,
            ledger=ledger,
        )
        bounds = report.get("bounds", {})
        generic, structured = bounds.get("generic") or {}, bounds.get("structured") or {}
        tags = _tags(
            {
                "dp.role": ROLE_MERGED,
                "dp.method": report["method"],
                "dp.weights": json.dumps([float(w) for w in report["weights"]]),
                "dp.parents": ",".join(versions[n] for n in names),
                "dp.parent_model": parent_model,
                "dp.gating_bound": report["bound"],
                "dp.epsilon": report["epsilon"],
                "dp.delta": report["delta"],
                "dp.accountant": report.get("accountant"),
                "dp.epsilon_pld": report.get("epsilon_pld"),
                "dp.epsilon_rdp": report.get("epsilon_rdp"),
                "dp.generic_epsilon": generic.get("epsilon"),
                "dp.structured_epsilon": structured.get("epsilon"),
                "dp.neighbouring": report.get("neighbouring"),
                "dp.policy": policy_id,
                "dp.target_epsilon": target_epsilon,
                "dp.target_delta": target_delta,
                "dp.dataset": dataset,
                "dp.model": loaded.spec.name,
                **self._accuracy_tags(loaded.metrics),
            }
        )
        params = {
            "method": report["method"],
            "bound": report["bound"],
            "delta": report["delta"],
            "parent_model": parent_model,
            "parents": tags["dp.parents"],
            "weights": tags["dp.weights"],
            "policy": json.dumps(dict(policy), sort_keys=True, default=str),
        }
        public = {"merge": {k: merge[k] for k in PUBLIC_MERGE_KEYS if k in merge}}
        return self._register(
            name,
            loaded,
            content_hash=content_hash,
            run_name=f"merge-{content_hash[:12]}",
            tags=tags,
            params=params,
            record_bytes=json.dumps(public, indent=2).encode(),
            description=card.description(),
            card=card,
        )

    def _parent_versions(
        self, parent_model: str, parents: Sequence[str], names: Sequence[str]
    ) -> dict[str, str]:
        """Candidate name -> version, checking each parent is a ready candidate of the merge."""
        by_name: dict[str, str] = {}
        for version in parents:
            tags = self._version(parent_model, version).tags
            if tags.get("dp.role") != ROLE_CANDIDATE or tags.get("dp.status") != STATUS_READY:
                raise RegistryError(f"{parent_model} v{version} is not a ready candidate version")
            candidate = tags.get("dp.candidate", "")
            if candidate in by_name:
                raise RegistryError(f"candidate {candidate!r} given twice among the parents")
            by_name[candidate] = version
        if sorted(by_name) != sorted(names):
            raise RegistryError(
                f"parent versions {list(parents)} of {parent_model} hold candidates "
                f"{sorted(by_name)}, the merge used {sorted(names)}"
            )
        return by_name

    def _register(
        self,
        name: str,
        loaded: ModelDir,
        *,
        content_hash: str,
        run_name: str,
        tags: dict[str, str],
        params: Mapping[str, Any],
        record_bytes: bytes,
        description: str,
        card: PrivacyCard | None,
    ) -> RegisteredVersion:
        existing = self.find_ready_version(name, content_hash)
        if existing is not None:
            return RegisteredVersion(
                name, str(existing.version), content_hash, existing.run_id, True
            )
        self._ensure_registered_model(name, tags["dp.role"])
        with self._errors(f"logging {name}"):
            run = self.client.create_run(
                self._experiment(),
                run_name=run_name,
                tags={"dp.role": tags["dp.role"], "dp.content_hash": content_hash},
            )
        run_id = run.info.run_id
        version: str | None = None
        try:
            model_id, source, files = self._log_model(
                run_id, loaded, record_bytes, card, tags["dp.role"]
            )
            with self._errors(f"logging metrics and params of {name}"):
                stamp = int(time.time() * 1000)
                self.client.log_batch(
                    run_id,
                    metrics=[
                        Metric(k, v, stamp, 0, model_id=model_id)
                        for k, v in _scalar_metrics(loaded.metrics).items()
                    ],
                    params=[Param(k, str(v)[:6000]) for k, v in params.items()],
                )
                if card is not None:
                    self.client.log_text(run_id, card.markdown, CARD_MARKDOWN)
                    self.client.log_text(run_id, card.to_json(), CARD_JSON)
            with self._errors(f"registering {name}"):
                created = self.client.create_model_version(
                    name,
                    source=source,
                    run_id=run_id,
                    tags={**tags, "dp.content_hash": content_hash, "dp.status": STATUS_REGISTERING},
                    description=description,
                    model_id=model_id,
                    await_creation_for=0,
                )
            version = str(created.version)
            self._wait_ready(name, version, self.ready_timeout_s)
            self._verify(name, version, model_id=model_id, files=files, card=card)
            with self._errors(f"marking {name} v{version} ready"):
                self.client.set_model_version_tag(name, version, "dp.status", STATUS_READY)
        except BaseException as error:
            if version is not None:
                self._mark_failed(name, version)
            self._end_run(run_id, "FAILED")
            if isinstance(error, DPMergeError | KeyboardInterrupt):
                raise
            raise RegistryError(f"registering {name} failed: {error}") from error
        self._end_run(run_id, "FINISHED")
        return RegisteredVersion(name, version, content_hash, run_id, False)

    def _log_model(
        self,
        run_id: str,
        loaded: ModelDir,
        record_bytes: bytes,
        card: PrivacyCard | None,
        role: str,
    ) -> tuple[str, str, list[str]]:
        """Save the pt2 model with the dpmerge files as extra files and upload it as a logged
        model of the run. Goes through this registry's client only (no fluent API, so no
        global tracking URI is read or changed). Returns model id, artifact location, files."""
        module = self._module(loaded)
        example = np.zeros((INPUT_EXAMPLE_BATCH, *loaded.spec.input_shape), np.float32)
        with self._errors("creating the logged model"):
            logged = self.client.create_logged_model(
                self._experiment(),
                name=MODEL_ARTIFACT,
                source_run_id=run_id,
                tags={"dp.role": role},
            )
        try:
            with tempfile.TemporaryDirectory(prefix="dpmerge-register-") as staging:
                files = _stage_files(Path(staging) / "files", loaded, record_bytes, card)
                model_path = Path(staging) / MODEL_ARTIFACT
                mlflow.pytorch.save_model(
                    module,
                    str(model_path),
                    mlflow_model=Model(
                        artifact_path=MODEL_ARTIFACT, run_id=run_id, model_id=logged.model_id
                    ),
                    input_example=example,
                    pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
                    extra_files=[str(f) for f in files],
                    serialization_format="pt2",
                )
                with self._errors("uploading the logged model"):
                    self.client.log_model_artifacts(logged.model_id, str(model_path))
        except BaseException:
            with suppress(MlflowException):
                self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        with self._errors("finalising the logged model"):
            self.client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        return logged.model_id, logged.artifact_location, [f.name for f in files]

    def _accuracy_tags(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``dp.accuracy`` from the first of ``accuracy_keys`` present, and which key it was."""
        flat = _scalar_metrics(metrics)
        key = next((k for k in self.accuracy_keys if k in flat), None)
        return {} if key is None else {"dp.accuracy": flat[key], "dp.accuracy_metric": key}

    def _module(self, loaded: ModelDir) -> nn.Module:
        build = self._build_module
        if build is None:
            from dpmerge.models import build_model as build
        module = build(loaded.spec)
        try:
            module.load_state_dict(loaded.weights, strict=True)
        except RuntimeError as error:
            raise RecordError(
                f"{loaded.path}: weights do not fit {loaded.spec.name}: {error}"
            ) from None
        return module.eval()

    def _verify(
        self,
        name: str,
        version: str,
        *,
        model_id: str,
        files: Sequence[str],
        card: PrivacyCard | None,
    ) -> None:
        """The version's model, dpmerge files and card are all stored and consistent."""
        mv = self._version(name, version)
        with self._errors(f"verifying {name} v{version}"):
            stored = {
                Path(f.path).name
                for f in self.client.list_logged_model_artifacts(model_id, EXTRA_DIR)
            }
            top = {f.path for f in self.client.list_logged_model_artifacts(model_id)}
        missing = sorted(set(files) - stored) + (["MLmodel"] if "MLmodel" not in top else [])
        if missing:
            raise RegistryError(f"{name} v{version}: artifacts missing after upload: {missing}")
        if card is not None:
            stored_card = self._run_json(mv.run_id, CARD_JSON)
            if stored_card.get("guarantee", {}).get("epsilon") != _float(mv.tags.get("dp.epsilon")):
                raise RegistryError(f"{name} v{version}: the stored card disagrees with dp.epsilon")

    # --- loading -----------------------------------------------------------------------

    def load_candidates(
        self,
        name: str,
        versions: Sequence[str | int] | None = None,
        *,
        dest: str | Path | None = None,
    ) -> list[RegisteredCandidate]:
        """Download ready candidate versions (default: all) into ``dest`` (default a new
        temporary directory the caller owns), check each against its content hash, load."""
        if versions is None:
            found = self._search(f"name = '{_quote(name)}' and tags.`dp.role` = '{ROLE_CANDIDATE}'")
            versions = [v.version for v in found if v.tags.get("dp.status") == STATUS_READY]
        if not versions:
            raise RegistryError(f"no ready candidate versions in {name}")
        root = (
            Path(dest) if dest is not None else Path(tempfile.mkdtemp(prefix="dpmerge-candidates-"))
        )
        result = []
        for version in sorted({str(v) for v in versions}, key=int):
            mv = self._version(name, version)
            if mv.tags.get("dp.role") != ROLE_CANDIDATE or mv.tags.get("dp.status") != STATUS_READY:
                raise RegistryError(f"{name} v{version} is not a ready candidate version")
            with self._errors(f"downloading {name} v{version}"):
                path = mlflow.artifacts.download_artifacts(
                    artifact_uri=f"{mv.source.rstrip('/')}/{EXTRA_DIR}",
                    dst_path=str(root / f"{slug(name, 80)}-v{version}"),
                    tracking_uri=self.tracking_uri,
                )
            if candidate_content_hash(path) != mv.tags.get("dp.content_hash"):
                raise RegistryError(
                    f"{name} v{version}: downloaded files do not match dp.content_hash"
                )
            result.append(RegisteredCandidate(name, version, load_model_dir(path)))
        return result

    # --- promotion ---------------------------------------------------------------------

    def promote(
        self,
        name: str,
        version: str | int,
        alias: str,
        *,
        target_epsilon: float,
        min_accuracy: float | None,
        target_delta: float | None = None,
        timeout_s: float | None = None,
    ) -> Promotion:
        """Move ``alias`` to ``version`` once it is READY and its gates pass: a ready merged
        version, gating ε ≤ ``target_epsilon`` (and δ ≤ ``target_delta`` if given), accuracy
        ≥ ``min_accuracy`` (``None``: no accuracy gate), its stored card agreeing with its tags.
        Raises :class:`GateError` and leaves the alias where it was otherwise."""
        version = str(version)
        mv = self._wait_ready(name, version, timeout_s or self.ready_timeout_s)
        tags, reasons = mv.tags, []
        if tags.get("dp.role") != ROLE_MERGED:
            reasons.append(f"role is {tags.get('dp.role')!r}, only merged versions are released")
        if tags.get("dp.status") != STATUS_READY:
            reasons.append(f"dp.status is {tags.get('dp.status')!r}, not {STATUS_READY!r}")
        epsilon, delta = _float(tags.get("dp.epsilon")), _float(tags.get("dp.delta"))
        if epsilon is None or epsilon > target_epsilon:
            reasons.append(f"gating ε = {epsilon} exceeds the target {target_epsilon:g}")
        if target_delta is not None and (delta is None or delta > target_delta):
            reasons.append(f"δ = {delta} exceeds the target {target_delta:g}")
        if min_accuracy is not None:
            accuracy = _float(tags.get("dp.accuracy"))
            if accuracy is None or accuracy < min_accuracy:
                reasons.append(f"accuracy {accuracy} is below the minimum {min_accuracy:g}")
        if not reasons and mv.run_id:
            card = self._run_json(mv.run_id, CARD_JSON)
            if card.get("guarantee", {}).get("epsilon") != epsilon:
                reasons.append("the stored privacy card disagrees with the version's tags")
        if reasons:
            raise GateError(name, version, reasons)
        previous = self._aliases(name).get(alias)
        if previous == version:
            return Promotion(name, alias, version, previous, changed=False)
        with self._errors(f"setting alias {alias!r} on {name} v{version}"):
            self.client.set_registered_model_alias(name, alias, version)
        return Promotion(name, alias, version, previous, changed=True)

    def revoke(self, name: str, alias: str) -> str | None:
        """Remove ``alias`` (policy ``on_infeasible=revoke``); returns the version it named."""
        previous = self._aliases(name).get(alias)
        if previous is not None:
            with self._errors(f"removing alias {alias!r} from {name}"):
                self.client.delete_registered_model_alias(name, alias)
        return previous

    # --- queries -----------------------------------------------------------------------

    def find_ready_version(self, name: str, content_hash: str) -> ModelVersion | None:
        """The ready version of ``name`` with this content hash (a merge request already
        registered: a flow can check this before merging, so RS draws once per release)."""
        found = self._search(
            f"name = '{_quote(name)}' and tags.`dp.content_hash` = '{_quote(content_hash)}'"
        )
        ready = [v for v in found if v.tags.get("dp.status") == STATUS_READY]
        return min(ready, key=lambda v: int(v.version)) if ready else None

    def list_versions(self, name: str | None = None) -> list[VersionSummary]:
        """Every candidate and merged version (of ``name`` if given), by name and version."""
        where = f"name = '{_quote(name)}' and " if name else ""
        found = [
            v
            for role in (ROLE_CANDIDATE, ROLE_MERGED)
            for v in self._search(f"{where}tags.`dp.role` = '{role}'")
        ]
        aliases: dict[str, dict[str, list[str]]] = {}
        for model in {v.name for v in found}:
            for alias, version in self._aliases(model).items():
                aliases.setdefault(model, {}).setdefault(str(version), []).append(alias)
        rows = [
            VersionSummary(
                name=v.name,
                version=str(v.version),
                role=v.tags.get("dp.role", ""),
                status=v.tags.get("dp.status"),
                epsilon=_float(v.tags.get("dp.epsilon")),
                delta=_float(v.tags.get("dp.delta")),
                accountant=v.tags.get("dp.accountant"),
                bound=v.tags.get("dp.gating_bound"),
                accuracy=_float(v.tags.get("dp.accuracy")),
                method=v.tags.get("dp.method"),
                parents=v.tags.get("dp.parents"),
                aliases=tuple(sorted(aliases.get(v.name, {}).get(str(v.version), []))),
            )
            for v in found
        ]
        return sorted(rows, key=lambda r: (r.name, int(r.version)))

    # --- MLflow plumbing ---------------------------------------------------------------

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except MlflowException as error:
            raise RegistryError(f"{action} at {self.tracking_uri}: {error.message}") from None

    def _experiment(self) -> str:
        if self._experiment_id is None:
            with self._errors(f"opening experiment {self.experiment!r}"):
                found = self.client.get_experiment_by_name(self.experiment)
                if found is None:
                    try:
                        self._experiment_id = self.client.create_experiment(
                            self.experiment, artifact_location=self.artifact_location
                        )
                    except MlflowException as error:
                        if error.error_code != "RESOURCE_ALREADY_EXISTS":
                            raise
                        found = self.client.get_experiment_by_name(self.experiment)
                if found is not None:
                    self._experiment_id = found.experiment_id
        assert self._experiment_id is not None
        return self._experiment_id

    def _ensure_registered_model(self, name: str, role: str) -> None:
        try:
            self.client.create_registered_model(
                name,
                tags={"dp.kind": "candidates" if role == ROLE_CANDIDATE else "releases"},
                description=(
                    "dpmerge candidates (internal)"
                    if role == ROLE_CANDIDATE
                    else "dpmerge merged releases; see each version's privacy card"
                ),
            )
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise RegistryError(f"creating registered model {name}: {error.message}") from None

    def _version(self, name: str, version: str) -> ModelVersion:
        try:
            return self.client.get_model_version(name, version)
        except MlflowException as error:
            if _is_not_found(error):
                raise RegistryError(f"{name} v{version} does not exist") from None
            raise RegistryError(f"reading {name} v{version}: {error.message}") from None

    def _aliases(self, name: str) -> dict[str, str]:
        with self._errors(f"reading aliases of {name}"):
            return {k: str(v) for k, v in self.client.get_registered_model(name).aliases.items()}

    def _search(self, filter_string: str) -> list[ModelVersion]:
        found: list[ModelVersion] = []
        token = None
        with self._errors(f"searching versions ({filter_string})"):
            while True:
                page = self.client.search_model_versions(filter_string, page_token=token)
                found.extend(page)
                token = page.token
                if not token:
                    return found

    def _wait_ready(self, name: str, version: str, timeout_s: float) -> ModelVersion:
        deadline = time.monotonic() + timeout_s
        while True:
            mv = self._version(name, version)
            if mv.status == "READY":
                return mv
            if mv.status == "FAILED_REGISTRATION":
                raise RegistryError(f"{name} v{version} failed registration: {mv.status_message}")
            if time.monotonic() > deadline:
                raise RegistryError(f"{name} v{version} not READY after {timeout_s:.0f} s")
            time.sleep(0.5)

    def _run_json(self, run_id: str, path: str) -> dict[str, Any]:
        with (
            self._errors(f"reading {path} of run {run_id}"),
            tempfile.TemporaryDirectory(prefix="dpmerge-read-") as scratch,
        ):
            return json.loads(
                Path(self.client.download_artifacts(run_id, path, scratch)).read_text()
            )

    def _mark_failed(self, name: str, version: str) -> None:
        # best effort: without dp.status=ready the version is never promoted anyway
        with suppress(MlflowException):
            self.client.set_model_version_tag(name, version, "dp.status", STATUS_FAILED)

    def _end_run(self, run_id: str, status: str) -> None:
        with suppress(MlflowException):
            self.client.set_terminated(run_id, status)


def _stage_files(
    staging: Path, loaded: ModelDir, record_bytes: bytes, card: PrivacyCard | None
) -> list[Path]:
    """Copy a model directory's files to ``staging``, with ``record_bytes`` as its record."""
    staging.mkdir(parents=True, exist_ok=True)
    files = []
    for name in (WEIGHTS_FILE, MODEL_FILE, METRICS_FILE, PRIVACY_FILE):
        source = loaded.path / name
        if source.is_file():
            (staging / name).write_bytes(source.read_bytes())
            files.append(staging / name)
    (staging / RECORD_FILE).write_bytes(record_bytes)
    files.append(staging / RECORD_FILE)
    if card is not None:
        (staging / CARD_MARKDOWN).write_text(card.markdown)
        (staging / CARD_JSON).write_text(card.to_json())
        files += [staging / CARD_MARKDOWN, staging / CARD_JSON]
    return files


def _quote(value: str) -> str:
    return value.replace("'", "''")


def _default_artifact_location(tracking_uri: str) -> str | None:
    if not tracking_uri.startswith("sqlite:///"):
        return None
    database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / "mlartifacts").as_uri()


def _check_server(url: str) -> None:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as error:
        raise RegistryError(
            f"MLflow server {url} unreachable ({error}); start it (`dpmerge stack up`) "
            "or point MLFLOW_TRACKING_URI elsewhere"
        ) from None
