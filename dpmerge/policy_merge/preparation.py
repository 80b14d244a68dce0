"""Before a policy merge: the caches primed once candidates are registered, the candidates and
evaluation split loaded for a policy event (steps 1–2, with every check that needs no merge:
alias ownership, the event order, signed records, no fixed seeds), an existing release found or
the ledger bound for a new one with the cap checked before anything is merged or drawn, and the
``torch.export`` warm-up."""

from __future__ import annotations

import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from dpmerge.accounting.delta import delta_check_for
from dpmerge.errors import UnsupportedError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import (
    CandidatePool,
    find_candidates,
    load_candidates,
    refuse_fixed_seeds,
)
from dpmerge.policy_merge.evaluation_data import EvaluationData, load_evaluation_data
from dpmerge.policy_merge.ledger import LedgerSummary, ledger_summary
from dpmerge.policy_merge.promotion import Registered, find_release
from dpmerge.policy_merge.release import MergeRequest
from dpmerge.registry import RegisteredCandidate
from dpmerge.state import AliasOwnershipError, CountedRelease
from dpmerge.state import policies as stored_policies
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.serving import read_state
from dpmerge.workspace import Workspace, remove_tree


def start_export_warmup() -> threading.Thread:
    """Warm up ``torch.export`` (the registry saves pt2 models; the first export in a process
    costs seconds) in a background thread, to overlap it with waiting on MLflow and the disk.
    The registry serialises it with its own saves (``torch.export`` is not thread-safe); join
    it before anything CPU-bound."""
    from dpmerge.registry import warm_up_export

    thread = threading.Thread(target=warm_up_export, name="dpmerge-export-warmup", daemon=True)
    thread.start()
    return thread


def prime_caches(
    workspace: Workspace, dataset: str, model: str, data_root: str | None = None
) -> CandidatePool:
    """Fill this host's caches for the next policy merge of ``dataset``/``model``: the candidate
    directories, the evaluation split, the candidates' PLDs (fine and coarse) and RDP curves.
    The training flow calls it once its candidates are registered, so the first policy event
    after new candidates is as quick as the later ones."""
    from dpmerge.accounting import pld as pld_mod
    from dpmerge.accounting import rdp as rdp_mod

    workspace.use_caches()
    registry = workspace.registry()
    pool = find_candidates(registry, dataset, model, workspace.state())
    scratch = workspace.scratch()
    try:
        candidates = load_candidates(
            registry, pool, scratch, cache_dir=workspace.cache_dir / "candidates"
        )
        records = [c.model_dir.record for c in candidates]
        load_evaluation_data(
            records[0].dataset,
            getattr(records[0], "dataset_size", None),
            root=data_root,
            cache_dir=workspace.cache_dir,
        )
        for record in records:
            for discretisation in (pld_mod.FINE_DISCRETISATION, pld_mod.COARSE_DISCRETISATION):
                with suppress(UnsupportedError):  # an RDP-only label has no PLD
                    pld_mod.candidate_pld(record, discretisation)
            with suppress(UnsupportedError):  # an (ε, δ) label has no RDP curve
                rdp_mod.candidate_rdp(record)
    finally:
        remove_tree(scratch)
    return pool


@dataclass(frozen=True)
class Prepared:
    """What a policy merge works on: the pool, and unless a later version of the policy
    already exists or changed the alias (``superseded_by``: that version), the loaded
    candidates and the evaluation split."""

    pool: CandidatePool
    superseded_by: int | None = None
    candidates: tuple[RegisteredCandidate, ...] = ()
    data: EvaluationData | None = None
    notes: tuple[str, ...] = ()  # for the card: δ against the number of training rows


def later_version(workspace: Workspace, version: PolicyVersion, pool: CandidatePool) -> int | None:
    """A later version of the policy than ``version`` — stored, or already recorded on the
    alias — else ``None``: a run for an older version changes nothing."""
    newest = stored_policies.latest(workspace.state(), version.name)
    later = newest.version if newest is not None and newest.version > version.version else None
    alias = read_state(workspace.state(), pool.dataset).alias(
        pool.merged_model, str(version.policy.alias)
    )
    if alias is not None and alias.policy_version > version.version:
        later = max(later or 0, alias.policy_version)
    return later


def check_owner(workspace: Workspace, pool: CandidatePool, policy: Policy) -> None:
    """Refuse (:class:`~dpmerge.state.AliasOwnershipError`) a policy that names an alias
    another policy owns, before anything is loaded or changed."""
    alias = read_state(workspace.state(), pool.dataset).alias(pool.merged_model, str(policy.alias))
    if alias is not None and alias.owner != policy.name:
        raise AliasOwnershipError(
            f"alias {policy.alias!r} of {pool.merged_model} belongs to policy {alias.owner!r}; "
            f"policy {policy.name!r} may not change it (give the policy its own alias, e.g. "
            f"'policy-{policy.name}')"
        )


def prepare(workspace: Workspace, version: PolicyVersion, dest: str | Path) -> Prepared:
    """Steps 1–2 for ``version`` of a policy: find the candidates (quarantined ones left
    out); refuse an alias another policy owns; stop if a later version of the policy exists or
    already changed the alias; else load the candidates (cached by content hash, each verified
    against its signature), refuse fixed-seed candidates, and load the evaluation split (found
    by the candidates' internal fingerprint)."""
    policy = version.policy
    registry = workspace.registry()
    pool = find_candidates(registry, policy.dataset, policy.model, workspace.state())
    check_owner(workspace, pool, policy)
    later = later_version(workspace, version, pool)
    if later is not None:
        return Prepared(pool, superseded_by=later)
    candidates = load_candidates(registry, pool, dest, cache_dir=workspace.cache_dir / "candidates")
    refuse_fixed_seeds(candidates)
    records = [c.model_dir.record for c in candidates]
    delta = delta_check_for(records, policy.target_delta)  # δ ≥ 1/n: refused (DeltaError)
    first = records[0]
    data = load_evaluation_data(
        first.dataset,
        getattr(first, "dataset_size", None),
        root=policy.data_root,
        cache_dir=workspace.cache_dir,
    )
    notes = tuple(n for n in (delta.warning, delta.note) if n)
    return Prepared(pool, None, tuple(candidates), data, notes)


@dataclass(frozen=True)
class ReleasePlan:
    """Either the ready, signed version of this release registered before (``existing``:
    reused, nothing is merged), or the cumulative ledger bound the new release's card will
    show, or why the ledger cap refuses the new release (``refused``: nothing is merged or
    drawn)."""

    existing: Registered | None = None
    ledger: LedgerSummary | None = None
    refused: tuple[str, ...] = ()


def plan_release(
    workspace: Workspace, request: MergeRequest, entry: CountedRelease, policy: Policy
) -> ReleasePlan:
    """The ready version of this release if one exists, is signed by the workflow and is not
    quarantined (then nothing is merged; its gates are checked when it is served), else the
    ledger bound for the new release's card, checked against the cap before any merge, draw
    or registration."""
    found = find_release(workspace, request)
    if found is not None:
        return ReleasePlan(existing=found)
    summary = ledger_summary(workspace, entry, policy.cumulative_epsilon_cap)
    return ReleasePlan(ledger=summary, refused=(summary.refusal,) if summary.refusal else ())
