"""The merge request and the release (steps 4–5): the request's content hash, the merge and its
evaluation, and for RS the audit record with the drawn index (never in :class:`Release`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpmerge.artifacts import ModelSpec
from dpmerge.evaluation import evaluate
from dpmerge.merging import merge_model_dirs
from dpmerge.policies import Policy
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import RegisteredCandidate, merge_request_hash
from dpmerge.storage import ObjectExistsError

POLICY_REQUEST_KEYS = ("name", "target_epsilon", "target_delta", "dataset", "model", "method")
"""The policy fields that define a merge request (with ``gating_bound``): changing a gate
(``min_accuracy``, the cap) or the alias re-gates the same release instead of drawing again."""


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
    workspace: Workspace,
    request: MergeRequest,
    candidates: Sequence[RegisteredCandidate],
    plan: PolicyPlan,
    data: EvaluationData,
    workdir: str | Path,
) -> Release:
    """Merge (RS draws here, once) and evaluate into ``workdir/release``. For RS the audit
    record (drawn index, probabilities, request hash) goes to a new 0600 file: under
    ``<home>/audit`` (0700) when no S3 is configured, else in the private ``workdir``, from
    which :func:`store_audit` moves it to the audit bucket."""
    calibration = plan.calibration
    out = Path(workdir) / "release"
    audit_file = None
    if calibration.method == "rs":
        audit_dir = workspace.private_dir("audit") if workspace.s3 is None else Path(workdir)
        audit_file = audit_dir / f"{request.content_hash}.{uuid.uuid4().hex[:8]}.json"
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
