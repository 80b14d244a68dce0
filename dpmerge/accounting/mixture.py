"""The ``mixture`` method: a secret draw between two LC merges of subsets ("rungs")
(docs/design.md#random-selection, "RS between merges"; docs/design.md#calibration).

A rung is the LC merge of one subset of the candidates. Under the generic bound its privacy is
the joint release of the subset's release units, whatever its weights
(docs/design.md#generic-bound). The mixture draws rung I ~ (p, 1 − p) in secret and releases
that rung's merge. Its ε is the mixture bound over the two rungs' composed curves — PLD:
δ(ε) = p·δ_a(ε) + (1 − p)·δ_b(ε) per adjacency direction; RDP: the log-mean-exp of the curves —
which needs no independence between the rungs (they may share candidates), only the draw's
secrecy (docs/design.md#rs-secrecy).

Calibration is the linear programme of docs/design.md#random-selection over every usable rung:
maximise Σ p_r·u_r subject to Σ p_r·δ_r(ε*) ≤ δ*; an optimal vertex mixes at most two rungs.
u_r is the rung's data-independent utility (``generic_search.Rung.proxy``), so the two rungs
and their odds depend on the records only. Coarse costs steer; the odds come from the two
rungs' fine costs; the mixture bound at the fine discretisation certifies. A programme whose
optimum is one rung gives a one-rung mixture (that rung's LC merge, drawn with probability 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting.account import check_candidates, check_delta
from dpmerge.accounting.bounds import MixtureRung, PrivacyReport
from dpmerge.accounting.calibrated import COARSE_MARGIN, LP_SLACK, Calibration, MergeUtility
from dpmerge.accounting.generic import (
    ReleaseUnit,
    composed_pld,
    composed_rdp,
    release_units,
    units_bound,
)
from dpmerge.accounting.generic_search import (
    Rung,
    reachable_range,
    rungs,
    single_rung,
    tune_within,
    utility_kind,
)
from dpmerge.accounting.records import Candidate, attestation_lines
from dpmerge.accounting.rs import mixture_bound
from dpmerge.accounting.rs_calibration import best_two_point_mixture
from dpmerge.accounting.weights import initialisation_conflict, simplex_weights
from dpmerge.errors import RecordError, RefusalError, UnsupportedError
from dpmerge.vocabulary import BoundKind, Method

MAX_GUARD_STEPS = 20
Chosen = tuple[tuple[float, "Rung"], ...]
NOTE = (
    "a secret draw between two LC merges (generic gate): each merge is post-processing of its "
    "subset's joint release, whose curves are the composition of its release units; the "
    "mixture bound needs no independence between the merges"
)


def mixture_report(
    candidates: Sequence[Candidate],
    rungs_: Sequence[tuple[float, Sequence[float]]],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PrivacyReport:
    """The privacy report of releasing, with probability ``p``, the LC merge with weights ``λ``
    for each ``(p, λ)`` of ``rungs_`` (one or two rungs; λ over every candidate, on the
    simplex). Refuses a rung whose subset the release-unit rules refuse
    (docs/design.md#release-units)."""
    check_candidates(candidates)
    delta = check_delta(delta)
    names = tuple(c.name for c in candidates)
    if not 1 <= len(rungs_) <= 2:
        raise RecordError(f"a mixture draws between one and two LC merges, got {len(rungs_)}")
    odds = simplex_weights([p for p, _ in rungs_], len(rungs_), what="mixture probabilities")
    if any(p == 0 for p in odds):
        raise RecordError("every rung of a mixture has a probability above 0")
    parts, notes = [], [NOTE]
    for p, weights in zip(odds, (w for _, w in rungs_), strict=True):
        weights = simplex_weights(weights, len(candidates), what="rung weights")
        used = [c for c, w in zip(candidates, weights, strict=True) if w > 0]
        parts.append((p, weights, release_units(used)))
        conflict = initialisation_conflict(used)
        if conflict is not None and f"warning: {conflict}" not in notes:
            notes.append(f"warning: {conflict}")
    bound = mixture_bound(
        odds,
        [lambda u=units: composed_pld(u, discretisation) for _, _, units in parts],
        [lambda u=units: composed_rdp(u) for _, _, units in parts],
        delta,
        discretisation,
        tuple(dict.fromkeys(u.describe() for *_, units in parts for u in units if _shared(u))),
        kind=BoundKind.MIXTURE,
    )
    return PrivacyReport(
        Method.MIXTURE,
        names,
        (),
        delta,
        bound,
        notes=tuple(notes),
        rungs=tuple(
            MixtureRung(p, weights, units_bound(units, delta, discretisation))
            for p, weights, units in parts
        ),
        attestations=attestation_lines(
            c for c in candidates if any(c.name in u.members for *_, units in parts for u in units)
        ),
    )


def _shared(unit: ReleaseUnit) -> bool:
    return len(unit.members) > 1


def calibrate_mixture(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
) -> Calibration:
    """See the module docstring. ``merge_utility`` (opt-in) tunes each rung's weights within
    the rung once the rungs and their odds are chosen: every weighting of a rung has the
    rung's generic bound, so the mixture bound is unchanged."""
    ladder, skipped = rungs(candidates, math.inf, epsilons)
    try:
        chosen = _programme(ladder, target, delta)
    except UnsupportedError as error:  # a rung without a PLD (an RDP-only label)
        raise RefusalError(f"the mixture needs every rung's PLD: {error}") from None
    safest = ((1.0, single_rung(candidates, epsilons)),)
    report, chosen = _certified(candidates, chosen or safest, delta, target)
    if report.epsilon > target:  # a lone rung the coarse grid let through
        report, chosen = _certified(candidates, safest, delta, target)
    tuned = [(p, *_tuned(candidates, rung, merge_utility)) for p, rung in chosen]
    if merge_utility is not None:
        report = mixture_report(candidates, [(p, w) for p, w, _ in tuned], delta)
    utility = math.fsum(p * u for p, _, u in tuned)
    return Calibration(
        method=Method.MIXTURE,
        target_epsilon=target,
        delta=delta,
        weights=None,
        report=report,
        reachable_epsilon_range=reachable_range(candidates, Method.MIXTURE, delta, epsilons),
        utility=None if math.isinf(utility) else utility,
        utility_kind=utility_kind(merge_utility, candidates, expected=True),
        search={
            "rungs_considered": len(ladder),
            "rungs": [[candidates[i].name for i in rung.members] for _, rung in chosen],
            "skipped": skipped,
        },
    )


def _tuned(
    candidates: Sequence[Candidate], rung: Rung, merge_utility: MergeUtility | None
) -> tuple[tuple[float, ...], float]:
    if merge_utility is None:
        return rung.weights, rung.proxy
    if len(rung.members) > 1:
        return tune_within(candidates, rung, merge_utility)
    return rung.weights, float(merge_utility(rung.weights))


def _programme(ladder: Sequence[Rung], target: float, delta: float) -> Chosen | None:
    """The programme's optimal vertex: one or two rungs with their odds. Coarse costs pick the
    vertex, except that a rung certified on its own at the fine grid (ε ≤ target) is always
    affordable (the coarse grid and the slack would otherwise drop a rung that exactly meets
    the target, as the most private run does at the bottom of the range); the odds are
    recomputed from the two rungs' fine costs so that the fine constraint is tight."""
    if not ladder:
        return None
    budget = delta * (1 - LP_SLACK)
    fine = pld_mod.FINE_DISCRETISATION
    costs = [r.delta_at(target, pld_mod.COARSE_DISCRETISATION) for r in ladder]
    if not all(0 <= c <= 1 for c in costs):
        raise RefusalError(f"a rung's δ at ε = {target:g} is not a probability: {costs}")
    for i, rung in enumerate(ladder):
        if costs[i] > budget and rung.coarse_epsilon(delta) <= target + COARSE_MARGIN:
            certified = profiles.epsilon_for_delta(composed_pld(rung.units, fine), delta)
            costs[i] = budget if certified <= target else costs[i]
    pi = best_two_point_mixture([r.proxy for r in ladder], costs, budget)
    if pi is None:
        return None
    picked = sorted((i for i, p in enumerate(pi) if p > 0), key=lambda i: costs[i])
    if len(picked) == 1:
        return ((1.0, ladder[picked[0]]),)
    safe, risky = (ladder[i] for i in picked)
    cost_safe, cost_risky = safe.delta_at(target, fine), risky.delta_at(target, fine)
    if cost_risky <= budget:  # the better rung fits on its own at the fine grid
        return ((1.0, risky),)
    if cost_safe >= budget:  # affordable only alone (certified at the target)
        return ((1.0, safe),)
    share = (budget - cost_safe) / (cost_risky - cost_safe)
    return ((1 - share, safe), (share, risky))


def _certified(
    candidates: Sequence[Candidate], chosen: Chosen, delta: float, target: float
) -> tuple[PrivacyReport, Chosen]:
    """The fine mixture bound of ``chosen``; mass moves to the safer rung (and finally to it
    alone) in the unlikely case float rounding puts the certified ε above the target."""
    if len(chosen) == 1:
        return mixture_report(candidates, [(1.0, chosen[0][1].weights)], delta), chosen
    (p_safe, safe), (p_risky, risky) = chosen
    for _ in range(MAX_GUARD_STEPS):
        pair = ((p_safe, safe), (p_risky, risky))
        report = mixture_report(candidates, [(p, r.weights) for p, r in pair], delta)
        if report.epsilon <= target:
            return report, pair
        p_risky *= 0.99
        p_safe = 1 - p_risky
    return mixture_report(candidates, [(1.0, safe.weights)], delta), ((1.0, safe),)
