"""Calibration to a target (ε*, δ*): the feasible merge with the best utility
(docs/design.md#calibration).

* RS: the linear programme of ``rs_calibration``.
* LC gated by the generic bound (the default): the subset ladder of ``generic_search``.
* The mixture (a secret draw between two LC merges of subsets): ``mixture``.
* LC gated by the structured bound (opt-in): the path search of ``structured_search``.

Every choice that could reach beyond the released candidates — which subset, the RS
probabilities, the mixture's rungs and odds, a structured path — is made on the records'
data-independent noise proxies; there is no way to pass accuracies for them. A choice that
consulted the candidates' validation accuracy would depend on every candidate consulted, and no
bound over the released ones covers it (docs/design.md#sharp-edges). LC weights within a subset
are inverse-variance by default; validation accuracy (``merge_utility``, opt-in) may tune them
*within* the subset (each rung's, for the mixture) under the generic gate: any weights over
that subset are post-processing of its joint release. The returned ε is certified at the fine
discretisation and never exceeds the target; it may be below the target only where spending
more would not improve the merge. Below the most private candidate's ε nothing is feasible:
``InfeasibleTargetError`` carries the reachable range and the σ a new candidate needs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from dpmerge.accounting.account import check_candidates, check_delta
from dpmerge.accounting.calibrated import Calibration, MergeUtility
from dpmerge.accounting.candidate import candidate_bound, noise_multiplier_for_epsilon
from dpmerge.accounting.generic_search import calibrate_lc_generic, reachable_range
from dpmerge.accounting.mixture import calibrate_mixture
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.rs_calibration import calibrate_rs
from dpmerge.accounting.structured_search import calibrate_structured
from dpmerge.errors import InfeasibleTargetError, RecordError, RefusalError
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
    merge_utility: MergeUtility | None = None,
    map_segments: bool = False,
) -> Calibration:
    """The best-utility merge of ``method`` whose gating ε meets ``target_epsilon`` at
    ``delta``.

    ``merge_utility`` (opt-in, generic gate only) tunes LC weights within the chosen subset.
    ``map_segments`` (structured LC only) also reports every feasible segment of the chosen
    path.
    """
    check_candidates(candidates)
    delta = check_delta(delta)
    target_epsilon = _check_target(target_epsilon)
    method = choose(Method, method, "method")
    gating_bound = choose(GatingBound, gating_bound, "gating bound")
    if method != Method.LC and gating_bound != GatingBound.GENERIC:
        raise RecordError(
            f"the gating bound applies to LC only ({method} is gated by its mixture bound)"
        )
    if merge_utility is not None and (method == Method.RS or gating_bound != GatingBound.GENERIC):
        raise RecordError(
            "validation utilities can tune LC weights under the generic bound only: the "
            "structured and RS bounds assume weights chosen independently of the data "
            "(docs/design.md#calibration)"
        )
    epsilons = [candidate_bound(c, delta).epsilon for c in candidates]
    if target_epsilon < min(epsilons):
        raise _infeasible(candidates, method, target_epsilon, delta, epsilons)
    if method == Method.RS:
        return calibrate_rs(candidates, target_epsilon, delta, epsilons)
    if method == Method.MIXTURE:
        return calibrate_mixture(candidates, target_epsilon, delta, epsilons, merge_utility)
    if gating_bound == GatingBound.GENERIC:
        return calibrate_lc_generic(candidates, target_epsilon, delta, epsilons, merge_utility)
    return calibrate_structured(
        candidates, target_epsilon, delta, epsilons, merge_utility, map_segments=map_segments
    )


def _infeasible(
    candidates: Sequence[Candidate],
    method: Method,
    target: float,
    delta: float,
    epsilons: Sequence[float],
) -> InfeasibleTargetError:
    """The error for a target below the most private candidate, with the σ at which one
    candidate with the most private record's q and T reaches it (PLD; the noisier end of the
    search, shown rounded up)."""
    message = (
        f"target ε = {target:g} at δ = {delta:g} is below the most private candidate's "
        f"ε = {epsilon_text(min(epsilons))}; no merge of these candidates reaches it"
    )
    records = [
        (e, c) for e, c in zip(epsilons, candidates, strict=True) if isinstance(c, MechanismRecord)
    ]
    sigma = None
    if records:
        record = min(records, key=lambda pair: pair[0])[1]
        assert isinstance(record, MechanismRecord)
        try:
            sigma = noise_multiplier_for_epsilon(
                target, delta, record.sample_rate, record.steps, rel_tol=1e-4
            )
        except RefusalError as refusal:
            message += f" ({refusal})"
        else:
            shown = math.ceil(sigma * 1000) / 1000
            message += (
                f"; train σ ≥ {shown:.3f} (PLD) to reach ε* = {target:g} at the q = "
                f"{record.sample_rate:.6g} and T = {record.steps} of {record.name!r}"
            )
    return InfeasibleTargetError(
        message,
        target_epsilon=target,
        delta=delta,
        reachable_epsilon_range=reachable_range(candidates, method, delta, epsilons),
        required_noise_multiplier=sigma,
    )
