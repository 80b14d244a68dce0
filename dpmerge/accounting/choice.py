"""Which method a policy's ``auto`` releases: RS, LC or the mixture, by a rule read off the
mechanism records only (docs/design.md#calibration).

Each calibrated release is scored by its expected data-independent utility: the release is one
of its components (RS: a candidate with probability π_i; LC: its subset; the mixture: a rung
with its odds), and a component's utility is that of its subset's inverse-variance merge,
−1/Σ_r T_r/σ_r² over its runs (``weights.subset_utility``) — the quantity the generic ladder and
the mixture programme rank by.
The highest expected utility wins; ties go to LC (no secret draw), then the mixture, then RS.
The mixture's programme ranges over every rung, single candidates included, so when it mixes it
scores at least as high as LC's rung and RS's pair; it wins exactly when a draw between two
rungs spends the target better than one rung. Validation accuracy never enters: a choice that
consulted it would depend on every candidate consulted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dpmerge.accounting.calibrated import Calibration
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.accounting.weights import subset_utility
from dpmerge.errors import RecordError
from dpmerge.vocabulary import Method, choose

PREFERENCE = (Method.LC, Method.MIXTURE, Method.RS)
"""Order among equal utilities: LC first (no secret draw); then the mixture, whose merges
average at least what RS's candidates hold (a run counts once in the utility, so RS between
two checkpoints ties with the mixture of the merges that end at them)."""
TIE = 1e-12


@dataclass(frozen=True)
class MethodChoice:
    """The chosen release, and every offered method's expected utility (``None``: not
    scorable, e.g. label-only candidates have no σ)."""

    method: Method
    calibration: Calibration
    utilities: dict[str, float | None]

    @property
    def reason(self) -> str:
        scores = ", ".join(
            f"{m} {'n/a' if u is None else f'{u:.6g}'}" for m, u in self.utilities.items()
        )
        return (
            f"{self.method}: the highest expected noise-proxy utility read off the records "
            f"({scores}; ties go to lc, then mixture)"
        )


def components(calibration: Calibration, names: Sequence[str]) -> list[tuple[float, list[str]]]:
    """The release as (probability, candidates it combines) pairs."""
    report = calibration.report
    if report.method == Method.MIXTURE:
        return [(r.probability, list(r.members(report.names))) for r in report.rungs]
    weights = dict(zip(report.names, report.weights, strict=True))
    if report.method == Method.RS:
        return [(weights[n], [n]) for n in names if weights.get(n, 0) > 0]
    return [(1.0, [n for n in names if weights.get(n, 0) > 0])]


def expected_utility(calibration: Calibration, records: Sequence[Candidate]) -> float | None:
    """Σ_components p·u(subset), u the subset's inverse-variance noise proxy; ``None`` when a
    used candidate is label-only."""
    by_name = {r.name: r for r in records}
    total = []
    for p, subset in components(calibration, [r.name for r in records]):
        members = [by_name[n] for n in subset]
        if not all(isinstance(m, MechanismRecord) for m in members):
            return None
        total.append(p * subset_utility(members))  # type: ignore[arg-type]
    return math.fsum(total)


def choose_method(
    calibrations: Mapping[Method | str, Calibration], records: Sequence[Candidate]
) -> MethodChoice:
    """The release ``auto`` makes among ``calibrations`` (keyed by method; any of rs, lc,
    mixture, each calibrated for ``records`` at the same target) — see the module docstring."""
    if not calibrations:
        raise RecordError("choose_method needs at least one calibration")
    offered = {choose(Method, m, "method"): c for m, c in calibrations.items()}
    names = {r.name for r in records}
    for method, calibration in offered.items():
        if calibration.method != method or set(calibration.report.names) != names:
            raise RecordError(f"the {method} calibration is not one of these records' {method}")
    utilities = {str(m): expected_utility(c, records) for m, c in offered.items()}
    scores = {m: -math.inf if utilities[m] is None else utilities[m] for m in offered}
    best = max(scores.values())
    tolerance = TIE * max(1.0, abs(best)) if math.isfinite(best) else 0.0
    near = [m for m in offered if scores[m] >= best - tolerance]
    method = min(near, key=PREFERENCE.index)
    return MethodChoice(method, offered[method], utilities)
