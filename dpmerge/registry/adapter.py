"""The :class:`Registry`: register candidates and merges, promote, revoke and restore aliases
with the event time of each change, and log report runs, under the safety rules of
:mod:`dpmerge.registry`; its reads are :class:`~dpmerge.registry.queries.RegistryQueries`."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

from dpmerge import manifests
from dpmerge.artifacts import RECORD_FILE, WEIGHTS_FILE, ModelDir, ModelSpec, load_model_dir
from dpmerge.errors import DPMergeError, RecordError
from dpmerge.formatting import epsilon_text
from dpmerge.keys import WorkflowKey
from dpmerge.privacy_card import CARD_JSON, CARD_MARKDOWN, PrivacyCard
from dpmerge.publication import dataset_name, public_record
from dpmerge.registry.connection import (
    CANDIDATES_EXPERIMENT,
    RELEASES_EXPERIMENT,
)
from dpmerge.registry.errors import (
    GateError,
    RegistryError,
    registry_error,
)
from dpmerge.registry.merged import MergedDir, MergedRelease
from dpmerge.registry.names import (
    candidate_content_hash,
    candidate_model_name,
    merged_model_name,
)
from dpmerge.registry.queries import RegistryQueries
from dpmerge.registry.tags import (
    FAILURE_TAG,
    KEY_ID_TAG,
    MANIFEST_TAG,
    PUBLISHED_RECORD_TAG,
    REGISTERING_BY_TAG,
    ROLE_CANDIDATE,
    ROLE_MERGED,
    SIGNATURE_TAG,
    STATUS_QUARANTINED,
    STATUS_READY,
    STATUS_REGISTERING,
    scalar_metrics,
    signed_facts,
    tag_float,
    tag_value,
    tag_values,
)
from dpmerge.registry.versions import (
    RegisteredVersion,
    ReleaseFacts,
    StoredVersion,
)

if TYPE_CHECKING:  # torch loads on first use: `dpmerge verify` checks files, never a module
    from torch import nn

EXPERIMENTS = {
    ROLE_CANDIDATE: (CANDIDATES_EXPERIMENT, "candidates"),
    ROLE_MERGED: (RELEASES_EXPERIMENT, "releases"),
}
"""Role -> (experiment, artifact prefix). Candidates and releases never share either, so the
candidates' prefix can be made internal and the releases' public (docs/design.md#rs-secrecy)."""
REPORTS_PREFIX = "reports"
DATA_CONTEXT = "mlflow.data.context"  # MLflow's input tag: what a dataset input was used for
PRIVACY_METRICS = {
    "epsilon": "dp.epsilon",
    "epsilon_pld": "dp.epsilon_pld",
    "epsilon_rdp": "dp.epsilon_rdp",
    "delta": "dp.delta",
    "epsilon_generic": "dp.generic_epsilon",
    "epsilon_structured": "dp.structured_epsilon",
}
"""Run metric -> the tag it copies: privacy next to accuracy in MLflow's run table."""

ModuleBuilder = Callable[[ModelSpec], "nn.Module"]
History = Mapping[str, Sequence[float]]


CURVES = ("validation_accuracy", "validation_loss", "test_accuracy", "test_loss")
"""Per-epoch metrics logged as training curves (training loss is a statistic of the training
batches and is never written to the model directory, docs/training.md)."""


def epoch_curves(metrics: Mapping[str, Any]) -> dict[str, list[float]]:
    """``{metric: [value per epoch]}`` from a model directory's ``metrics["history"]``."""
    history = metrics.get("history")
    if not isinstance(history, list):
        return {}
    curves: dict[str, list[float]] = {}
    for key in CURVES:
        values = [e.get(key) for e in history if isinstance(e, Mapping)]
        if values and all(isinstance(v, int | float) for v in values):
            curves[key] = [float(v) for v in values]
    return curves


@dataclass(frozen=True)
class RunInfo:
    """How a version's MLflow run looks: its name, when it ran (ms since the epoch; ``None``:
    registration time), its metrics (also per-epoch histories) and its training data."""

    name: str
    metrics: dict[str, float]
    dataset: str  # the published dataset identifier
    history: History = field(default_factory=dict)
    started_ms: int | None = None
    ended_ms: int | None = None


class Registry(RegistryQueries):
    """Register candidates and merges, load candidates, promote and revoke aliases.

    ``tracking_uri`` defaults to MLflow's (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``
    in the working directory). Artifacts go under ``artifact_root`` (default: ``<db
    dir>/mlartifacts`` for a ``sqlite:///`` URI, the server's proxied store for a server), in
    one prefix per role (``candidates/``, ``releases/``). ``keys`` is the workflow's secret key
    (default :meth:`WorkflowKey.from_env`, on first use). ``build_module`` turns a
    :class:`ModelSpec` into a module to load the weights into (default
    ``dpmerge.models.build_model``). The accuracy that promotion gates on is the first of
    ``accuracy_keys`` found in a model's metrics. A version left ``registering`` for longer than
    ``stale_registration_s`` (or by a process of this host that is gone) is marked failed by
    the next registration of the same content.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        keys: WorkflowKey | None = None,
        public_key: str | None = None,
        artifact_root: str | None = None,
        build_module: ModuleBuilder | None = None,
        accuracy_keys: Sequence[str] = ("test_accuracy", "accuracy"),
        ready_timeout_s: float = 300.0,
        stale_registration_s: float = 900.0,
    ) -> None:
        super().__init__(tracking_uri, artifact_root, keys, public_key)
        self.accuracy_keys = tuple(accuracy_keys)
        self.ready_timeout_s = ready_timeout_s
        self.stale_registration_s = stale_registration_s
        self._build_module = build_module

    # --- registration ------------------------------------------------------------------

    def register_candidate(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        history: History | None = None,
        started_ms: int | None = None,
        ended_ms: int | None = None,
    ) -> RegisteredVersion:
        """Register a trained candidate directory (idempotent on its content hash), signed
        with the workflow's key. Published fields carry the keyed dataset identifier and keyed
        lineages (:func:`~dpmerge.publication.public_record`). ``history`` maps a metric name
        to its per-epoch values (logged as the metric's history); the run spans the training
        (``started_ms``..``ended_ms``, default: ``train_seconds`` before the weights file was
        written)."""
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
        keys = self.keys
        public = public_record(record, keys)
        name = name or candidate_model_name(public.dataset, loaded.spec.label)
        content_hash = candidate_content_hash(loaded.path)
        tags = tag_values(
            {
                "dp.role": ROLE_CANDIDATE,
                "dp.candidate": record.name,
                "dp.kind": record.kind,
                "dp.dataset": public.dataset,
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
                "dp.noise_lineage": getattr(public, "noise_lineage", None),
                "dp.batch_lineage": getattr(public, "batch_lineage", None),
                PUBLISHED_RECORD_TAG: json.dumps(
                    public.model_dump(mode="json", exclude_none=True), sort_keys=True
                ),
                **self._accuracy_tags(loaded.metrics),
            }
        )
        sigma = getattr(record, "noise_multiplier", None)
        ended = ended_ms or int((loaded.path / WEIGHTS_FILE).stat().st_mtime * 1000)
        seconds = tag_float(loaded.metrics.get("train_seconds"))
        run = RunInfo(
            name=f"train σ={sigma:g}" if sigma is not None else f"label {record.name}",
            metrics=scalar_metrics(loaded.metrics) | _privacy_metrics(tags),
            dataset=public.dataset,
            history=history if history is not None else epoch_curves(loaded.metrics),
            started_ms=started_ms or (ended - int(seconds * 1000) if seconds else None),
            ended_ms=ended,
        )
        return self._register(
            name,
            loaded,
            content_hash=content_hash,
            run=run,
            tags=tags,
            params=public.model_dump(mode="json", exclude_none=True),
            record_bytes=(loaded.path / RECORD_FILE).read_bytes(),
            description=(
                f"Candidate {record.name}: (ε = {epsilon_text(privacy['epsilon'])}, "
                f"δ = {privacy['delta']:g}) under {str(privacy.get('accountant')).upper()}. "
                "Internal: publishing these weights or metrics voids every guarantee of merges "
                "built from them."
            ),
            card=None,
        )

    def prepare_merged(
        self,
        model_dir: str | Path,
        *,
        parents: Sequence[str | int],
        policy: Mapping[str, Any] | BaseModel,
        parent_model: str | None = None,
        name: str | None = None,
        ledger: Mapping[str, Any] | None = None,
        notes: Sequence[str] = (),
        internal_notes: Sequence[str] = (),
    ) -> MergedRelease:
        """Check a merged directory for registration and describe it: its identity (the
        release hash: candidates, method, weights, δ and bound, never the target), its public
        card and its internal record (:mod:`dpmerge.registry.merged`). Registers nothing.

        ``parents`` are the candidate versions (of ``parent_model``, default the candidates'
        registered model) the merge used, one per report candidate. ``policy`` (a
        ``dpmerge.policies.Policy`` or a mapping) needs ``target_epsilon`` and ``target_delta``;
        its ``name`` (or ``id``) is shown on the cards as the policy that asked for the release.
        ``ledger`` is the cumulative release bound to show (see :func:`build_privacy_card`),
        ``notes`` go on both cards, ``internal_notes`` on the internal one only."""
        if isinstance(policy, BaseModel):
            policy = policy.model_dump(mode="json")
        merged = MergedDir.read(model_dir, policy, self.keys)
        dataset, model = merged.dataset, merged.loaded.spec.label
        parent_model = parent_model or candidate_model_name(dataset, model)
        versions = self._parent_versions(parent_model, [str(p) for p in parents], merged.names)
        name = name or merged_model_name(dataset, model)
        return MergedRelease(
            merged,
            name,
            parent_model,
            versions,
            merged.request_hash(parent_model, versions),
            merged.public_card(name, ledger, notes),
            merged.internal_card(name, versions, ledger, (*internal_notes, *notes)),
        )

    def register_merged(
        self,
        release: MergedRelease,
        *,
        started_ms: int | None = None,
        ended_ms: int | None = None,
    ) -> RegisteredVersion:
        """Register ``release`` (from :meth:`prepare_merged`) with its public card, idempotent
        on its release hash; the run spans ``started_ms``..``ended_ms`` (the merge)."""
        merged, card = release.merged, release.public
        tags = merged.tags(self._accuracy_tags(merged.public_metrics))
        tags["dp.card_digest"] = manifests.card_digest(card.description(), card.data)
        requester = f"policy-{merged.policy_id}" if merged.policy_id else "merge"
        run = RunInfo(
            name=f"{requester} ε*={merged.target_epsilon:g}",
            metrics=scalar_metrics(merged.public_metrics) | _privacy_metrics(tags),
            dataset=merged.dataset,
            started_ms=started_ms,
            ended_ms=ended_ms,
        )
        return self._register(
            release.name,
            merged.loaded,
            content_hash=release.content_hash,
            run=run,
            tags=tags,
            params=merged.params(),
            record_bytes=merged.public_record(),
            description=card.description(),
            card=card,
        )

    def _parent_versions(
        self, parent_model: str, parents: Sequence[str], names: Sequence[str]
    ) -> dict[str, str]:
        """Candidate name -> version, checking each parent is a ready candidate of the merge."""
        by_name: dict[str, str] = {}
        found = self.get_versions(parent_model, parents)
        for version, tags in zip(parents, (v.tags for v in found), strict=True):
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
        run: RunInfo,
        tags: dict[str, str],
        params: Mapping[str, Any],
        record_bytes: bytes,
        description: str,
        card: PrivacyCard | None,
    ) -> RegisteredVersion:
        """Log, sign and register one version: its manifest (:mod:`dpmerge.manifests`) covers
        its facts (every ``dp.*`` tag but the lifecycle ones), its content hash, its logged
        model and the digest of every file of it, signed with the workflow's Ed25519 key."""
        existing = self.find_ready_version(name, content_hash)
        if existing is not None:
            return RegisteredVersion(
                name, str(existing.version), content_hash, existing.run_id, True
            )
        self._retire_abandoned(name, content_hash)
        role = tags["dp.role"]
        experiment_id = self._experiment(*EXPERIMENTS[role])
        self._ensure_registered_model(name, role)
        run_id = self._start_run(experiment_id, run, role, content_hash)
        version: str | None = None
        try:
            logged = self._new_logged_model(experiment_id, run_id, role)
            model_id = logged.model_id
            with ThreadPoolExecutor(1) as beside:  # the run's metrics while the model uploads
                logging = beside.submit(self._log_run, run_id, model_id, run, params, card)
                source, files, digests = self._log_model(
                    logged,
                    run_id,
                    self._module(loaded),
                    loaded,
                    record_bytes,
                    card,
                    run.dataset,
                    self.keys,
                )
                logging.result()
            tags = {**tags, **self._signature(name, model_id, content_hash, tags, digests)}
            with self._errors(f"registering {name}"):
                created = self._client.create_model_version(
                    name,
                    source=source,
                    run_id=run_id,
                    tags={
                        **tags,
                        "dp.content_hash": content_hash,
                        "dp.status": STATUS_REGISTERING,
                        REGISTERING_BY_TAG: f"{socket.gethostname()}:{os.getpid()}",
                    },
                    description=description,
                    model_id=model_id,
                    await_creation_for=0,
                )
            version = str(created.version)
            if created.status != "READY":
                self._wait_ready(name, version, self.ready_timeout_s)
            self._verify(name, version, model_id=model_id, files=files, card=card)
            with self._errors(f"marking {name} v{version} ready"):
                self._client.set_model_version_tag(name, version, "dp.status", STATUS_READY)
        except BaseException as error:
            if version is not None:
                self._mark_failed(name, version)
            self._end_run(run_id, "FAILED")
            if isinstance(error, DPMergeError) or not isinstance(error, Exception):
                raise  # ours, or a cancellation (Ctrl-C, Prefect's TerminationSignal): as it is
            raise registry_error(f"registering {name} failed: {error}", error) from error
        self._end_run(run_id, "FINISHED", run.ended_ms)
        first = self.find_ready_version(name, content_hash)
        if first is not None and first.version != version:  # a concurrent registration won
            self._mark_failed(name, version, f"duplicate of v{first.version}")
            return RegisteredVersion(name, first.version, content_hash, first.run_id, True)
        return RegisteredVersion(name, version, content_hash, run_id, False)

    def _start_run(self, experiment_id: str, run: RunInfo, role: str, content_hash: str) -> str:
        with self._errors(f"starting run {run.name!r}"):
            created = self._client.create_run(
                experiment_id,
                run_name=run.name,
                start_time=run.started_ms,
                tags={"dp.role": role, "dp.content_hash": content_hash},
            )
        self._remember_run(created.info)
        return created.info.run_id

    def _log_run(
        self,
        run_id: str,
        model_id: str,
        run: RunInfo,
        params: Mapping[str, Any],
        card: PrivacyCard | None,
    ) -> None:
        """Metrics (and their per-epoch histories), params, the training data as a dataset
        input, and the card as run artifacts."""
        stamp = run.ended_ms or int(time.time() * 1000)
        # a metric with a per-epoch curve is its curve (its last point is the final value)
        metrics = [
            Metric(k, v, stamp, 0, model_id=model_id)
            for k, v in run.metrics.items()
            if k not in run.history
        ]
        for key, values in run.history.items():
            metrics += [Metric(key, float(v), stamp, step) for step, v in enumerate(values, 1)]
        digest = run.dataset.rsplit(":", 1)[-1][:32]
        source = {"loader": "dpmerge.data.load_dataset", "name": dataset_name(run.dataset)}
        dataset = Dataset(dataset_name(run.dataset), digest, "dpmerge", json.dumps(source))
        with self._errors(f"logging run {run.name!r}"):
            for start in range(0, len(metrics), 1000):  # MLflow's batch limit
                self._client.log_batch(
                    run_id,
                    metrics=metrics[start : start + 1000],
                    params=[Param(k, str(v)[:6000]) for k, v in params.items()]
                    if not start
                    else [],
                )
            self._log_dataset(run_id, DatasetInput(dataset, [InputTag(DATA_CONTEXT, "training")]))
            if card is not None:
                self._client.log_text(run_id, card.markdown, CARD_MARKDOWN)
                self._client.log_text(run_id, card.to_json(), CARD_JSON)

    def _log_dataset(self, run_id: str, dataset: DatasetInput) -> None:
        """Log the dataset input. Two runs logging a new dataset at once race on MLflow's
        unique (experiment, name, digest) row; the loser's second attempt finds the row."""
        try:
            self._client.log_inputs(run_id, datasets=[dataset])
        except MlflowException:
            self._client.log_inputs(run_id, datasets=[dataset])

    def _signature(
        self,
        name: str,
        model_id: str,
        content_hash: str,
        tags: Mapping[str, str],
        digests: dict[str, str],
    ) -> dict[str, str]:
        """The tags that sign a version being registered (see :meth:`_register`)."""
        manifest = manifests.Manifest(
            model=name,
            logged_model=model_id,
            release=content_hash,
            facts=signed_facts({**tags, "dp.content_hash": content_hash}),
            files=digests,
            card_digest=tags.get("dp.card_digest", ""),
        )
        text, signed = manifests.sign(manifest, self.keys)
        key_id = manifests.fingerprint(manifests.public_key_hex(self.keys))
        return {MANIFEST_TAG: text, SIGNATURE_TAG: signed, KEY_ID_TAG: key_id}

    def _retire_abandoned(self, name: str, content_hash: str) -> None:
        """Mark failed every version of this content left ``registering`` by a registration
        that died: by a process of this host that is gone, or longer ago than
        ``stale_registration_s`` (docs/design.md#registry)."""
        host = socket.gethostname()
        now_ms = time.time() * 1000
        for stored in self.versions_with_hash(name, content_hash):
            if stored.tags.get("dp.status") != STATUS_REGISTERING:
                continue
            owner_host, _, pid = stored.tags.get(REGISTERING_BY_TAG, "").partition(":")
            gone = owner_host == host and pid.isdigit() and not _alive(int(pid))
            age_s = (now_ms - self._created_ms(stored)) / 1000
            if gone or age_s > self.stale_registration_s:
                why = (
                    "its registering process is gone" if gone else f"registering for {age_s:.0f} s"
                )
                self._mark_failed(name, stored.version, f"abandoned: {why}")
                if stored.run_id:
                    self._end_run(stored.run_id, "FAILED")

    def _created_ms(self, stored: StoredVersion) -> float:
        return float(self._version(stored.name, stored.version).creation_timestamp or 0)

    def quarantine(self, name: str, version: str | int, reason: str) -> StoredVersion:
        """Take a candidate or merged version out of use (``dp.status=quarantined``): it is never
        merged, reused or promoted again. For a record that failed verification."""
        stored = self.get_version(name, version)
        with self._errors(f"quarantining {name} v{version}"):
            self._client.set_model_version_tag(name, str(version), "dp.status", STATUS_QUARANTINED)
            self._client.set_model_version_tag(name, str(version), FAILURE_TAG, reason[:1000])
        return stored

    def _accuracy_tags(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``dp.accuracy`` from the first of ``accuracy_keys`` present, and which key it was."""
        flat = scalar_metrics(metrics)
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

    # --- releases: gates and aliases --------------------------------------------------

    def release_facts(self, stored: StoredVersion) -> ReleaseFacts:
        """The signed facts of merged version ``stored`` (gating ε, δ, bound, accuracy, …);
        :class:`~dpmerge.manifests.ReleaseSignatureError` when its manifest does not verify
        under the workflow's public key or its tags differ from it: a tag changed after
        registration, or a version planted by someone without the workflow's key."""
        try:
            self.manifest(stored)
        except manifests.ReleaseSignatureError as error:
            raise manifests.ReleaseSignatureError(
                f"{stored.name} v{stored.version}: {error}; it is never reused or promoted — "
                f"take it out of use with `dpmerge registry quarantine {stored.name} "
                f"{stored.version}`"
            ) from None
        return ReleaseFacts.of(stored)

    def check_gates(
        self,
        name: str,
        version: str | int,
        *,
        target_epsilon: float,
        target_delta: float,
        min_accuracy: float,
        timeout_s: float | None = None,
    ) -> ReleaseFacts:
        """The signed facts of ``version`` once it is READY, if it passes every gate: a ready
        merged version, gating ε ≤ ``target_epsilon``, δ ≤ ``target_delta``, accuracy ≥
        ``min_accuracy``, its stored privacy card agreeing with its signed ε. Raises
        :class:`GateError` listing each failed gate. Changes nothing."""
        version = str(version)
        mv = self._wait_ready(name, version, timeout_s or self.ready_timeout_s)
        stored = StoredVersion.of(mv)
        facts = self.release_facts(stored)
        reasons = []
        if facts.role != ROLE_MERGED:
            reasons.append(f"role is {facts.role!r}, only merged versions are released")
        if stored.tags.get("dp.status") != STATUS_READY:
            reasons.append(f"dp.status is {stored.tags.get('dp.status')!r}, not {STATUS_READY!r}")
        reasons += facts.unmet(target_epsilon, target_delta, min_accuracy)
        if not reasons and mv.run_id:
            card = self._run_json(mv.run_id, CARD_JSON)
            if card.get("guarantee", {}).get("epsilon") != facts.epsilon:
                reasons.append("the stored privacy card disagrees with the version's signed ε")
        if reasons:
            raise GateError(name, version, reasons)
        return facts

    def set_alias(self, name: str, alias: str, version: str | None) -> str | None:
        """Point ``alias`` of ``name`` at ``version`` (``None``: remove it); returns the version
        it named before. Only the projection of a serving pointer
        (docs/design.md#release-state) calls this."""
        previous = self._aliases(name).get(alias)
        if previous == version:
            return previous
        with self._errors(f"setting alias {alias!r} of {name} to {version}"):
            if version is None:
                self._client.delete_registered_model_alias(name, alias)
            else:
                self._client.set_registered_model_alias(name, alias, version)
        return previous

    def set_model_tag(self, name: str, key: str, value: str | None) -> None:
        """Set (``None``: delete) a tag of registered model ``name`` (display only: nothing
        reads these tags to decide anything)."""
        with self._errors(f"tagging {name}"):
            if value is None:
                if key in (self._model_tags(name) or {}):
                    self._client.delete_registered_model_tag(name, key)
            else:
                self._client.set_registered_model_tag(name, key, tag_value(value))

    # --- reports -----------------------------------------------------------------------

    def log_report(
        self,
        experiment: str,
        *,
        run_name: str,
        tags: Mapping[str, str],
        params: Mapping[str, str],
        files: Sequence[str | Path],
    ) -> str:
        """Log ``files`` and ``params`` to a new finished run of ``experiment`` (its artifacts
        under the ``reports/`` prefix, internal like the candidates); returns the run id."""
        experiment_id = self._experiment(experiment, REPORTS_PREFIX)
        with self._errors(f"logging report {run_name!r}"):
            run = self._client.create_run(experiment_id, run_name=run_name, tags=dict(tags))
            run_id = run.info.run_id
            for path in files:
                self._client.log_artifact(run_id, str(path))
            for key, value in params.items():
                self._client.log_param(run_id, key, value)
            self._client.set_terminated(run_id, "FINISHED")
        return run_id


def _privacy_metrics(tags: Mapping[str, str]) -> dict[str, float]:
    """The run metrics that copy a version's privacy tags (ε under each analysis, δ)."""
    values = {metric: tag_float(tags.get(tag)) for metric, tag in PRIVACY_METRICS.items()}
    return {k: v for k, v in values.items() if v is not None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
