"""Apply a privacy policy to the registered candidates: calibrate, merge, evaluate, register,
promote (docs/design.md). Library code, no Prefect.

:func:`apply_policy` is the state machine that runs the steps below for one policy event and
says how it ended (:class:`Status`, :class:`PolicyOutcome`); its steps are injectable
(:class:`PolicySteps`): ``flows/merge.py`` passes Prefect tasks that wrap them.

The steps, in order:

1. :func:`find_candidates` — the ready candidate versions of the policy's dataset (its
   published, keyed identifier) and model; each loaded candidate is verified against its
   signature, and candidates trained with fixed seeds are refused.
2. :func:`load_evaluation_data` — the splits the candidates were trained with (found by their
   internal fingerprint), for validation utilities (disjoint from training) and test accuracy.
3. :func:`calibrate_policy` — ``method: auto`` calibrates RS and LC and keeps the release with
   the smaller noise proxy, a data-independent choice; ties go to LC (no secret draw).
   Validation accuracy only tunes the LC weights within the chosen subset. Infeasible targets
   raise :class:`~dpmerge.errors.InfeasibleTargetError` with the reachable range.
4. :func:`merge_request` — the release's content hash (candidates, method, weights, δ, bound;
   not the target); :func:`plan_release` reuses a ready version of the same release (a re-run
   never draws again), else computes the ledger bound the new release's card shows and refuses
   a release the ledger cap would refuse before anything is merged.
5. :func:`merge_release` — merge and evaluate; for RS the draw stored for the release is used,
   or a new one is stored (audit bucket or ``<home>/audit``, create-once) before it is used
   (:mod:`~dpmerge.policy_merge.draws`). :class:`Release` carries only public facts.
6. :func:`register_release` — the merged version with its privacy card and the cumulative
   ledger bound (docs/design.md#release-ledger).
7. :func:`promote_release` — the ledger cap, then the registry's gates (ε ≤ target, δ, accuracy ≥
   ``min_accuracy``, card consistent), then the alias; the release enters the ledger only once
   promoted (if that write fails the alias is put back).

A policy event can arrive late (two events back to back may run in either order): every alias
change records the event's server-received time on the releases' registered model (tag
``dp.alias_time.<alias>``) and an older event never moves or removes the alias again (status
``superseded``); an event dated in the future is refused (:mod:`~dpmerge.policy_merge.events`).
An alias belongs to the policy that first set it (``dp.alias_owner.<alias>``).

Modules: :mod:`~dpmerge.policy_merge.apply` (the state machine),
:mod:`~dpmerge.policy_merge.workspace` (where things live),
:mod:`~dpmerge.policy_merge.candidates` (step 1), :mod:`~dpmerge.policy_merge.evaluation_data`
(step 2), :mod:`~dpmerge.policy_merge.preparation` (steps 1–2 for one event, cache priming),
:mod:`~dpmerge.policy_merge.calibration` (step 3), :mod:`~dpmerge.policy_merge.release`
(steps 4–5), :mod:`~dpmerge.policy_merge.draws`, :mod:`~dpmerge.policy_merge.release_ledger`,
:mod:`~dpmerge.policy_merge.events`,
:mod:`~dpmerge.policy_merge.promotion` (steps 6–7, revocation, event order),
:mod:`~dpmerge.policy_merge.outcome` (statuses and outcomes),
:mod:`~dpmerge.policy_merge.dry_run` (what a policy would release, without side effects).
"""

from dpmerge.policy_merge.apply import LIBRARY_STEPS, PolicyResult, PolicySteps, apply_policy
from dpmerge.policy_merge.calibration import PolicyPlan, calibrate_policy
from dpmerge.policy_merge.candidates import CandidatePool, find_candidates, load_candidates
from dpmerge.policy_merge.dry_run import DryRun, Gate, Verdict, dry_run
from dpmerge.policy_merge.evaluation_data import (
    DATA_ROOT_ENV,
    SPLIT_SEED,
    VALIDATION_FRACTION,
    EvaluationData,
    load_evaluation_data,
)
from dpmerge.policy_merge.events import CLOCK_SKEW, EventTimeError, order_time, parse_time
from dpmerge.policy_merge.outcome import (
    PolicyOutcome,
    Status,
)
from dpmerge.policy_merge.preparation import (
    Prepared,
    ReleasePlan,
    plan_release,
    prepare,
    prime_caches,
    start_export_warmup,
)
from dpmerge.policy_merge.promotion import (
    PromotionResult,
    Registered,
    find_release,
    handle_infeasible,
    promote_release,
    read_card,
    register_release,
)
from dpmerge.policy_merge.release import MergeRequest, Release, merge_release, merge_request
from dpmerge.policy_merge.release_ledger import (
    LedgerEntry,
    LedgerIntegrityError,
    ledger_release,
    ledger_summary,
    read_ledger,
    rebuild_ledger,
    record_release,
)
from dpmerge.policy_merge.workspace import (
    Workspace,
    embedded_tracking_uri,
    remove_tree,
    resolve_home,
)

__all__ = [
    "CLOCK_SKEW",
    "DATA_ROOT_ENV",
    "LIBRARY_STEPS",
    "SPLIT_SEED",
    "VALIDATION_FRACTION",
    "CandidatePool",
    "DryRun",
    "EvaluationData",
    "EventTimeError",
    "Gate",
    "LedgerEntry",
    "LedgerIntegrityError",
    "MergeRequest",
    "PolicyOutcome",
    "PolicyPlan",
    "PolicyResult",
    "PolicySteps",
    "Prepared",
    "PromotionResult",
    "Registered",
    "Release",
    "ReleasePlan",
    "Status",
    "Verdict",
    "Workspace",
    "apply_policy",
    "calibrate_policy",
    "dry_run",
    "embedded_tracking_uri",
    "find_candidates",
    "find_release",
    "handle_infeasible",
    "ledger_release",
    "ledger_summary",
    "load_candidates",
    "load_evaluation_data",
    "merge_release",
    "merge_request",
    "order_time",
    "parse_time",
    "plan_release",
    "prepare",
    "prime_caches",
    "promote_release",
    "read_card",
    "read_ledger",
    "rebuild_ledger",
    "record_release",
    "register_release",
    "remove_tree",
    "resolve_home",
    "start_export_warmup",
]
