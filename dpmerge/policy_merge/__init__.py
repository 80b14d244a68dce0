"""Apply a stored policy version to the registered candidates: calibrate, merge, evaluate,
count, register, serve (docs/design.md#workflow, docs/design.md#release-state). Library code,
no Prefect.

:func:`apply_policy` is the state machine that runs the steps below for one policy version and
says how it ended (:class:`Status`, :class:`PolicyOutcome`); its steps are injectable
(:class:`PolicySteps`): ``flows/merge.py`` passes Prefect tasks that wrap them.

1. :func:`prepare` — the ready, unquarantined candidate versions of the policy's dataset (its
   published, keyed identifier) and model, each verified against its signature (fixed-seed
   candidates refused), and the evaluation split; stops early when another policy owns the
   alias (refused) or a later version of the policy exists (``superseded``).
2. :func:`calibrate_policy` — ``method: auto`` keeps the release (RS, LC or the mixture) with
   the best expected noise proxy, a data-independent choice (docs/design.md#calibration).
3. :func:`merge_request` and :func:`plan_release` — the release's hash (candidates, method,
   weights or rungs, δ, bound; not the target); a ready, signed version of it is reused (a
   rerun never draws again); the ledger cap refuses a new release before anything is merged or
   drawn.
4. :func:`merge_release` — merge and evaluate; RS and the mixture use the draw stored for the
   release (:mod:`~dpmerge.policy_merge.draws`).
5. :func:`count_release` — the release is counted in the ledger before anything of it is
   published; :func:`register_release` — its internal record kept in the state store, then the
   merged version, signed, with its public privacy card.
6. :func:`serve_release` — the gates on the signed facts, then count-and-point in one
   conditional write; :func:`enforce` — the serving invariant when nothing new is served;
   :func:`project` — the MLflow alias follows the serving pointer.

Modules: :mod:`~dpmerge.policy_merge.apply` (the state machine),
:mod:`~dpmerge.workspace` (where things live),
:mod:`~dpmerge.policy_merge.candidates`, :mod:`~dpmerge.policy_merge.evaluation_data`,
:mod:`~dpmerge.policy_merge.preparation`, :mod:`~dpmerge.policy_merge.calibration`,
:mod:`~dpmerge.policy_merge.release`, :mod:`~dpmerge.policy_merge.draws`,
:mod:`~dpmerge.policy_merge.ledger`, :mod:`~dpmerge.policy_merge.promotion`,
:mod:`~dpmerge.policy_merge.outcome`, :mod:`~dpmerge.policy_merge.dry_run`,
:mod:`~dpmerge.policy_merge.verify` (drift between MLflow and the release-state store).

The names below are imported on first use (PEP 562), as :mod:`dpmerge.registry`'s are: a command
that needs one light module (a policy's outcome, to print it) does not import torch, pandas and
MLflow with the rest (``dpmerge policy history`` in 0.6 s instead of 5 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LIBRARY_STEPS": "dpmerge.policy_merge.apply",
    "PolicyResult": "dpmerge.policy_merge.apply",
    "PolicySteps": "dpmerge.policy_merge.apply",
    "apply_policy": "dpmerge.policy_merge.apply",
    "PolicyPlan": "dpmerge.policy_merge.calibration",
    "calibrate_policy": "dpmerge.policy_merge.calibration",
    "CandidatePool": "dpmerge.policy_merge.candidates",
    "find_candidates": "dpmerge.policy_merge.candidates",
    "load_candidates": "dpmerge.policy_merge.candidates",
    "DryRun": "dpmerge.policy_merge.dry_run",
    "Gate": "dpmerge.policy_merge.dry_run",
    "Verdict": "dpmerge.policy_merge.dry_run",
    "dry_run": "dpmerge.policy_merge.dry_run",
    "DATA_ROOT_ENV": "dpmerge.policy_merge.evaluation_data",
    "SPLIT_SEED": "dpmerge.policy_merge.evaluation_data",
    "VALIDATION_FRACTION": "dpmerge.policy_merge.evaluation_data",
    "EvaluationData": "dpmerge.policy_merge.evaluation_data",
    "load_evaluation_data": "dpmerge.policy_merge.evaluation_data",
    "LedgerIntegrityError": "dpmerge.policy_merge.ledger",
    "LedgerSummary": "dpmerge.policy_merge.ledger",
    "count_release": "dpmerge.policy_merge.ledger",
    "ledger_entry": "dpmerge.policy_merge.ledger",
    "ledger_summary": "dpmerge.policy_merge.ledger",
    "rebuild_ledger": "dpmerge.policy_merge.ledger",
    "PolicyOutcome": "dpmerge.policy_merge.outcome",
    "Status": "dpmerge.policy_merge.outcome",
    "Prepared": "dpmerge.policy_merge.preparation",
    "ReleasePlan": "dpmerge.policy_merge.preparation",
    "plan_release": "dpmerge.policy_merge.preparation",
    "prepare": "dpmerge.policy_merge.preparation",
    "prime_caches": "dpmerge.policy_merge.preparation",
    "start_export_warmup": "dpmerge.policy_merge.preparation",
    "Enforced": "dpmerge.policy_merge.promotion",
    "Projection": "dpmerge.policy_merge.promotion",
    "Registered": "dpmerge.policy_merge.promotion",
    "ServeResult": "dpmerge.policy_merge.promotion",
    "enforce": "dpmerge.policy_merge.promotion",
    "find_release": "dpmerge.policy_merge.promotion",
    "project": "dpmerge.policy_merge.promotion",
    "read_card": "dpmerge.policy_merge.promotion",
    "register_release": "dpmerge.policy_merge.promotion",
    "serve_release": "dpmerge.policy_merge.promotion",
    "MergeRequest": "dpmerge.policy_merge.release",
    "Release": "dpmerge.policy_merge.release",
    "merge_release": "dpmerge.policy_merge.release",
    "merge_request": "dpmerge.policy_merge.release",
    "Workspace": "dpmerge.workspace",
    "embedded_tracking_uri": "dpmerge.workspace",
    "remove_tree": "dpmerge.workspace",
    "resolve_home": "dpmerge.workspace",
}

__all__ = [
    "DATA_ROOT_ENV",
    "LIBRARY_STEPS",
    "SPLIT_SEED",
    "VALIDATION_FRACTION",
    "CandidatePool",
    "DryRun",
    "Enforced",
    "EvaluationData",
    "Gate",
    "LedgerIntegrityError",
    "LedgerSummary",
    "MergeRequest",
    "PolicyOutcome",
    "PolicyPlan",
    "PolicyResult",
    "PolicySteps",
    "Prepared",
    "Projection",
    "Registered",
    "Release",
    "ReleasePlan",
    "ServeResult",
    "Status",
    "Verdict",
    "Workspace",
    "apply_policy",
    "calibrate_policy",
    "count_release",
    "dry_run",
    "embedded_tracking_uri",
    "enforce",
    "find_candidates",
    "find_release",
    "ledger_entry",
    "ledger_summary",
    "load_candidates",
    "load_evaluation_data",
    "merge_release",
    "merge_request",
    "plan_release",
    "prepare",
    "prime_caches",
    "project",
    "read_card",
    "rebuild_ledger",
    "register_release",
    "remove_tree",
    "resolve_home",
    "serve_release",
    "start_export_warmup",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
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
    from dpmerge.policy_merge.ledger import (
        LedgerIntegrityError,
        LedgerSummary,
        count_release,
        ledger_entry,
        ledger_summary,
        rebuild_ledger,
    )
    from dpmerge.policy_merge.outcome import PolicyOutcome, Status
    from dpmerge.policy_merge.preparation import (
        Prepared,
        ReleasePlan,
        plan_release,
        prepare,
        prime_caches,
        start_export_warmup,
    )
    from dpmerge.policy_merge.promotion import (
        Enforced,
        Projection,
        Registered,
        ServeResult,
        enforce,
        find_release,
        project,
        read_card,
        register_release,
        serve_release,
    )
    from dpmerge.policy_merge.release import MergeRequest, Release, merge_release, merge_request
    from dpmerge.workspace import (
        Workspace,
        embedded_tracking_uri,
        remove_tree,
        resolve_home,
    )
