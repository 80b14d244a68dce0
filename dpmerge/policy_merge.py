"""Apply a privacy policy to the registered candidates: calibrate, merge, evaluate, register,
promote (SPEC §4–§7). Library code, no Prefect: ``flows/merge.py`` runs these steps as tasks.

The steps, in order:

1. :func:`find_candidates` — the ready candidate versions of the policy's dataset and model.
2. :func:`load_evaluation_data` — the splits the candidates were trained with (found by their
   fingerprint), for validation utilities (SPEC §4: disjoint from training) and test accuracy.
3. :func:`calibrate_policy` — ``method: auto`` calibrates RS (utilities: the candidates'
   validation accuracies) and LC (utility: the merged weights' validation accuracy) and keeps
   the better expected validation accuracy; ties go to LC (no secret draw). Infeasible targets
   raise :class:`~dpmerge.errors.InfeasibleTargetError` with the reachable range.
4. :func:`merge_request` — the merge request's content hash; :func:`find_release` reuses a ready
   version of the same request (a re-run never draws again).
5. :func:`merge_release` — merge and evaluate; for RS the drawn index goes to a 0600 audit file,
   which :func:`store_audit` keeps under ``<home>/audit`` (embedded) or moves to the audit bucket.
   :class:`Release` carries only public facts (never the draw).
6. :func:`register_release` — the merged version with its privacy card and the cumulative
   ledger bound (SPEC §7).
7. :func:`promote_release` — the ledger cap, then the registry's gates (ε ≤ target, δ, accuracy ≥
   ``min_accuracy``, card consistent), then the alias; the release enters the ledger only once
   promoted (if that write fails the alias is put back).

A policy event can arrive late (two events back to back may run in either order): every alias
change records the event time on the merged registered model (tag ``dp.alias_time.<alias>``)
and an older event never moves or removes the alias again (status ``superseded``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import torch
from mlflow.exceptions import MlflowException

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.ledger import Release as LedgerRelease
from dpmerge.accounting.ledger import ReleaseLedger, release_of
from dpmerge.accounting.records import Candidate
from dpmerge.artifacts import ModelSpec, load_model_dir
from dpmerge.data import DatasetSplits, Split, load_dataset
from dpmerge.errors import DatasetError, DPMergeError, InfeasibleTargetError, RefusalError
from dpmerge.evaluation import evaluate
from dpmerge.merging import merge_model_dirs
from dpmerge.policies import Policy
from dpmerge.registry import (
    GateError,
    RegisteredCandidate,
    Registry,
    RegistryError,
    candidate_content_hash,
    candidate_model_name,
    merge_request_hash,
    merged_model_name,
)
from dpmerge.storage import ObjectExistsError, S3Config, S3Store, StorageError

HOME_ENV = "DPMERGE_HOME"
DATA_ROOT_ENV = "DPMERGE_DATA_ROOT"
DEFAULT_HOME = ".dpmerge"
LEDGER_KEY = "ledger/releases.json"
ALIAS_TIME_TAG = "dp.alias_time."
VALIDATION_FRACTION = 0.1
SPLIT_SEED = 0
POLICY_REQUEST_KEYS = ("name", "target_epsilon", "target_delta", "dataset", "model", "method")
"""The policy fields that define a merge request (with ``gating_bound``): changing a gate
(``min_accuracy``, the cap) or the alias re-gates the same release instead of drawing again."""

Status = Literal["promoted", "unchanged", "not_promoted", "infeasible", "superseded"]


class PolicyNotMetError(DPMergeError):
    """The policy's merged model was not promoted (a gate failed); ``outcome`` says why."""

    def __init__(self, message: str, outcome: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.outcome = dict(outcome or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcome))


class PolicyInfeasibleError(InfeasibleTargetError):
    """No merge meets the policy's target; the alias was revoked or kept per ``on_infeasible``."""

    def __init__(self, message: str, outcome: Mapping[str, Any]) -> None:
        low, high = outcome.get("reachable_epsilon_range") or (math.nan, math.nan)
        super().__init__(
            message,
            target_epsilon=float(outcome.get("target_epsilon", math.nan)),
            delta=float(outcome.get("target_delta", math.nan)),
            reachable_epsilon_range=(float(low), float(high)),
        )
        self.outcome = dict(outcome)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcome))


# --- where things live -----------------------------------------------------------------------


def resolve_home(home: str | Path | None = None) -> Path:
    """The local state directory: ``home``, else ``$DPMERGE_HOME``, else ``./.dpmerge``."""
    return Path(home or os.environ.get(HOME_ENV) or Path.cwd() / DEFAULT_HOME).absolute()


def embedded_tracking_uri(home: str | Path | None = None) -> str:
    return f"sqlite:///{resolve_home(home) / 'mlflow.db'}"


@dataclass(frozen=True)
class Workspace:
    """Where a policy merge reads and writes.

    ``tracking_uri``: ``$MLFLOW_TRACKING_URI``, else the embedded ``<home>/mlflow.db`` (artifacts
    in ``<home>/mlartifacts``). ``s3``: set when ``DPMERGE_S3_ENDPOINT_URL`` or
    ``DPMERGE_S3_BUCKET`` is (the local stack sets both): audit records then go to the audit
    bucket and the release ledger to ``s3://<bucket>/ledger/releases.json``; otherwise both stay
    under ``home`` (audit records 0600 in a 0700 directory).
    """

    tracking_uri: str
    home: Path
    s3: S3Config | None = None

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> Workspace:
        home_path = resolve_home(home)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or embedded_tracking_uri(home_path)
        use_s3 = os.environ.get("DPMERGE_S3_ENDPOINT_URL") or os.environ.get("DPMERGE_S3_BUCKET")
        return cls(uri, home_path, S3Config.from_env() if use_s3 else None)

    def registry(self) -> Registry:
        if self.tracking_uri.startswith("sqlite:///"):
            self.home.mkdir(parents=True, exist_ok=True)
        return Registry(self.tracking_uri)

    def store(self) -> S3Store | None:
        return S3Store(self.s3) if self.s3 is not None else None

    def private_dir(self, name: str) -> Path:
        path = self.home / name
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
        return path

    @property
    def cache_dir(self) -> Path:
        """Derived, rebuildable data (evaluation splits)."""
        return self.home / "cache"

    def use_caches(self) -> None:
        """Keep candidates' PLDs under ``cache_dir`` across processes (each flow run is a new
        process; rebuilding five fine PLDs costs seconds of every time-to-policy). The directory
        is private (0700): certified ε values are computed from what it holds."""
        from dpmerge.accounting import pld

        self.private_dir("cache")
        pld.set_disk_cache(self.cache_dir / "pld")

    def scratch(self) -> Path:
        """A new private (0700) working directory the caller removes."""
        return Path(tempfile.mkdtemp(prefix="dpmerge-policy-", dir=self.private_dir("work")))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri,
            "home": str(self.home),
            "s3_endpoint": self.s3.endpoint_url if self.s3 else None,
            "s3_bucket": self.s3.bucket if self.s3 else None,
        }


# --- candidates and data ---------------------------------------------------------------------


@dataclass(frozen=True)
class CandidatePool:
    """The ready candidate versions a policy merges, and where its releases go."""

    registered_model: str
    merged_model: str
    dataset: str  # the training-data fingerprint
    model: str
    versions: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dataset_matches(policy_dataset: str, fingerprint: str) -> bool:
    return fingerprint == policy_dataset or fingerprint.startswith(f"{policy_dataset}-sha256:")


def find_candidates(registry: Registry, dataset: str, model: str) -> CandidatePool:
    """The ready candidates of ``model`` trained on ``dataset`` (a dataset name such as
    ``fashion-mnist``, or a full fingerprint ``fashion-mnist-sha256:…`` to pick one among
    several trainings). Raises :class:`RegistryError` when there are none or the name is
    ambiguous."""
    query = f"tags.`dp.role` = 'candidate' and tags.`dp.model` = '{model.replace(chr(39), '')}'"
    found, token = [], None
    try:
        while True:
            page = registry.client.search_model_versions(query, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                break
    except MlflowException as error:
        raise RegistryError(
            f"searching candidates at {registry.tracking_uri}: {error.message}"
        ) from None
    ready = [
        v
        for v in found
        if v.tags.get("dp.status") == "ready"
        and _dataset_matches(dataset, v.tags.get("dp.dataset", ""))
    ]
    groups: dict[tuple[str, str], list[str]] = {}
    for v in ready:
        groups.setdefault((v.name, v.tags["dp.dataset"]), []).append(str(v.version))
    if not groups:
        raise RegistryError(
            f"no ready candidates of model {model!r} on dataset {dataset!r} at "
            f"{registry.tracking_uri}; train some first (dpmerge demo, or the train-candidates "
            "flow)"
        )
    if len(groups) > 1:
        listed = ", ".join(f"{fp} ({name})" for name, fp in sorted(groups))
        raise RegistryError(
            f"candidates of {model!r} on {dataset!r} come from several trainings: {listed}; "
            "put the fingerprint in the policy's dataset to choose one"
        )
    (name, fingerprint), versions = next(iter(groups.items()))
    return CandidatePool(
        registered_model=name,
        merged_model=merged_model_name(fingerprint, model)
        if name == candidate_model_name(fingerprint, model)
        else f"{name}-merged",
        dataset=fingerprint,
        model=model,
        versions=tuple(sorted(versions, key=int)),
    )


def load_candidates(
    registry: Registry,
    pool: CandidatePool,
    dest: str | Path,
    *,
    cache_dir: str | Path | None = None,
) -> list[RegisteredCandidate]:
    """The pool's candidate versions as model directories. A registered version never changes,
    so with ``cache_dir`` each one is kept there under its content hash and reused when the
    files still hash to the version's ``dp.content_hash`` (otherwise downloaded again)."""
    if cache_dir is None:
        return registry.load_candidates(pool.registered_model, pool.versions, dest=dest)
    cache = Path(cache_dir)
    found: dict[str, RegisteredCandidate] = {}
    missing = []
    for version in pool.versions:
        try:
            mv = registry.client.get_model_version(pool.registered_model, version)
        except MlflowException as error:
            raise RegistryError(
                f"reading {pool.registered_model} v{version}: {error.message}"
            ) from None
        content_hash = mv.tags.get("dp.content_hash", "")
        path = cache / content_hash
        ready = mv.tags.get("dp.role") == "candidate" and mv.tags.get("dp.status") == "ready"
        if ready and content_hash and path.is_dir():
            with suppress(DPMergeError, OSError):
                if candidate_content_hash(path) == content_hash:
                    model_dir = load_model_dir(path)
                    found[version] = RegisteredCandidate(pool.registered_model, version, model_dir)
                    continue
        missing.append(version)
    if missing:
        for item in registry.load_candidates(pool.registered_model, missing, dest=dest):
            found[item.version] = item
            target = cache / candidate_content_hash(item.model_dir.path)
            staging = cache / f".{target.name}.{uuid.uuid4().hex[:8]}"
            shutil.copytree(item.model_dir.path, staging)
            shutil.rmtree(target, ignore_errors=True)  # a stale entry failed its hash check
            with suppress(OSError):
                os.replace(staging, target)
            shutil.rmtree(staging, ignore_errors=True)
    return [found[v] for v in pool.versions]


def _limits_for(train_rows: int) -> list[int]:
    """Row limits ``L`` with ``L - round(L·0.1) = train_rows`` (the validation carve)."""
    guess = train_rows / (1 - VALIDATION_FRACTION)
    return [
        limit
        for limit in range(max(1, math.floor(guess) - 3), math.ceil(guess) + 4)
        if limit - round(limit * VALIDATION_FRACTION) == train_rows
    ]


@lru_cache(maxsize=4)
def _load(name: str, root: str | None, limit: int | None) -> DatasetSplits:
    return load_dataset(
        name, root, seed=SPLIT_SEED, validation_fraction=VALIDATION_FRACTION, limit=limit
    )


@dataclass(frozen=True, eq=False)
class EvaluationData:
    """The held-out splits of the candidates' training data: ``validation`` (carved from the
    training file, disjoint from the training rows: calibration utilities, SPEC §4) and
    ``test`` (reported accuracy). ``fingerprint`` names the training rows they go with."""

    name: str
    fingerprint: str
    validation: Split
    test: Split


def _cache_file(cache_dir: Path, fingerprint: str, limit: int | None) -> Path:
    return cache_dir / f"{fingerprint.replace(':', '-')}-{limit or 'all'}.safetensors"


def load_evaluation_data(
    fingerprint: str,
    train_rows: int | None,
    *,
    root: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> EvaluationData:
    """The validation and test splits that go with training rows of ``fingerprint``
    (dpmerge's default split: seed 0, 10 % validation; a ``--limit`` run is recognised from its
    number of training rows, the match checked by fingerprint). ``root`` defaults to
    ``$DPMERGE_DATA_ROOT`` or the dataset's own place. With ``cache_dir`` the two splits are
    kept there (safetensors, keyed by fingerprint and limit) and read back next time."""
    from safetensors.torch import load_file, save_file

    name = fingerprint.split("-sha256:")[0]
    root = str(root or os.environ.get(DATA_ROOT_ENV) or "") or None
    limits: list[int | None] = [*_limits_for(train_rows)] if train_rows else []
    limits.append(None)
    if cache_dir is not None:
        for limit in limits:
            cached = _cache_file(Path(cache_dir), fingerprint, limit)
            if cached.is_file():
                with suppress(Exception):  # unreadable: rebuilt below
                    t = load_file(str(cached))
                    return EvaluationData(
                        name,
                        fingerprint,
                        Split(t["validation_x"], t["validation_y"]),
                        Split(t["test_x"], t["test_y"]),
                    )
    for limit in limits:
        data = _load(name, root, limit)
        if data.fingerprint == fingerprint:
            found = EvaluationData(name, fingerprint, data.validation, data.test)
            if cache_dir is not None:
                target = _cache_file(Path(cache_dir), fingerprint, limit)
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
                save_file(
                    {
                        "validation_x": data.validation.features.contiguous(),
                        "validation_y": data.validation.labels.contiguous(),
                        "test_x": data.test.features.contiguous(),
                        "test_y": data.test.labels.contiguous(),
                    },
                    str(staging),
                )
                os.replace(staging, target)
            return found
    raise DatasetError(
        f"no split of dataset {name!r} (root {root or 'default'}) has the candidates' training "
        f"fingerprint {fingerprint}; validation utilities need the data they were trained on "
        f"(set {DATA_ROOT_ENV} if it lives elsewhere)"
    )


def start_export_warmup() -> threading.Thread:
    """Warm up ``torch.export`` (the registry saves pt2 models; the first export in a process
    costs seconds, mostly imports and first tracing) in a background thread, to overlap it with
    waiting on MLflow and the disk. Join it before anything CPU-bound and before registering
    (``torch.export`` is not thread-safe)."""

    def warm() -> None:
        with suppress(Exception):  # only a warm-up: the real export reports its own errors
            module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)).eval()
            torch.export.export(module, (torch.zeros((2, 1, 2, 2)),))

    thread = threading.Thread(target=warm, name="dpmerge-export-warmup", daemon=True)
    thread.start()
    return thread


def prime_caches(workspace: Workspace, dataset: str, model: str) -> CandidatePool:
    """Fill this host's caches for the next policy merge of ``dataset``/``model``: the candidate
    directories, the evaluation split and the candidates' PLDs (fine and coarse). The training
    flow calls it once its candidates are registered, so the first policy event after new
    candidates is as quick as the later ones."""
    from dpmerge.accounting import pld as pld_mod

    workspace.use_caches()
    registry = workspace.registry()
    pool = find_candidates(registry, dataset, model)
    scratch = workspace.scratch()
    try:
        candidates = load_candidates(
            registry, pool, scratch, cache_dir=workspace.cache_dir / "candidates"
        )
        records = [c.model_dir.record for c in candidates]
        load_evaluation_data(
            pool.dataset, getattr(records[0], "dataset_size", None), cache_dir=workspace.cache_dir
        )
        for record in records:
            for discretisation in (pld_mod.FINE_DISCRETISATION, pld_mod.COARSE_DISCRETISATION):
                with suppress(ValueError):  # an RDP-only label has no PLD
                    pld_mod.candidate_pld(record, discretisation)
    finally:
        remove_tree(scratch)
    return pool


@dataclass(frozen=True)
class Prepared:
    """What a policy merge works on: the pool, and unless a later event already set the
    alias (``superseded_by``), the loaded candidates and the evaluation split."""

    pool: CandidatePool
    superseded_by: str | None = None
    candidates: tuple[RegisteredCandidate, ...] = ()
    data: EvaluationData | None = None


def prepare(workspace: Workspace, policy: Policy, occurred: datetime, dest: str | Path) -> Prepared:
    """Steps 1–2 for ``policy``: find the candidates, stop if a later event already set the
    alias, else load the candidates (cached by content hash) and the evaluation split."""
    registry = workspace.registry()
    pool = find_candidates(registry, policy.dataset, policy.model)
    later = superseded_by(registry, pool.merged_model, str(policy.alias), occurred)
    if later is not None:
        return Prepared(pool, superseded_by=later)
    candidates = load_candidates(registry, pool, dest, cache_dir=workspace.cache_dir / "candidates")
    first = candidates[0].model_dir.record
    data = load_evaluation_data(
        pool.dataset, getattr(first, "dataset_size", None), cache_dir=workspace.cache_dir
    )
    return Prepared(pool, None, tuple(candidates), data)


def plan_release(
    workspace: Workspace, request: MergeRequest, entry: LedgerRelease, policy: Policy
) -> tuple[Registered | None, dict[str, Any] | None]:
    """The ready version of this request if one exists (then nothing is merged), else the
    cumulative ledger bound the new release's card will show."""
    found = find_release(workspace.registry(), request)
    if found is not None:
        return found, None
    return None, ledger_summary(
        workspace, entry, policy.target_delta, policy.cumulative_epsilon_cap
    )


# --- calibration -----------------------------------------------------------------------------


class _Merges:
    """Accuracy of in-memory LC merges of the candidates, cached by weights."""

    def __init__(self, candidates: Sequence[RegisteredCandidate]) -> None:
        specs = {c.model_dir.spec for c in candidates}
        if len(specs) != 1:
            raise RefusalError("the candidates do not share one architecture")
        self.spec: ModelSpec = specs.pop()
        self.states = [c.model_dir.weights for c in candidates]
        self._cache: dict[tuple[tuple[float, ...], int], float] = {}

    def state(self, weights: Sequence[float]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for state, weight in zip(self.states, weights, strict=True):
            if weight == 0:
                continue
            for key, tensor in state.items():
                value = tensor.double() * weight
                merged[key] = merged[key] + value if key in merged else value
        reference = self.states[0]
        return {k: v.to(reference[k].dtype) for k, v in merged.items()}

    def accuracy(self, weights: Sequence[float], split: Split) -> float:
        key = (tuple(round(float(w), 12) for w in weights), id(split))
        if key not in self._cache:
            scores = evaluate((self.spec, self.state(weights)), split)
            self._cache[key] = float(scores["accuracy"])
        return self._cache[key]


@dataclass(frozen=True)
class PolicyPlan:
    """The chosen calibration and how the methods compared (internal statistics: they are
    computed from every candidate, so they stay out of the public card)."""

    calibration: Calibration
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.calibration.method


def calibrate_policy(
    policy: Policy, candidates: Sequence[RegisteredCandidate], data: EvaluationData
) -> PolicyPlan:
    """Calibrate ``policy``'s method (``auto``: RS and LC, the better expected validation
    accuracy wins; ties go to LC) at (ε*, δ*) with the policy's gating bound for LC."""
    records: list[Candidate] = []
    for c in candidates:
        if c.model_dir.record is None:
            raise RefusalError(f"{c.name} v{c.version} is not a candidate")
        records.append(c.model_dir.record)
    merges = _Merges(candidates)
    k = len(candidates)
    one_hot = [tuple(1.0 if n == i else 0.0 for n in range(k)) for i in range(k)]
    utilities = [merges.accuracy(w, data.validation) for w in one_hot]
    methods = ("lc", "rs") if policy.method == "auto" else (policy.method,)
    results: dict[str, Calibration] = {}
    compared: dict[str, dict[str, Any]] = {}
    for method in methods:
        result = calibrate(
            records,
            method,  # type: ignore[arg-type]
            policy.target_epsilon,
            policy.target_delta,
            gating_bound=policy.gating_bound if method == "lc" else "generic",
            utilities=utilities if method == "rs" else None,
            merge_utility=(lambda w: merges.accuracy(w, data.validation))
            if method == "lc"
            else None,
        )
        results[method] = result
        compared[method] = {
            "epsilon": result.epsilon,
            "bound": result.report.gating.kind,
            "expected_validation_accuracy": result.utility,
            "utility_kind": result.utility_kind,
        }
    best = max(
        methods,
        key=lambda m: (
            -math.inf if results[m].utility is None else results[m].utility,
            m == "lc",
        ),
    )
    return PolicyPlan(results[best], compared)


# --- the merge request, the release and its audit record ---------------------------------


def policy_document(policy: Policy) -> dict[str, Any]:
    """What of the policy enters the merge request (and the registry's ``policy`` param)."""
    document = {key: getattr(policy, key) for key in POLICY_REQUEST_KEYS}
    document["gating_bound"] = policy.gating_bound
    document["id"] = policy.name
    return document


@dataclass(frozen=True)
class MergeRequest:
    pool: CandidatePool
    parents: tuple[str, ...]  # candidate versions in the calibration's order
    policy: dict[str, Any]
    content_hash: str


def merge_request(
    policy: Policy, pool: CandidatePool, candidates: Sequence[RegisteredCandidate], plan: PolicyPlan
) -> MergeRequest:
    """The request identity :meth:`Registry.register_merged` will hash (the same fields)."""
    report = plan.calibration.report.to_dict()
    parents = tuple(c.version for c in candidates)
    document = policy_document(policy)
    content_hash = merge_request_hash(
        parent_model=pool.registered_model,
        parents=parents,
        method=report["method"],
        weights=report["weights"],
        delta=report["delta"],
        bound=report["bound"],
        policy=document,
    )
    return MergeRequest(pool, parents, document, content_hash)


@dataclass(frozen=True)
class Release:
    """A merged model directory ready to register. Public facts only: for RS the drawn index
    went to ``audit_file`` (0600) and is not held here."""

    path: Path
    method: str
    weights: tuple[float, ...]
    epsilon: float
    accountant: str | None
    delta: float
    bound: str
    metrics: dict[str, Any]
    audit_file: Path | None = None


def evaluation_metrics(data: EvaluationData) -> Any:
    """The merged model's public metrics: validation and test accuracy and loss."""

    def metrics(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for split_name in ("validation", "test"):
            scores = evaluate((spec, weights), getattr(data, split_name))
            result[f"{split_name}_accuracy"] = scores["accuracy"]
            result[f"{split_name}_loss"] = scores["loss"]
            result[f"{split_name}_n"] = scores["n"]
        return result

    return metrics


def merge_release(
    request: MergeRequest,
    candidates: Sequence[RegisteredCandidate],
    plan: PolicyPlan,
    data: EvaluationData,
    workdir: str | Path,
    *,
    audit_dir: str | Path,
) -> Release:
    """Merge (RS draws here, once) and evaluate into ``workdir/release``. For RS the audit
    record (drawn index, probabilities, request hash) goes to a new 0600 file in ``audit_dir``."""
    calibration = plan.calibration
    out = Path(workdir) / "release"
    audit_file = None
    if calibration.method == "rs":
        audit_file = Path(audit_dir) / f"{request.content_hash}.{uuid.uuid4().hex[:8]}.json"
    result = merge_model_dirs(
        [c.model_dir.path for c in candidates],
        calibration.method,
        calibration,
        out,
        delta=calibration.delta,
        gating_bound=calibration.report.gating.kind if calibration.method == "lc" else "generic",
        metrics=evaluation_metrics(data),
        audit_path=audit_file,
        audit_notes={
            "content_hash": request.content_hash,
            "policy": request.policy["id"],
            "parent_model": request.pool.registered_model,
            "parents": list(request.parents),
        },
    )
    report = result.report
    return Release(
        path=result.path,
        method=result.method,
        weights=tuple(result.weights),
        epsilon=report.epsilon,
        accountant=report.gating.accountant,
        delta=report.delta,
        bound=report.gating.kind,
        metrics=dict(result.metrics),
        audit_file=audit_file,
    )


def store_audit(workspace: Workspace, release: Release) -> str | None:
    """Put an RS release's audit record where it belongs and return its location: the
    restricted audit bucket (once; the local file is then deleted) or, embedded, the 0600
    file under ``<home>/audit`` (already there)."""
    if release.audit_file is None:
        return None
    store = workspace.store()
    if store is None:
        return str(release.audit_file)
    release_id = release.audit_file.name.removesuffix(".json")
    record = json.loads(release.audit_file.read_text())
    record.pop("release", None)  # a local scratch path, meaningless elsewhere
    try:
        uri = store.write_audit_record(release_id, record)
    except ObjectExistsError:  # a retried write whose first attempt went through
        if store.read_audit_record(release_id) != record:
            raise
        uri = f"s3://{store.config.audit_bucket}/releases/{release_id}.json"
    release.audit_file.unlink(missing_ok=True)
    return uri


# --- the release ledger (SPEC §7) ------------------------------------------------------------


@contextmanager
def open_ledger(workspace: Workspace) -> Iterator[ReleaseLedger]:
    """The release ledger: ``s3://<bucket>/ledger/releases.json`` when S3 is configured, else
    ``<home>/ledger.json``. Changes are written back when the block ends without error. Writers
    are serialised by the merge deployment's concurrency limit of 1."""
    store = workspace.store()
    if store is None:
        workspace.home.mkdir(parents=True, exist_ok=True)
        yield ReleaseLedger(workspace.home / "ledger.json")
        return
    with tempfile.TemporaryDirectory(prefix="dpmerge-ledger-") as scratch:
        path = Path(scratch) / "ledger.json"
        before = None
        if store.exists(LEDGER_KEY):
            before = store.get_bytes(LEDGER_KEY)
            path.write_bytes(before)
        yield ReleaseLedger(path)
        if path.exists() and path.read_bytes() != before:
            store.put_bytes(LEDGER_KEY, path.read_bytes(), content_type="application/json")


def ledger_release(
    request: MergeRequest, candidates: Sequence[RegisteredCandidate], plan: PolicyPlan
) -> LedgerRelease:
    records = [c.model_dir.record for c in candidates]
    return release_of(
        request.content_hash,
        plan.calibration.method,
        records,  # type: ignore[arg-type]
        plan.calibration.weights,
    )


def ledger_summary(
    workspace: Workspace, release: LedgerRelease, delta: float, cap: float | None
) -> dict[str, Any]:
    """The cumulative bound with ``release`` added (for the card); no cap applied here."""
    with open_ledger(workspace) as ledger:
        others = [r for r in ledger.releases(release.dataset) if r.release_id != release.release_id]
        bound = ledger.check(release, delta, None)
    names = sorted({c.name for r in [*others, release] for c in r.candidates})
    return {
        "epsilon": bound.epsilon,
        "delta": delta,
        "accountant": bound.accountant,
        "candidates": names,
        "releases": len(others) + 1,
        "cap": cap,
    }


# --- registration, promotion, revocation -------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    reused: bool
    epsilon: float | None
    accuracy: float | None
    content_hash: str


def find_release(registry: Registry, request: MergeRequest) -> Registered | None:
    """The ready version of this exact request, if one was registered before."""
    found = registry.find_ready_version(request.pool.merged_model, request.content_hash)
    if found is None:
        return None
    return Registered(
        name=request.pool.merged_model,
        version=str(found.version),
        reused=True,
        epsilon=_float(found.tags.get("dp.epsilon")),
        accuracy=_float(found.tags.get("dp.accuracy")),
        content_hash=request.content_hash,
    )


def register_release(
    registry: Registry, request: MergeRequest, release: Release, ledger: Mapping[str, Any] | None
) -> Registered:
    registered = registry.register_merged(
        release.path,
        parents=request.parents,
        policy=request.policy,
        parent_model=request.pool.registered_model,
        name=request.pool.merged_model,
        ledger=ledger,
    )
    if registered.content_hash != request.content_hash:  # the two hashes must agree
        raise RegistryError(
            f"{registered.name} v{registered.version}: content hash differs from the request's"
        )
    mv = registry.client.get_model_version(registered.name, registered.version)
    return Registered(
        name=registered.name,
        version=registered.version,
        reused=registered.reused,
        epsilon=_float(mv.tags.get("dp.epsilon")),
        accuracy=_float(mv.tags.get("dp.accuracy")),
        content_hash=registered.content_hash,
    )


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def parse_time(value: str | datetime | None) -> datetime:
    """An event time (ISO 8601, naive means UTC); ``None`` is now."""
    if value is None or value == "":
        return datetime.now(UTC)
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _model_tags(registry: Registry, name: str) -> dict[str, str] | None:
    try:
        return dict(registry.client.get_registered_model(name).tags)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise RegistryError(f"reading registered model {name}: {error.message}") from None


def superseded_by(registry: Registry, name: str, alias: str, occurred: datetime) -> str | None:
    """The time of a *later* policy event that already set ``alias``, else ``None``."""
    tags = _model_tags(registry, name) or {}
    applied = tags.get(ALIAS_TIME_TAG + alias)
    if applied and parse_time(applied) > occurred:
        return applied
    return None


def mark_alias_time(registry: Registry, name: str, alias: str, occurred: datetime) -> None:
    try:
        registry.client.set_registered_model_tag(name, ALIAS_TIME_TAG + alias, occurred.isoformat())
    except MlflowException as error:
        raise RegistryError(f"tagging {name} with the policy time: {error.message}") from None


@dataclass(frozen=True)
class PolicyOutcome:
    """What applying a policy did. JSON-safe; holds no RS draw."""

    policy: str
    status: Status
    alias: str
    target_epsilon: float
    target_delta: float
    merged_model: str | None = None
    version: str | None = None
    previous_version: str | None = None
    reused: bool = False
    method: str | None = None
    weights: tuple[float, ...] | None = None
    epsilon: float | None = None
    accountant: str | None = None
    bound: str | None = None
    test_accuracy: float | None = None
    validation_accuracy: float | None = None
    cumulative_epsilon: float | None = None
    candidates: tuple[str, ...] = ()
    reachable_epsilon_range: tuple[float, float] | None = None
    revoked_version: str | None = None
    reasons: tuple[str, ...] = ()
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("weights", "candidates", "reachable_epsilon_range", "reasons"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data


def promote_release(
    workspace: Workspace,
    registry: Registry,
    policy: Policy,
    registered: Registered,
    ledger_entry: LedgerRelease,
    occurred: datetime,
) -> tuple[Status, str | None, tuple[str, ...], float | None]:
    """Gates, alias, ledger. Returns (status, previous version, reasons, cumulative ε).

    Order: a later event already applied → ``superseded``; the ledger cap (SPEC §7); the
    registry's gates (:meth:`Registry.promote`); then the release is recorded in the ledger. If
    recording fails the alias is moved back and the error raised: a release is never served
    without being counted."""
    alias = str(policy.alias)
    later = superseded_by(registry, registered.name, alias, occurred)
    if later is not None:
        return "superseded", None, (f"a later policy event ({later}) already set {alias!r}",), None
    promotion = None
    try:
        with open_ledger(workspace) as ledger:  # written back when the block ends
            try:
                ledger.check(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
            except RefusalError as refusal:
                return "not_promoted", None, (f"release ledger: {refusal}",), None
            try:
                promotion = registry.promote(
                    registered.name,
                    registered.version,
                    alias,
                    target_epsilon=policy.target_epsilon,
                    target_delta=policy.target_delta,
                    min_accuracy=policy.min_accuracy,
                )
            except GateError as gate:
                return "not_promoted", None, gate.reasons, None
            bound = ledger.record(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
    except BaseException:
        if promotion is not None and promotion.changed:
            with suppress(MlflowException):
                if promotion.previous is None:
                    registry.client.delete_registered_model_alias(registered.name, alias)
                else:
                    registry.client.set_registered_model_alias(
                        registered.name, alias, promotion.previous
                    )
        raise
    mark_alias_time(registry, registered.name, alias, occurred)
    status: Status = "promoted" if promotion.changed else "unchanged"
    return status, promotion.previous, (), bound.epsilon


def handle_infeasible(
    registry: Registry,
    policy: Policy,
    pool: CandidatePool,
    error: InfeasibleTargetError,
    occurred: datetime,
) -> PolicyOutcome:
    """``on_infeasible``: ``revoke`` removes the policy's alias (a model that violates the
    current policy must not stay served), ``keep`` leaves it. Nothing is registered."""
    alias = str(policy.alias)
    low, high = error.reachable_epsilon_range
    base = dict(
        policy=policy.name,
        alias=alias,
        target_epsilon=policy.target_epsilon,
        target_delta=policy.target_delta,
        merged_model=pool.merged_model,
        reachable_epsilon_range=(float(low), float(high)),
    )
    later = superseded_by(registry, pool.merged_model, alias, occurred)
    if later is not None:
        reason = f"a later policy event ({later}) already set {alias!r}"
        return PolicyOutcome(status="superseded", reasons=(reason, str(error)), **base)
    revoked = None
    if policy.on_infeasible == "revoke" and _model_tags(registry, pool.merged_model) is not None:
        revoked = registry.revoke(pool.merged_model, alias)
        mark_alias_time(registry, pool.merged_model, alias, occurred)
    action = (
        f"alias {alias!r} removed (was v{revoked})"
        if revoked
        else "alias kept"
        if policy.on_infeasible == "keep"
        else f"alias {alias!r} was not set"
    )
    return PolicyOutcome(
        status="infeasible", revoked_version=revoked, reasons=(str(error), action), **base
    )


def remove_tree(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def is_transient(error: BaseException) -> bool:
    """Worth retrying: network and server trouble, not a refusal or a bad input."""
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    if isinstance(error, StorageError):
        return "unreachable" in str(error) or "S3 error" in str(error)
    if isinstance(error, RegistryError) and not isinstance(error, GateError):
        text = str(error).lower()
        return any(
            marker in text
            for marker in (
                "unreachable",
                "connection",
                "timed out",
                "timeout",
                "max retries",
                "temporarily",
                " 502",
                " 503",
                " 504",
                "database is locked",
            )
        )
    return False
