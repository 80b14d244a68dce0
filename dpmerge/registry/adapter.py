"""The :class:`Registry`: register candidates and merges, promote, revoke and restore aliases
with the event time of each change, and log report runs, under the safety rules of
:mod:`dpmerge.registry`; its reads are :class:`~dpmerge.registry.queries.RegistryQueries`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from pydantic import BaseModel
from torch import nn

from dpmerge.artifacts import RECORD_FILE, ModelDir, ModelSpec, load_model_dir
from dpmerge.errors import DPMergeError, RecordError
from dpmerge.formatting import epsilon_text
from dpmerge.privacy_card import PrivacyCard
from dpmerge.registry.connection import CARD_JSON, CARD_MARKDOWN
from dpmerge.registry.errors import GateError, RegistryError, registry_error
from dpmerge.registry.merged import MergedDir
from dpmerge.registry.names import (
    candidate_content_hash,
    candidate_model_name,
    merged_model_name,
)
from dpmerge.registry.queries import RegistryQueries
from dpmerge.registry.tags import (
    ALIAS_TIME_TAG,
    ROLE_CANDIDATE,
    ROLE_MERGED,
    STATUS_READY,
    STATUS_REGISTERING,
    scalar_metrics,
    tag_float,
    tag_values,
)
from dpmerge.registry.versions import Promotion, RegisteredVersion

DEFAULT_EXPERIMENT = "dpmerge-registry"

ModuleBuilder = Callable[[ModelSpec], nn.Module]


class Registry(RegistryQueries):
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
        super().__init__(tracking_uri, experiment, artifact_location)
        self.accuracy_keys = tuple(accuracy_keys)
        self.ready_timeout_s = ready_timeout_s
        self._build_module = build_module

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
        tags = tag_values(
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
                f"Candidate {record.name}: (ε = {epsilon_text(privacy['epsilon'])}, "
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
        merged = MergedDir.read(model_dir, policy)
        dataset, model = merged.dataset, merged.loaded.spec.name
        parent_model = parent_model or candidate_model_name(dataset, model)
        versions = self._parent_versions(parent_model, [str(p) for p in parents], merged.names)
        content_hash = merged.request_hash(parent_model, versions)
        name = name or merged_model_name(dataset, model)
        card = merged.card(name, versions, ledger)
        tags = merged.tags(parent_model, versions, self._accuracy_tags(merged.loaded.metrics))
        return self._register(
            name,
            merged.loaded,
            content_hash=content_hash,
            run_name=f"merge-{content_hash[:12]}",
            tags=tags,
            params=merged.params(parent_model, tags),
            record_bytes=merged.public_record(),
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
            run = self._client.create_run(
                self._experiment(),
                run_name=run_name,
                tags={"dp.role": tags["dp.role"], "dp.content_hash": content_hash},
            )
        run_id = run.info.run_id
        version: str | None = None
        try:
            model_id, source, files = self._log_model(
                run_id, self._module(loaded), loaded, record_bytes, card, tags["dp.role"]
            )
            with self._errors(f"logging metrics and params of {name}"):
                stamp = int(time.time() * 1000)
                self._client.log_batch(
                    run_id,
                    metrics=[
                        Metric(k, v, stamp, 0, model_id=model_id)
                        for k, v in scalar_metrics(loaded.metrics).items()
                    ],
                    params=[Param(k, str(v)[:6000]) for k, v in params.items()],
                )
                if card is not None:
                    self._client.log_text(run_id, card.markdown, CARD_MARKDOWN)
                    self._client.log_text(run_id, card.to_json(), CARD_JSON)
            with self._errors(f"registering {name}"):
                created = self._client.create_model_version(
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
                self._client.set_model_version_tag(name, version, "dp.status", STATUS_READY)
        except BaseException as error:
            if version is not None:
                self._mark_failed(name, version)
            self._end_run(run_id, "FAILED")
            if isinstance(error, DPMergeError | KeyboardInterrupt):
                raise
            raise registry_error(f"registering {name} failed: {error}", error) from error
        self._end_run(run_id, "FINISHED")
        return RegisteredVersion(name, version, content_hash, run_id, False)

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
        epsilon, delta = tag_float(tags.get("dp.epsilon")), tag_float(tags.get("dp.delta"))
        if epsilon is None or epsilon > target_epsilon:
            reasons.append(f"gating ε = {epsilon} exceeds the target {target_epsilon:g}")
        if target_delta is not None and (delta is None or delta > target_delta):
            reasons.append(f"δ = {delta} exceeds the target {target_delta:g}")
        if min_accuracy is not None:
            accuracy = tag_float(tags.get("dp.accuracy"))
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
            self._client.set_registered_model_alias(name, alias, version)
        return Promotion(name, alias, version, previous, changed=True)

    def revoke(self, name: str, alias: str) -> str | None:
        """Remove ``alias`` (policy ``on_infeasible=revoke``); returns the version it named."""
        previous = self._aliases(name).get(alias)
        if previous is not None:
            with self._errors(f"removing alias {alias!r} from {name}"):
                self._client.delete_registered_model_alias(name, alias)
        return previous

    def undo_promotion(self, promotion: Promotion) -> None:
        """Put the alias back where ``promotion`` found it (removed if it named no version): a
        promotion whose release could not be recorded in the ledger is undone."""
        if not promotion.changed:
            return
        with self._errors(f"restoring alias {promotion.alias!r} of {promotion.name}"):
            if promotion.previous is None:
                self._client.delete_registered_model_alias(promotion.name, promotion.alias)
            else:
                self._client.set_registered_model_alias(
                    promotion.name, promotion.alias, promotion.previous
                )

    def alias_time(self, name: str, alias: str) -> datetime | None:
        """The time of the policy event that last changed ``alias`` of ``name`` (the tag
        ``dp.alias_time.<alias>``); ``None`` if none did or there is no such model."""
        stamp = (self._model_tags(name) or {}).get(ALIAS_TIME_TAG + alias)
        if not stamp:
            return None
        try:
            moment = datetime.fromisoformat(stamp)
        except ValueError:
            message = f"{name}: tag {ALIAS_TIME_TAG}{alias} is not a time: {stamp!r}"
            raise RegistryError(message) from None
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)

    def mark_alias_time(self, name: str, alias: str, occurred: datetime) -> None:
        """Record that the policy event at ``occurred`` changed ``alias`` of ``name``."""
        with self._errors(f"tagging {name} with the policy time"):
            self._client.set_registered_model_tag(
                name, ALIAS_TIME_TAG + alias, occurred.isoformat()
            )

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
        """Log ``files`` and ``params`` to a new finished run of ``experiment`` (created with
        the registry's artifact location); returns the run id."""
        with self._errors(f"logging report {run_name!r}"):
            run = self._client.create_run(
                self._experiment(experiment), run_name=run_name, tags=dict(tags)
            )
            run_id = run.info.run_id
            for path in files:
                self._client.log_artifact(run_id, str(path))
            for key, value in params.items():
                self._client.log_param(run_id, key, value)
            self._client.set_terminated(run_id, "FINISHED")
        return run_id
