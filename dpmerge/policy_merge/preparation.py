"""Before a policy merge: the caches primed once candidates are registered, the candidates and
evaluation split loaded for a policy event (steps 1–2, with every check that needs no merge:
alias ownership, the event order, signed records, no fixed seeds), an existing release found or
the ledger bound for a new one with the cap checked before anything is merged or drawn, and the
``torch.export`` warm-up."""

from __future__ import annotations

import threading
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from dpmerge.errors import UnsupportedError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import (
    CandidatePool,
    find_candidates,
    load_candidates,
    refuse_fixed_seeds,
)
from dpmerge.policy_merge.evaluation_data import EvaluationData, load_evaluation_data
from dpmerge.policy_merge.promotion import (
    Registered,
    check_alias_owner,
    find_release,
    superseded_by,
)
from dpmerge.policy_merge.release import MergeRequest
from dpmerge.policy_merge.release_ledger import LedgerEntry, ledger_summary
from dpmerge.policy_merge.workspace import Workspace, remove_tree
from dpmerge.registry import RegisteredCandidate


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
            records[0].dataset,
            getattr(records[0], "dataset_size", None),
            cache_dir=workspace.cache_dir,
        )
        for record in records:
            for discretisation in (pld_mod.FINE_DISCRETISATION, pld_mod.COARSE_DISCRETISATION):
                with suppress(UnsupportedError):  # an RDP-only label has no PLD
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
    """Steps 1–2 for ``policy``: find the candidates; refuse an alias another policy owns
    (:class:`~dpmerge.registry.AliasOwnershipError`); stop if a later event already set the
    alias; else load the candidates (cached by content hash, each verified against its
    signature), refuse fixed-seed candidates, and load the evaluation split (found by the
    candidates' internal fingerprint)."""
    registry = workspace.registry()
    pool = find_candidates(registry, policy.dataset, policy.model)
    check_alias_owner(registry, pool.merged_model, policy)
    later = superseded_by(registry, pool.merged_model, str(policy.alias), occurred)
    if later is not None:
        return Prepared(pool, superseded_by=later)
    candidates = load_candidates(registry, pool, dest, cache_dir=workspace.cache_dir / "candidates")
    refuse_fixed_seeds(candidates)
    first = candidates[0].model_dir.record
    data = load_evaluation_data(
        first.dataset, getattr(first, "dataset_size", None), cache_dir=workspace.cache_dir
    )
    return Prepared(pool, None, tuple(candidates), data)


@dataclass(frozen=True)
class ReleasePlan:
    """Either the ready version of this release registered before (``existing``: reused,
    nothing is merged), or the cumulative ledger bound the new release's card will show, or
    why the ledger cap refuses the new release (``refused``: nothing is merged or drawn)."""

    existing: Registered | None = None
    ledger: dict[str, Any] | None = None
    refused: tuple[str, ...] = ()


def plan_release(
    workspace: Workspace, request: MergeRequest, entry: LedgerEntry, policy: Policy
) -> ReleasePlan:
    """The ready version of this release if one exists (then nothing is merged; its gates are
    checked at promotion), else the ledger bound for the new release's card, checked against
    the cap before any merge, draw or registration."""
    found = find_release(workspace.registry(), request)
    if found is not None:
        return ReleasePlan(existing=found)
    cap = policy.cumulative_epsilon_cap
    summary, refusal = ledger_summary(workspace, entry, policy.target_delta, cap)
    return ReleasePlan(ledger=summary, refused=(refusal,) if refusal else ())
