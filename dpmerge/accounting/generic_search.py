"""LC calibration gated by the generic bound (docs/design.md#generic-bound,
docs/design.md#calibration).

The generic bound does not depend on λ, only on which candidates are used (through their
release units), so the search is over *subsets*: each subset is one rung of a ladder of
reachable ε values. Which rung is chosen must not depend on the data (a choice that consults
candidates outside the released subset is not covered by that subset's bound), so rungs are
ranked by the data-independent noise proxy of their inverse-variance merge, steered by the
coarse grid and certified at the fine one; the best certified rung is returned.

Within the chosen rung the weights are free: every λ over the rung is post-processing of the
rung's joint release. By default they are inverse-variance (data-independent); with
``merge_utility`` (validation accuracy, opt-in) they are tuned among a fixed family without
changing the bound. A secret draw between two rungs, which lands between them, is the
``mixture`` method (``dpmerge.accounting.mixture``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import unavailable
from dpmerge.accounting.calibrated import COARSE_MARGIN, Calibration, MergeUtility
from dpmerge.accounting.generic import ReleaseUnit, composed_pld, release_units
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.weights import (
    initialisation_conflict,
    inverse_variance_weights,
    runs_of,
    subset_utility,
)
from dpmerge.errors import RefusalError, UnsupportedError
from dpmerge.vocabulary import BoundKind, Method

MAX_EXHAUSTIVE_SUBSETS = 10
"""Enumerate every subset up to this many candidates (1023 subsets); greedy beyond."""

TUNING_POWERS = (0.0, 1.0, 2.0, 3.0, 4.0)
"""The weight family tuned within a rung: λ_i ∝ σ_i^(−p)·B_i/(η_i·C_i); p = 2 is
inverse-variance (the proxy's optimum), p = 0 equal contributions."""


@dataclass(frozen=True)
class Rung:
    """One subset merge: its members (indices), release units, full-length weights and
    data-independent proxy utility (higher is better)."""

    members: tuple[int, ...]
    units: tuple[ReleaseUnit, ...]
    weights: tuple[float, ...]
    proxy: float

    def coarse_epsilon(self, delta: float) -> float:
        return profiles.epsilon_for_delta(
            composed_pld(self.units, pld_mod.COARSE_DISCRETISATION), delta
        )

    def delta_at(self, epsilon: float, discretisation: float) -> float:
        return float(
            profiles.delta_for_epsilon(composed_pld(self.units, discretisation), epsilon)[0]
        )


def subset_weights(members: Sequence[Candidate], power: float = 2.0) -> tuple[float, ...]:
    """λ_r ∝ σ_r^(−power) / (η_r·C_r/B_r) per run of the subset (``power`` 2:
    inverse-variance), split equally among the run's checkpoints (an average of its
    iterates); equal weights where a member is label-only."""
    if not all(isinstance(m, MechanismRecord) for m in members):
        return tuple(1.0 / len(members) for _ in members)
    runs = runs_of(members)
    first = [members[run[0]] for run in runs]
    if power == 2.0:
        shares = inverse_variance_weights(first)  # type: ignore[arg-type]
    else:
        raw = [
            m.noise_multiplier**-power / m.contribution_scale  # type: ignore[union-attr]
            for m in first
        ]
        shares = tuple(v / math.fsum(raw) for v in raw)
    weights = [0.0] * len(members)
    for run, share in zip(runs, shares, strict=True):
        for i in run:
            weights[i] = share / len(run)
    return tuple(weights)


def _embed(k: int, members: Sequence[int], values: Sequence[float]) -> tuple[float, ...]:
    weights = [0.0] * k
    for i, v in zip(members, values, strict=True):
        weights[i] = v
    return tuple(weights)


def candidate_subsets(
    candidates: Sequence[Candidate], epsilons: Sequence[float], target: float
) -> list[tuple[int, ...]]:
    """The member sets of the ladder: subsets of *runs*, each run taken up to a common stop
    (a step count), with every checkpoint of it up to that stop — an LC over checkpoints of
    one run averages its iterates at the cost of the longest (docs/design.md#release-units).
    Records without a shared ``run_id`` are runs of their own, so without checkpoints these
    are the subsets of the candidates. Only sets whose members each meet the target
    (composition never falls below a member's ε); exhaustive up to
    :data:`MAX_EXHAUSTIVE_SUBSETS` runs, nested greedy prefixes beyond."""
    allowed = [i for i in range(len(candidates)) if epsilons[i] <= target]
    groups = [[allowed[j] for j in run] for run in runs_of([candidates[i] for i in allowed])]
    if len(groups) <= MAX_EXHAUSTIVE_SUBSETS:
        chosen = [c for r in range(1, len(groups) + 1) for c in itertools.combinations(groups, r)]
    else:
        order = sorted(groups, key=lambda g: -max(epsilons[i] for i in g))
        chosen = [(g,) for g in groups] + [tuple(order[:r]) for r in range(2, len(order) + 1)]
    stops = sorted({_steps(candidates[i]) for i in allowed})
    found: dict[tuple[int, ...], None] = {}
    for subset in chosen:
        for stop in stops:
            parts = [[i for i in group if _steps(candidates[i]) <= stop] for group in subset]
            if all(parts):  # every run of the subset has a checkpoint within the stop
                found.setdefault(tuple(sorted(i for part in parts for i in part)), None)
    return list(found)


def _steps(candidate: Candidate) -> int:
    return candidate.steps if isinstance(candidate, MechanismRecord) else 0


TUNED_REASON = (
    "weights tuned by validation accuracy: the structured bound assumes weights chosen "
    "independently of the data (the generic bound covers any weights over the subset)"
)
PROXY_KIND = "noise proxy: −1/Σ T/σ² over the runs used (docs/design.md#calibration)"
LABEL_PROXY_KIND = "ε spent (label-only candidates)"


def rungs(
    candidates: Sequence[Candidate], target: float, epsilons: Sequence[float]
) -> tuple[list[Rung], list[str]]:
    """Every usable subset as a rung, best proxy first, and why others were skipped. Records
    are ranked by the noise proxy; label-only candidates (no proxy) join only a ladder of
    labels, ranked by ε spent."""
    k = len(candidates)
    all_labels = not any(isinstance(c, MechanismRecord) for c in candidates)
    usable = {i for i in range(k) if all_labels or isinstance(candidates[i], MechanismRecord)}
    skipped = [
        f"{candidates[i].name!r} left out: a label-only candidate has no noise proxy to rank "
        "merges by"
        for i in range(k)
        if i not in usable
    ]
    found = []
    for members in candidate_subsets(candidates, epsilons, target):
        if not set(members) <= usable:
            continue
        chosen = [candidates[i] for i in members]
        conflict = initialisation_conflict(chosen)
        if conflict is not None:
            if conflict not in skipped:
                skipped.append(conflict)
            continue
        try:
            units = release_units(chosen)
        except RefusalError as refusal:
            skipped.append(str(refusal))
            continue
        weights = subset_weights(chosen)
        proxy = (
            max(epsilons[i] for i in members) if all_labels else subset_utility(chosen)  # type: ignore[arg-type]
        )
        found.append(Rung(members, units, _embed(k, members, weights), proxy))
    found.sort(key=lambda r: (-r.proxy, len(r.members)))
    return found, skipped


def tune_within(
    candidates: Sequence[Candidate], rung: Rung, merge_utility: MergeUtility
) -> tuple[tuple[float, ...], float]:
    """The best (weights, validation utility) of the fixed family over the rung's members:
    every member of it has the rung's generic bound (docs/design.md#calibration)."""
    members = [candidates[i] for i in rung.members]
    family = {
        _embed(len(candidates), rung.members, subset_weights(members, p)) for p in TUNING_POWERS
    }
    scored = sorted(
        ((float(merge_utility(w)), w) for w in family), key=lambda x: (-x[0], x[1] != rung.weights)
    )
    utility, weights = scored[0]
    return weights, utility


def calibrate_lc_generic(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
) -> Calibration:
    """See the module docstring."""
    ladder, skipped = rungs(candidates, target, epsilons)
    certified = 0
    chosen: Rung | None = None
    for rung in ladder:
        if rung.coarse_epsilon(delta) > target + COARSE_MARGIN:
            continue
        certified += 1
        if account(candidates, Method.LC, rung.weights, delta).epsilon <= target:
            chosen = rung
            break
    if chosen is None:
        # Nothing usable certified (e.g. only a label-only candidate meets the target): the
        # most private candidate alone always does.
        chosen = single_rung(candidates, epsilons)
    search: dict[str, Any] = {
        "subsets_considered": len(ladder),
        "fine_certifications": certified,
        "members": [candidates[i].name for i in chosen.members],
        "skipped": skipped,
    }
    reachable = reachable_range(candidates, Method.LC, delta, epsilons)
    weights, utility = chosen.weights, chosen.proxy
    report = account(candidates, Method.LC, weights, delta)
    if merge_utility is not None and len(chosen.members) > 1:
        weights, utility = tune_within(candidates, chosen, merge_utility)
        report = replace(
            account(candidates, Method.LC, weights, delta),
            structured=unavailable(BoundKind.STRUCTURED, delta, TUNED_REASON),
        )
    elif merge_utility is not None:
        utility = float(merge_utility(weights))
    return Calibration(
        method=Method.LC,
        target_epsilon=target,
        delta=delta,
        weights=weights,
        report=report,
        reachable_epsilon_range=reachable,
        utility=None if math.isinf(utility) else utility,
        utility_kind=utility_kind(merge_utility, candidates),
        search=search,
    )


def single_rung(candidates: Sequence[Candidate], epsilons: Sequence[float]) -> Rung:
    """The most private candidate alone: the rung every feasible target can afford (its
    utility ``-inf``: it is the fallback, never preferred)."""
    safest = min(range(len(candidates)), key=lambda i: epsilons[i])
    weights = _embed(len(candidates), (safest,), (1.0,))
    return Rung((safest,), release_units([candidates[safest]]), weights, -math.inf)


def utility_kind(
    merge_utility: MergeUtility | None, candidates: Sequence[Candidate], *, expected: bool = False
) -> str:
    if merge_utility is not None:
        what = "validation accuracy (weights tuned within the subset chosen by the noise proxy)"
    elif any(isinstance(c, MechanismRecord) for c in candidates):
        what = PROXY_KIND
    else:
        what = LABEL_PROXY_KIND
    return f"expected {what}" if expected else what


def reachable_range(
    candidates: Sequence[Candidate], method: Method, delta: float, epsilons: Sequence[float]
) -> tuple[float, float]:
    """The ε a merge of ``candidates`` can have (``epsilons``: each candidate's own): from the
    most private candidate up to the least private one for RS, up to the joint release of every
    candidate for LC and the mixture (docs/design.md#calibration)."""
    if method == Method.RS:
        return (min(epsilons), max(epsilons))
    return (min(epsilons), _all_candidates_epsilon(candidates, delta, epsilons))


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
