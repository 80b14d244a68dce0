"""LC calibration gated by the generic bound (docs/design.md#generic-bound,
docs/design.md#calibration).

The generic bound does not depend on λ, only on which candidates are used (through their
release units), so the search is over *subsets*: each subset is one rung of a ladder of
reachable ε values, weighted for utility (inverse-variance λ_i ∝ σ_i⁻² for records; equal
weights where a member is label-only). Rungs are ranked by utility (validation accuracy when
known, else the merged-noise proxy), steered by the coarse grid and certified at the fine one;
the best certified rung is returned.

With ``interpolate`` (and validation utilities) the calibrator may instead release one of two
rungs, drawn secretly: RS between two subset merges, accounted by the RS bound over the two
rungs' composed curves, lands between rungs. It is chosen only when its expected validation
accuracy beats the best single rung.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.calibrated import (
    COARSE_MARGIN,
    LP_SLACK,
    Calibration,
    MergeMixture,
    MergeUtility,
)
from dpmerge.accounting.generic import ReleaseUnit, composed_pld, composed_rdp, release_units
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.rs import mixture_bound
from dpmerge.accounting.rs_calibration import best_two_point_mixture
from dpmerge.accounting.weights import inverse_variance_weights, merged_noise_proxy
from dpmerge.errors import RefusalError, UnsupportedError
from dpmerge.vocabulary import Method

MAX_EXHAUSTIVE_SUBSETS = 10
"""Enumerate every subset up to this many candidates (1023 subsets); greedy beyond."""


@dataclass(frozen=True)
class Rung:
    """One subset merge: its members (indices), release units, full-length weights, utility."""

    members: tuple[int, ...]
    units: tuple[ReleaseUnit, ...]
    weights: tuple[float, ...]
    utility: float

    def coarse_epsilon(self, delta: float) -> float:
        return profiles.epsilon_for_delta(
            composed_pld(self.units, pld_mod.COARSE_DISCRETISATION), delta
        )

    def delta_at(self, epsilon: float, discretisation: float) -> float:
        return float(
            profiles.delta_for_epsilon(composed_pld(self.units, discretisation), epsilon)[0]
        )


def subset_weights(members: Sequence[Candidate]) -> tuple[float, ...]:
    """Inverse-variance weights over a subset; equal weights where a member is label-only."""
    if all(isinstance(m, MechanismRecord) for m in members):
        return inverse_variance_weights(members)  # type: ignore[arg-type]
    return tuple(1.0 / len(members) for _ in members)


def _embed(k: int, members: Sequence[int], values: Sequence[float]) -> tuple[float, ...]:
    weights = [0.0] * k
    for i, v in zip(members, values, strict=True):
        weights[i] = v
    return tuple(weights)


def candidate_subsets(k: int, epsilons: Sequence[float], target: float) -> list[tuple[int, ...]]:
    """Subsets whose members each meet the target (necessary: composition never falls below a
    member's ε). Exhaustive up to :data:`MAX_EXHAUSTIVE_SUBSETS` candidates."""
    allowed = [i for i in range(k) if epsilons[i] <= target]
    if len(allowed) <= MAX_EXHAUSTIVE_SUBSETS:
        return [s for r in range(1, len(allowed) + 1) for s in itertools.combinations(allowed, r)]
    # Greedy: nested prefixes of the candidates ordered from least to most noisy, plus singles.
    order = sorted(allowed, key=lambda i: -epsilons[i])
    return [(i,) for i in allowed] + [tuple(order[:r]) for r in range(2, len(order) + 1)]


def _utility_kind(merge_utility: MergeUtility | None, candidates: Sequence[Candidate]) -> str:
    if merge_utility is not None:
        return "validation accuracy"
    if any(isinstance(c, MechanismRecord) for c in candidates):
        return "noise proxy: −Σc²σ²/(Σc)² (docs/design.md#calibration)"
    return "ε spent (label-only candidates, no utilities given)"


def rungs(
    candidates: Sequence[Candidate],
    target: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
) -> tuple[list[Rung], list[str]]:
    """Every usable subset as a rung, best utility first, and why others were skipped."""
    k = len(candidates)
    all_labels = not any(isinstance(c, MechanismRecord) for c in candidates)
    usable = {
        i
        for i in range(k)
        if merge_utility is not None or all_labels or isinstance(candidates[i], MechanismRecord)
    }
    skipped = [
        f"{candidates[i].name!r} left out: a label-only candidate has no noise proxy "
        "(pass utilities to merge it)"
        for i in range(k)
        if i not in usable
    ]
    found = []
    for members in candidate_subsets(k, epsilons, target):
        if not set(members) <= usable:
            continue
        chosen = [candidates[i] for i in members]
        try:
            units = release_units(chosen)
        except RefusalError as refusal:
            skipped.append(str(refusal))
            continue
        weights = _embed(k, members, subset_weights(chosen))
        if merge_utility is not None:
            utility = float(merge_utility(weights))
        elif all(isinstance(c, MechanismRecord) for c in chosen):
            utility = -merged_noise_proxy(chosen, subset_weights(chosen))  # type: ignore[arg-type]
        else:  # every candidate is label-only: spending more is the only signal
            utility = max(epsilons[i] for i in members)
        found.append(Rung(members, units, weights, utility))
    found.sort(key=lambda r: (-r.utility, len(r.members)))
    return found, skipped


def calibrate_lc_generic(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
    *,
    interpolate: bool = False,
) -> Calibration:
    """See the module docstring."""
    ladder, skipped = rungs(candidates, target, epsilons, merge_utility)
    certified = 0
    chosen: tuple[Rung, PrivacyReport] | None = None
    for rung in ladder:
        if rung.coarse_epsilon(delta) > target + COARSE_MARGIN:
            continue
        report = account(candidates, Method.LC, rung.weights, delta)
        certified += 1
        if report.epsilon <= target:
            chosen = (rung, report)
            break
    if chosen is None:
        # Nothing usable certified (e.g. only a label-only candidate meets the target): the
        # most private candidate alone always does.
        safest = min(range(len(candidates)), key=lambda i: epsilons[i])
        weights = _embed(len(candidates), (safest,), (1.0,))
        rung = Rung((safest,), release_units([candidates[safest]]), weights, float("-inf"))
        chosen = (rung, account(candidates, Method.LC, weights, delta))
    rung, report = chosen
    search = {
        "subsets_considered": len(ladder),
        "fine_certifications": certified,
        "members": [candidates[i].name for i in rung.members],
        "skipped": skipped,
    }
    reachable = (min(epsilons), _all_candidates_epsilon(candidates, delta, epsilons))
    kind = _utility_kind(merge_utility, candidates)
    if interpolate and merge_utility is not None:
        mixed = _mixture(candidates, ladder, rung, target, delta)
        if mixed is not None:
            mixture, mixture_report = mixed
            search["mixture_of_subsets"] = [
                [candidates[i].name for i in r.members]
                for r in ladder
                if r.weights in mixture.weights
            ]
            return Calibration(
                method=Method.LC,
                target_epsilon=target,
                delta=delta,
                weights=None,
                report=mixture_report,
                reachable_epsilon_range=reachable,
                utility=mixture.expected_utility,
                utility_kind=f"expected {kind}",
                search=search,
                mixture=mixture,
            )
    return Calibration(
        method=Method.LC,
        target_epsilon=target,
        delta=delta,
        weights=rung.weights,
        report=report,
        reachable_epsilon_range=reachable,
        utility=None if rung.utility == float("-inf") else rung.utility,
        utility_kind=kind,
        search=search,
    )


def _mixture(
    candidates: Sequence[Candidate],
    ladder: Sequence[Rung],
    best: Rung,
    target: float,
    delta: float,
) -> tuple[MergeMixture, PrivacyReport] | None:
    """RS between two rungs, when its expected utility beats ``best``: the two-point LP over
    the rungs (coarse costs steer), probabilities recomputed from fine costs, then certified
    by the RS bound over the two rungs' composed curves."""
    fine = pld_mod.FINE_DISCRETISATION
    try:
        costs = [r.delta_at(target, pld_mod.COARSE_DISCRETISATION) for r in ladder]
        pi = best_two_point_mixture([r.utility for r in ladder], costs, delta * (1 - LP_SLACK))
        if pi is None or max(pi) == 1.0:
            return None
        safe, risky = sorted((i for i, p in enumerate(pi) if p > 0), key=lambda i: costs[i])
        a, b = ladder[safe], ladder[risky]
        cost_a, cost_b = a.delta_at(target, fine), b.delta_at(target, fine)
        budget = delta * (1 - LP_SLACK)
        if not cost_a < budget < cost_b:
            return None
        share = (budget - cost_a) / (cost_b - cost_a)
        expected = (1 - share) * a.utility + share * b.utility
        if expected <= best.utility:
            return None
        bound = mixture_bound(
            (1 - share, share),
            [lambda r=r: composed_pld(r.units, fine) for r in (a, b)],
            [lambda r=r: composed_rdp(r.units) for r in (a, b)],
            delta,
            fine,
            tuple(u.describe() for r in (a, b) for u in r.units if len(u.members) > 1),
        )
    except UnsupportedError:  # a rung without a PLD (RDP-only label): no interpolation
        return None
    if bound.epsilon > target:
        return None
    names = tuple("lc(" + ", ".join(candidates[i].name for i in r.members) + ")" for r in (a, b))
    report = PrivacyReport(
        Method.RS,
        names,
        (1 - share, share),
        delta,
        bound,
        notes=(
            "random selection between two LC merges (generic gate): each merge's curves are "
            "the composition of its release units",
        ),
    )
    mixture = MergeMixture((a.weights, b.weights), (1 - share, share), (a.utility, b.utility))
    return mixture, report


def _all_candidates_epsilon(
    candidates: Sequence[Candidate], delta: float, epsilons: Sequence[float]
) -> float:
    """ε of the joint release of every candidate: the top rung of the generic ladder (the
    largest candidate ε where that release is refused or has no PLD)."""
    try:
        units = release_units(candidates)
        return profiles.epsilon_for_delta(composed_pld(units, pld_mod.COARSE_DISCRETISATION), delta)
    except (RefusalError, UnsupportedError):
        return max(epsilons)
