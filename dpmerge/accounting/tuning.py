"""The merges private tuning chooses among, and the bound its release states
(docs/design.md#private-tuning).

The options: a simplex grid of LC weights over the subset S the generic gate calibrates for the
target (weights in multiples of 1/``resolution``; a weight of 0 drops a member, so S's subsets
are options too), the inverse-variance weights of S (the data-independent LC), and ``auto``'s
own release (RS, LC or the mixture, chosen from the records). The selection looks at every
option's validation accuracy, so, as a function of the training rows, the release is
post-processing of every candidate it consulted, not only of the ones it uses: its training
rows' bound is the generic bound of the consulted set U (the joint release of U's runs), stated
whatever option wins. ``auto``'s release is an option only where U = S ∪ (auto's candidates)
stays within the target; otherwise U = S, whose bound the generic gate already certified.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import PrivacyReport, unavailable
from dpmerge.accounting.calibrated import Calibration
from dpmerge.accounting.records import Candidate
from dpmerge.errors import RecordError
from dpmerge.vocabulary import BoundKind, Method

RESOLUTION = 4
"""LC weights on the grid are multiples of 1/4."""
AUTO_LABEL = "auto"
TUNED_NOTE = (
    "privately tuned: chosen among {options} merges by the exponential mechanism on validation "
    "accuracy; the training rows' bound is that of every candidate consulted ({consulted})"
)


@dataclass(frozen=True)
class TuningOption:
    """One merge the selection may release: LC ``weights``, or (``weights`` ``None``)
    ``auto``'s own release."""

    label: str
    weights: tuple[float, ...] | None = None


@dataclass(frozen=True)
class TuningPlan:
    """The options, the candidates the selection consults and their joint bound ``bound``
    (the LC report of equal weights over them: the generic gate's bound of that set)."""

    options: tuple[TuningOption, ...]
    consulted: tuple[str, ...]
    bound: PrivacyReport
    auto: Calibration
    lc: Calibration


def simplex_grid(members: Sequence[int], k: int, resolution: int) -> list[tuple[float, ...]]:
    """Every weight vector over ``members`` (of ``k`` candidates) in multiples of
    1/``resolution`` that sums to 1."""
    grid = []
    for parts in itertools.product(range(resolution + 1), repeat=len(members)):
        if sum(parts) != resolution:
            continue
        weights = [0.0] * k
        for i, part in zip(members, parts, strict=True):
            weights[i] = part / resolution
        grid.append(tuple(weights))
    return grid


def _equal(k: int, members: Sequence[int]) -> tuple[float, ...]:
    return tuple(1.0 / len(members) if i in members else 0.0 for i in range(k))


def tuning_plan(
    records: Sequence[Candidate],
    auto: Calibration,
    lc: Calibration,
    resolution: int = RESOLUTION,
) -> TuningPlan:
    """The options at ``auto``'s target: ``lc`` is the generic gate's LC calibration (its
    subset S), ``auto`` the release ``choose_method`` picked (see the module docstring)."""
    k = len(records)
    if lc.weights is None:
        raise RecordError("private tuning needs the generic gate's LC weights")
    subset = [i for i, w in enumerate(lc.weights) if w > 0]
    used = set(auto.report.used_candidates)
    union = sorted(set(subset) | {i for i, r in enumerate(records) if r.name in used})
    joint = account(records, Method.LC, _equal(k, union), auto.delta)
    with_auto = joint.epsilon <= auto.target_epsilon
    members = union if with_auto else subset
    bound = joint if with_auto else account(records, Method.LC, _equal(k, subset), auto.delta)
    grid = {lc.weights: "lc (inverse-variance)"}
    for weights in simplex_grid(subset, k, resolution):
        grid.setdefault(weights, "lc " + ",".join(f"{w:g}" for w in weights))
    options = [TuningOption(label, weights) for weights, label in grid.items()]
    if with_auto:
        options.insert(0, TuningOption(f"{AUTO_LABEL} ({auto.method})"))
    return TuningPlan(tuple(options), tuple(records[i].name for i in members), bound, auto, lc)


def option_counts(
    plan: TuningPlan, accuracy: Callable[[tuple[float, ...]], float], n: int
) -> list[float]:
    """Each option's count of correct predictions on ``n`` validation rows, from ``accuracy``
    of an LC merge's weights (RS and the mixture: the expected count over the draw)."""
    counts = []
    for option in plan.options:
        merges, odds = choices(plan.auto) if option.weights is None else ([option.weights], [1.0])
        counts.append(n * sum(p * accuracy(w) for w, p in zip(merges, odds, strict=True) if p > 0))
    return counts


def choices(calibration: Calibration) -> tuple[list[tuple[float, ...]], list[float]]:
    """A release's LC merges and their odds: one merge (LC), one candidate each (RS), two
    rungs (the mixture)."""
    report = calibration.report
    k = len(report.names)
    if report.method == Method.LC:
        return [tuple(report.weights)], [1.0]
    if report.method == Method.RS:
        one_hot = [tuple(float(i == j) for j in range(k)) for i in range(k)]
        return one_hot, list(report.weights)
    return [tuple(r.weights) for r in report.rungs], [r.probability for r in report.rungs]


def tuned_release(plan: TuningPlan, index: int, records: Sequence[Candidate]) -> Calibration:
    """The calibration of option ``index``, stating the consulted set's bound as its gating
    bound (the structured bound does not apply to a data-dependent choice)."""
    option = plan.options[index]
    auto = plan.auto
    if option.weights is None:
        base = auto
        report = auto.report
    else:
        report = account(records, Method.LC, option.weights, auto.delta)
        base = replace(plan.lc, weights=option.weights)
    note = TUNED_NOTE.format(options=len(plan.options), consulted=", ".join(plan.consulted))
    report = replace(
        report,
        gating=plan.bound.gating,
        generic=plan.bound.generic if report.method == Method.LC else report.generic,
        structured=unavailable(BoundKind.STRUCTURED, auto.delta, "privately tuned")
        if report.method == Method.LC
        else report.structured,
        notes=(*report.notes, note),
    )
    return replace(base, report=report, utility=None, utility_kind="private selection")
