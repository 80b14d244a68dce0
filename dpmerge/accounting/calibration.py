"""Calibration to a target (ε*, δ*): the feasible merge with the best utility
(docs/design.md#calibration).

* RS: the linear programme of ``rs_calibration``.
* LC gated by the generic bound (the default): the subset ladder of ``generic_search``,
  optionally interpolated by RS between two subset merges.
* LC gated by the structured bound (opt-in): the path search of ``structured_search``.

Every choice that could reach beyond the released candidates — which subset, RS or LC, the RS
probabilities, a structured path — is made on data-independent utilities: the noise proxies
of the records, or per-candidate ``utilities`` for RS that the caller vouches are independent
of the training data (e.g. public benchmark figures). A choice that consulted the candidates'
validation accuracy would depend on every candidate consulted, and no bound over the released
ones covers it (docs/design.md#sharp-edges). Validation accuracy (``merge_utility``) may tune
the LC weights *within* the subset the generic gate chose: any weights over that subset are
post-processing of its joint release. The returned ε is certified at the
fine discretisation and never exceeds the target; it may be below the target only where
spending more would not improve the merge. Below the most private candidate's ε nothing is
feasible: ``InfeasibleTargetError`` carries the reachable range.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from dpmerge.accounting.account import check_candidates, check_delta
from dpmerge.accounting.calibrated import Calibration, MergeUtility
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.generic_search import calibrate_lc_generic, reachable_range
from dpmerge.accounting.records import Candidate
from dpmerge.accounting.rs_calibration import calibrate_rs
from dpmerge.accounting.structured_search import calibrate_structured
from dpmerge.errors import InfeasibleTargetError, RecordError
from dpmerge.formatting import epsilon_text
from dpmerge.vocabulary import GatingBound, Method, choose


def _check_target(target_epsilon: float) -> float:
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, numbers.Real):
        raise RecordError(f"target ε must be a number, got {type(target_epsilon).__name__}")
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise RecordError(f"target ε must be a positive number, got {target_epsilon}")
    return float(target_epsilon)


def calibrate(
    candidates: Sequence[Candidate],
    method: Method | str,
    target_epsilon: float,
    delta: float,
    *,
    gating_bound: GatingBound | str = GatingBound.GENERIC,
    utilities: Sequence[float] | None = None,
    merge_utility: MergeUtility | None = None,
    map_segments: bool = False,
    interpolate: bool = False,
) -> Calibration:
    """The best-utility merge whose gating ε meets ``target_epsilon`` at ``delta``.

    ``map_segments`` (structured LC only) also reports every feasible segment of the chosen
    path. ``interpolate`` (generic LC only) lets the result be a secret draw between two subset
    merges (``Calibration.mixture``) when the proxy's linear programme prefers it.
    """
    check_candidates(candidates)
    delta = check_delta(delta)
    target_epsilon = _check_target(target_epsilon)
    method = choose(Method, method, "method")
    gating_bound = choose(GatingBound, gating_bound, "gating bound")
    if merge_utility is not None and (method == Method.RS or gating_bound != GatingBound.GENERIC):
        raise RecordError(
            "validation utilities can tune LC weights under the generic bound only: the "
            "structured and RS bounds assume weights chosen independently of the data "
            "(docs/design.md#calibration)"
        )
    if utilities is not None and len(utilities) != len(candidates):
        raise RecordError(f"{len(utilities)} utilities for {len(candidates)} candidates")
    epsilons = [candidate_bound(c, delta).epsilon for c in candidates]
    most_private = min(epsilons)
    if target_epsilon < most_private:
        raise InfeasibleTargetError(
            f"target ε = {target_epsilon:g} at δ = {delta:g} is below the most private "
            f"candidate's ε = {epsilon_text(most_private)}; no merge of these candidates "
            "reaches it",
            target_epsilon=target_epsilon,
            delta=delta,
            reachable_epsilon_range=reachable_range(candidates, method, delta, epsilons),
        )
    if method == Method.RS:
        return calibrate_rs(candidates, target_epsilon, delta, epsilons, utilities)
    if gating_bound == GatingBound.GENERIC:
        return calibrate_lc_generic(
            candidates, target_epsilon, delta, epsilons, merge_utility, interpolate=interpolate
        )
    return calibrate_structured(
        candidates, target_epsilon, delta, epsilons, merge_utility, map_segments=map_segments
    )
