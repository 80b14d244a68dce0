"""LC calibration gated by the structured bound (opt-in; docs/design.md#structured-bound,
docs/design.md#calibration).

The search space is a set of one-parameter *paths* through weight space:

* every pair (i, j): λ(t) = (1−t)·e_j + t·e_i, i the less private; t = 0 and t = 1 are the
  candidates alone, and the utility optimum is the inverse-variance point t₀;
* groups of three and four candidates adjacent in ε: λ(t) = (1−t)·w_iv + t·e_safest, from the
  group's inverse-variance weights (the utility optimum) to its most private member.

ε along a path is **not monotone**: mixing in a little of the more private model can
raise ε above both ends. So each path is scanned on a fixed grid (coarse discretisation), every
run of feasible grid points becomes a feasible segment, segment boundaries are refined by
bisection, and a local maximum inside a run is searched so that a peak between grid points
splits the run rather than hiding in it. The best-utility point over all segments is then
certified at the fine discretisation (and polished by secant steps toward the utility
optimum); coarse values only steer and never declare a point feasible.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.calibrated import Calibration, MergeUtility
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.structured import (
    structured_epsilon_pld,
    structured_refusal,
    structured_segments,
)
from dpmerge.accounting.weights import (
    initialisation_conflict,
    inverse_variance_weights,
    merged_noise_proxy,
)
from dpmerge.errors import RefusalError
from dpmerge.vocabulary import GatingBound, Method

GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
T_TOLERANCE = 1e-3  # boundary refinement stops at this width in t
POLISH_TOLERANCE = 5e-3  # polish only when the certified ε is further below the target
MAX_POLISH_STEPS = 2
MAX_GROUP_SIZE = 4


@dataclass(frozen=True)
class Path:
    """λ(t) = (1−t)·start + t·end over the candidates (full-length weight vectors)."""

    members: tuple[int, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]
    optimum: float  # t of the best noise proxy on the path

    def weights(self, t: float) -> tuple[float, ...]:
        raw = [(1 - t) * a + t * b for a, b in zip(self.start, self.end, strict=True)]
        total = math.fsum(raw)
        return tuple(w / total for w in raw)


@dataclass(frozen=True)
class _Point:
    path: Path
    t: float
    utility: float
    boundary_toward: float | None  # infeasible t next to this boundary point, if any


class _Search:
    """State of one calibration: candidates, target and cached coarse evaluations."""

    def __init__(
        self,
        records: tuple[MechanismRecord, ...],
        target: float,
        delta: float,
        merge_utility: MergeUtility | None,
    ) -> None:
        self.records = records
        self.target = target
        self.delta = delta
        self.merge_utility = merge_utility
        self.coarse_calls = 0
        self.fine_calls = 0
        self.max_seen = 0.0

    def coarse(self, weights: tuple[float, ...]) -> float:
        self.coarse_calls += 1
        value = _coarse_epsilon(self.records, _key(weights), self.delta)
        self.max_seen = max(self.max_seen, value)
        return value

    def utility(self, weights: tuple[float, ...]) -> float:
        if self.merge_utility is not None:
            return float(self.merge_utility(weights))
        used = [(w, r) for w, r in zip(weights, self.records, strict=True) if w > 0]
        return -merged_noise_proxy([r for _, r in used], [w for w, _ in used])

    def feasible(self, path: Path, t: float) -> bool:
        return self.coarse(path.weights(t)) <= self.target

    def refine(self, path: Path, feasible_t: float, infeasible_t: float) -> float:
        """A feasible t near the crossing between a feasible and an infeasible t: Illinois
        regula falsi on the coarse ε − target; stops within :data:`T_TOLERANCE` in t or
        :data:`POLISH_TOLERANCE` below the target in ε."""
        f_in = self.coarse(path.weights(feasible_t)) - self.target
        f_out = self.coarse(path.weights(infeasible_t)) - self.target
        slack, side = -f_in, 0
        while abs(feasible_t - infeasible_t) > T_TOLERANCE and slack > POLISH_TOLERANCE:
            fraction = min(max(f_in / (f_in - f_out), 0.02), 0.98)
            t = feasible_t + fraction * (infeasible_t - feasible_t)
            f = self.coarse(path.weights(t)) - self.target
            if f <= 0:
                feasible_t, f_in, slack = t, f, -f
                f_out = f_out / 2 if side == 1 else f_out
                side = 1
            else:
                infeasible_t, f_out = t, f
                f_in = f_in / 2 if side == -1 else f_in
                side = -1
        return feasible_t

    def peak(self, path: Path, low: float, high: float) -> tuple[float, float]:
        """Golden-section search for the largest ε on [low, high] (coarse); (t, ε)."""
        ratio = (math.sqrt(5) - 1) / 2
        a, b = low, high
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        fc, fd = self.coarse(path.weights(c)), self.coarse(path.weights(d))
        while b - a > T_TOLERANCE:
            if fc > fd:
                b, d, fd = d, c, fc
                c = b - ratio * (b - a)
                fc = self.coarse(path.weights(c))
            else:
                a, c, fc = c, d, fd
                d = a + ratio * (b - a)
                fd = self.coarse(path.weights(d))
        return (c, fc) if fc > fd else (d, fd)


def _key(weights: Sequence[float]) -> tuple[float, ...]:
    return tuple(round(w, 12) for w in weights)


@lru_cache(maxsize=65536)
def _coarse_epsilon(
    records: tuple[MechanismRecord, ...], weights: tuple[float, ...], delta: float
) -> float:
    segments = structured_segments(records, weights)
    return structured_epsilon_pld(segments, delta, pld_mod.COARSE_DISCRETISATION)


def _paths(records: Sequence[MechanismRecord], epsilons: Sequence[float]) -> list[Path]:
    k = len(records)
    unit = [tuple(1.0 if n == i else 0.0 for n in range(k)) for i in range(k)]
    by_epsilon = sorted(range(k), key=lambda i: -epsilons[i])
    paths = []
    for a, b in itertools.combinations(by_epsilon, 2):  # a is the less private
        if structured_refusal(records, [x + y for x, y in zip(unit[a], unit[b], strict=True)]):
            continue
        if initialisation_conflict([records[a], records[b]]):
            continue
        optimum = inverse_variance_weights([records[a], records[b]])[0]
        paths.append(Path((a, b), unit[b], unit[a], optimum=optimum))
    for size in range(3, min(MAX_GROUP_SIZE, k) + 1):
        for offset in range(k - size + 1):
            members = tuple(by_epsilon[offset : offset + size])
            if initialisation_conflict([records[i] for i in members]):
                continue
            iv = inverse_variance_weights([records[i] for i in members])
            start = [0.0] * k
            for i, w in zip(members, iv, strict=True):
                start[i] = w
            if structured_refusal(records, start):
                continue
            safest = members[-1]
            paths.append(Path(members, tuple(start), unit[safest], optimum=0.0))
    return paths


def _grid(path: Path) -> list[float]:
    return sorted(set(GRID) | {round(path.optimum, 6)})


def feasible_segments(search: _Search, path: Path) -> list[tuple[float, float]]:
    """Every feasible segment of a path: runs of feasible grid points, boundaries refined, and
    a run split where ε peaks above the target between its grid points.

    A unimodal curve sampled on a grid can hide its maximum only next to the grid maximum, so
    each run is searched there (golden section). Coarse values steer; the chosen point is
    certified separately.
    """
    ts = _grid(path)
    values = [search.coarse(path.weights(t)) for t in ts]
    segments = []
    index = 0
    while index < len(ts):
        if values[index] > search.target:
            index += 1
            continue
        first = index
        while index + 1 < len(ts) and values[index + 1] <= search.target:
            index += 1
        last = index
        index += 1
        low, high = ts[first], ts[last]
        if first > 0:
            low = search.refine(path, low, ts[first - 1])
        if last + 1 < len(ts):
            high = search.refine(path, high, ts[last + 1])
        if first == last:
            segments.append((low, high))
            continue
        top = max(range(first, last + 1), key=lambda i: values[i])
        t_peak, e_peak = search.peak(path, ts[max(top - 1, first)], ts[min(top + 1, last)])
        if e_peak > search.target:
            segments.append((low, search.refine(path, ts[max(top - 1, first)], t_peak)))
            segments.append((search.refine(path, ts[min(top + 1, last)], t_peak), high))
        else:
            segments.append((low, high))
    return [(lo, hi) for lo, hi in segments if lo <= hi]


def _best_on_path(search: _Search, path: Path) -> _Point | None:
    """The best feasible point of a path: its optimum if feasible, else the feasible point
    nearest the optimum on each side whose end is feasible (utility is unimodal along a path,
    peaking at the optimum). Each side is one regula-falsi refinement between the feasible end
    and the infeasible optimum: along a unimodal ε curve there is exactly one crossing there
    (notes: accounting-probe §5); elsewhere it still returns a feasible point."""
    weights = path.weights
    if search.coarse(weights(path.optimum)) <= search.target:
        return _Point(path, path.optimum, search.utility(weights(path.optimum)), None)
    best = None
    for end in (0.0, 1.0):
        if end == path.optimum or search.coarse(weights(end)) > search.target:
            continue
        refined = search.refine(path, end, path.optimum)
        point = _Point(path, refined, search.utility(weights(refined)), path.optimum)
        if best is None or point.utility > best.utility:
            best = point
    return best


def _certify(
    search: _Search, point: _Point, candidates: Sequence[Candidate]
) -> tuple[_Point, PrivacyReport] | None:
    """Fine certification; steps into the feasible side if the coarse boundary was too close."""
    t = point.t
    for _ in range(6):
        search.fine_calls += 1
        report = account(
            candidates,
            Method.LC,
            point.path.weights(t),
            search.delta,
            gating_bound=GatingBound.STRUCTURED,
        )
        if report.epsilon <= search.target:
            return _Point(
                point.path, t, search.utility(point.path.weights(t)), point.boundary_toward
            ), report
        if point.boundary_toward is None:
            return None
        t += 2 * T_TOLERANCE * (1 if t > point.boundary_toward else -1)
        if not 0.0 <= t <= 1.0:
            return None
    return None


def _polish(
    search: _Search, point: _Point, report: PrivacyReport, candidates: Sequence[Candidate]
) -> tuple[_Point, PrivacyReport]:
    """Secant steps at the fine discretisation toward the infeasible side, keeping the best
    certified point: spends the coarse–fine gap on utility."""
    if point.boundary_toward is None:
        return point, report
    inside_t, inside_e = point.t, report.epsilon
    outside_t = point.boundary_toward
    outside_e = search.coarse(point.path.weights(outside_t))
    for _ in range(MAX_POLISH_STEPS):
        if search.target - inside_e <= POLISH_TOLERANCE or outside_e <= inside_e:
            break
        t = inside_t + (search.target - inside_e) * (outside_t - inside_t) / (outside_e - inside_e)
        search.fine_calls += 1
        trial = account(
            candidates,
            Method.LC,
            point.path.weights(t),
            search.delta,
            gating_bound=GatingBound.STRUCTURED,
        )
        if trial.epsilon <= search.target:
            inside_t, inside_e, report = t, trial.epsilon, trial
        else:
            outside_t, outside_e = t, trial.epsilon
    polished = _Point(
        point.path, inside_t, search.utility(point.path.weights(inside_t)), point.boundary_toward
    )
    return polished, report


def calibrate_structured(
    candidates: Sequence[Candidate],
    target: float,
    delta: float,
    epsilons: Sequence[float],
    merge_utility: MergeUtility | None,
    *,
    map_segments: bool = False,
) -> Calibration:
    """See the module docstring. Raises ``RefusalError`` when no pair qualifies.

    The chosen point is found from the optimum and both path ends without mapping every
    segment; ``map_segments`` adds the chosen path's full segment map (coarse grid, refined
    boundaries, peak search) to ``search``, a diagnostic that costs 20–40 coarse evaluations.
    """
    if not all(isinstance(c, MechanismRecord) for c in candidates):
        labels = [c.name for c in candidates if not isinstance(c, MechanismRecord)]
        raise RefusalError(
            f"structured bound refused: label-only candidates {', '.join(labels)} have no "
            "training record; use the generic bound or RS"
        )
    records = tuple(c for c in candidates if isinstance(c, MechanismRecord))
    search = _Search(records, target, delta, merge_utility)
    paths = _paths(records, epsilons)
    k = len(records)
    singles = [
        Path(
            (i,),
            tuple(1.0 if n == i else 0.0 for n in range(k)),
            tuple(1.0 if n == i else 0.0 for n in range(k)),
            optimum=0.0,
        )
        for i in range(k)
        if not structured_refusal(records, [1.0 if n == i else 0.0 for n in range(k)])
    ]
    if not paths and not singles:
        raise RefusalError("structured bound refused for every candidate")
    # Branch and bound on the utility optimum of each path (exact for the noise proxy).
    # No merge is more private than its most private member, so a path whose members
    # all exceed the target is skipped unevaluated.
    paths = [p for p in paths if min(epsilons[i] for i in p.members) <= target]
    ranked = sorted(paths, key=lambda p: -search.utility(p.weights(p.optimum)))
    best: _Point | None = None
    explored = 0
    for path in ranked:
        incumbent = best.utility if best is not None else -math.inf
        if merge_utility is None and search.utility(path.weights(path.optimum)) <= incumbent:
            continue
        explored += 1
        point = _best_on_path(search, path)
        if point is not None and (best is None or point.utility > best.utility):
            best = point
    for single in singles:  # every candidate alone is a (degenerate) path
        if epsilons[single.members[0]] <= target:
            point = _Point(single, 0.0, search.utility(single.start), None)
            if best is None or point.utility > best.utility:
                best = point
    assert best is not None, "the most private candidate alone meets a feasible target"
    certified = _certify(search, best, candidates)
    if certified is None:  # fall back to the most private candidate alone
        safest = min(range(k), key=lambda i: epsilons[i])
        fallback = next(s for s in singles if s.members == (safest,))
        certified = _certify(search, _Point(fallback, 0.0, 0.0, None), candidates)
        assert certified is not None
    point, report = _polish(search, *certified, candidates)
    return Calibration(
        method=Method.LC,
        target_epsilon=target,
        delta=delta,
        weights=point.path.weights(point.t),
        report=report,
        reachable_epsilon_range=(min(epsilons), max(max(epsilons), search.max_seen)),
        utility=point.utility,
        utility_kind=(
            "validation accuracy"
            if merge_utility is not None
            else "noise proxy: −Σc²σ²/(Σc)² (docs/design.md#calibration)"
        ),
        search={
            "path": [records[i].name for i in point.path.members],
            "t": point.t,
            "path_from": list(point.path.start),
            "path_to": list(point.path.end),
            "feasible_segments": (
                [list(seg) for seg in feasible_segments(search, point.path)]
                if map_segments
                else None
            ),
            "paths_considered": len(paths),
            "paths_explored": explored,
            "coarse_evaluations": search.coarse_calls,
            "fine_evaluations": search.fine_calls,
        },
    )
