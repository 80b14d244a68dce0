"""The release (steps 4–5): its identity, the merge and its evaluation. For RS the draw is the
one stored for the release (:mod:`~dpmerge.policy_merge.draws`), never held in
:class:`Release`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpmerge.accounting.calibrated import Calibration
from dpmerge.accounting.private_selection import Selection
from dpmerge.artifacts import ModelSpec
from dpmerge.evaluation import evaluate
from dpmerge.formatting import epsilon_text
from dpmerge.merging import merge_model_dirs
from dpmerge.policies import Policy
from dpmerge.policy_merge.calibration import PolicyPlan
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.draws import stored_accuracy, stored_draw
from dpmerge.policy_merge.evaluation_data import EvaluationData
from dpmerge.registry import RegisteredCandidate, release_hash
from dpmerge.workspace import Workspace

POLICY_REQUEST_KEYS = (
    "name",
    "target_epsilon",
    "target_delta",
    "dataset",
    "model",
    "method",
    "tune_weights",
    "tune",
    "selection_epsilon",
    "evaluation_epsilon",
)
"""The policy fields recorded with a release (its run's ``policy`` param and its card name the
policy that first asked for it); they are not part of the release's identity."""


def policy_document(policy: Policy) -> dict[str, Any]:
    """What of the policy is recorded with a release it asked for."""
    document = {key: getattr(policy, key) for key in POLICY_REQUEST_KEYS}
    document["gating_bound"] = policy.gating_bound
    document["id"] = policy.name
    return document


@dataclass(frozen=True)
class MergeRequest:
    """A release a policy asks for. ``content_hash`` identifies the release: the candidates,
    method, weights, δ and bound (docs/design.md#registry), so two policies whose calibration
    gives the same merge share one version, and it does not depend on an RS draw."""

    pool: CandidatePool
    parents: tuple[str, ...]  # candidate versions in the calibration's order
    policy: dict[str, Any]
    content_hash: str


def merge_request(
    policy: Policy, pool: CandidatePool, candidates: Sequence[RegisteredCandidate], plan: PolicyPlan
) -> MergeRequest:
    """The release identity :meth:`Registry.register_merged` will hash (the same fields)."""
    report = plan.calibration.report.to_dict()
    parents = tuple(c.version for c in candidates)
    selection = None if plan.selection is None else plan.selection.metrics()
    content_hash = release_hash(
        parent_model=pool.registered_model, parents=parents, report=report, selection=selection
    )
    return MergeRequest(pool, parents, policy_document(policy), content_hash)


def spend_note(calibration: Calibration, target_epsilon: float) -> str | None:
    """Why a merge spends less than the target, or ``None`` when it spends (nearly) all of it.
    The calibration keeps the best-utility merge within the target, so a merge below it is where
    that utility peaks: no merge of these candidates that spends more scores better."""
    epsilon = calibration.epsilon
    if epsilon >= target_epsilon * (1 - 1e-3):
        return None
    return (
        f"spends ε = {epsilon_text(epsilon)} of the target ε* = {target_epsilon:g}: the "
        f"calibration's utility ({calibration.utility_kind}) peaks at ε = "
        f"{epsilon_text(epsilon)}; no merge of these candidates that spends more scores better"
    )


@dataclass(frozen=True)
class Release:
    """A merged model directory ready to register. Public facts only: an RS draw is in the
    release's audit record, never here. ``notes`` go on both cards (they follow from the
    records and the target), ``internal_notes`` (e.g. δ against the training rows' number) on
    the internal card only; ``started_ms``/``ended_ms`` time the merge (its MLflow run)."""

    path: Path
    method: str
    weights: tuple[float, ...]
    epsilon: float
    accountant: str | None
    delta: float
    bound: str
    metrics: dict[str, Any]
    notes: tuple[str, ...] = ()
    internal_notes: tuple[str, ...] = ()
    started_ms: int | None = None
    ended_ms: int | None = None


def evaluation_metrics(
    workspace: Workspace,
    request: MergeRequest,
    data: EvaluationData,
    selection: Selection | None = None,
) -> Any:
    """A merged model's metrics: an ε-DP estimate of its test accuracy (the policy's
    ``evaluation_epsilon``; the draw kept once per release, :func:`stored_accuracy`) and n_test.
    No exact test statistic (accuracy, loss) and never a validation split's: a release whose
    weights were tuned on validation rows must not publish their accuracy or count, which its
    guarantee does not cover (docs/design.md#row-protection). A private selection's guarantee
    (``selection``) joins them: the cards' validation row states it."""

    def metrics(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        scores = evaluate((spec, weights), data.test)
        epsilon = request.policy["evaluation_epsilon"]
        estimate = stored_accuracy(
            workspace, request.content_hash, scores["accuracy"], scores["n"], epsilon
        )
        return {**estimate.metrics(), **(selection.metrics() if selection else {})}

    return metrics


def merge_release(
    workspace: Workspace,
    request: MergeRequest,
    candidates: Sequence[RegisteredCandidate],
    plan: PolicyPlan,
    data: EvaluationData,
    workdir: str | Path,
) -> Release:
    """Merge and evaluate into ``workdir/release``. RS uses the draw stored for this release,
    or draws once and stores the draw before using it (:func:`stored_draw`): a retry or a
    concurrent run of the same release releases the same candidate."""
    calibration = plan.calibration
    started = int(time.time() * 1000)
    names = [c.model_dir.record.name for c in candidates if c.model_dir.record is not None]
    rungs = calibration.report.to_dict().get("rungs") if calibration.method == "mixture" else None
    if rungs:  # the mixture draws a merge: the audit record names it by its members
        names = [f"merge {j + 1}: {' + '.join(r['members'])}" for j, r in enumerate(rungs)]
    notes = {
        "policy": request.policy["id"],
        "parent_model": request.pool.registered_model,
        "parents": list(request.parents),
    }
    result = merge_model_dirs(
        [c.model_dir.path for c in candidates],
        calibration.method,
        calibration,
        Path(workdir) / "release",
        delta=calibration.delta,
        gating_bound=calibration.report.gating.kind if calibration.method == "lc" else "generic",
        metrics=evaluation_metrics(workspace, request, data, plan.selection),
        draw=lambda pi: stored_draw(workspace, request.content_hash, names, pi, notes),
    )
    report = result.report
    note = spend_note(calibration, float(request.policy["target_epsilon"]))
    return Release(
        path=result.path,
        method=result.method,
        weights=tuple(result.weights),
        epsilon=report.epsilon,
        accountant=report.gating.accountant,
        delta=report.delta,
        bound=report.gating.kind,
        metrics=dict(result.metrics),
        notes=(note,) if note else (),
        started_ms=started,
        ended_ms=int(time.time() * 1000),
    )
