"""RS probabilities π and LC weights λ (docs/design.md#random-selection,
docs/design.md#generic-bound: both lie on the simplex), and the LC noise proxy that ranks
weights when no validation utility is known (docs/design.md#calibration)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from dpmerge.accounting.records import MechanismRecord, PrivacyLabel
from dpmerge.errors import RecordError

SUM_TOLERANCE = 1e-9


def simplex_weights(
    weights: Sequence[float], count: int, *, what: str = "weights"
) -> tuple[float, ...]:
    """Return ``weights`` as floats after checking they are a point of the simplex.

    Refuses (naming the problem) a wrong count, a non-number (booleans included), NaN/inf,
    negative entries, or a sum off 1 by more than 1e-9. Nothing is renormalised silently: the
    weights are part of the mechanism.
    """
    if len(weights) != count:
        raise RecordError(
            f"{what}: expected {count} values (one per candidate), got {len(weights)}"
        )
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real):
            raise RecordError(f"{what}[{i}] is {type(w).__name__}: weights must be numbers")
    values = tuple(float(w) for w in weights)
    for i, w in enumerate(values):
        if not math.isfinite(w):
            raise RecordError(f"{what}[{i}] is {w}: weights must be finite numbers")
        if w < 0:
            raise RecordError(f"{what}[{i}] = {w} is negative: weights lie on the simplex")
    total = math.fsum(values)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise RecordError(f"{what} sum to {total!r}, not 1: weights lie on the simplex")
    return values


def merged_noise_proxy(records: Sequence[MechanismRecord], weights: Sequence[float]) -> float:
    """Σ c_i²σ_i² / (Σ c_i)²: the merged update's noise variance relative to its signal scale
    (the utility proxy of docs/design.md#calibration; smaller is better)."""
    c = [w * r.contribution_scale for w, r in zip(weights, records, strict=True)]
    signal = sum(c)
    noise = sum((ci * r.noise_multiplier) ** 2 for ci, r in zip(c, records, strict=True))
    return noise / signal**2


def inverse_variance_weights(records: Sequence[MechanismRecord]) -> tuple[float, ...]:
    """λ minimising :func:`merged_noise_proxy`: c_i ∝ σ_i⁻², i.e. λ_i ∝ σ_i⁻² / (η_i C_i / B_i)
    (λ_i ∝ σ_i⁻² for equal learning rates, batches and clipping)."""
    raw = [1.0 / (r.noise_multiplier**2 * r.contribution_scale) for r in records]
    total = math.fsum(raw)
    return tuple(v / total for v in raw)


def runs_of(members: Sequence[object]) -> list[list[int]]:
    """Indices of ``members`` grouped by run: records that share a ``run_id`` are checkpoints
    of one run (docs/design.md#release-units); every other member is a run of its own."""
    groups: dict[object, list[int]] = {}
    for i, member in enumerate(members):
        run_id = getattr(member, "run_id", None)
        groups.setdefault(i if run_id is None else run_id, []).append(i)
    return list(groups.values())


def longest_of_each_run(records: Sequence[MechanismRecord]) -> list[MechanismRecord]:
    """One record per run: its longest checkpoint."""
    return [max((records[i] for i in run), key=lambda r: r.steps) for run in runs_of(records)]


def subset_utility(records: Sequence[MechanismRecord]) -> float:
    """The data-independent utility of merging ``records`` at inverse-variance weights (higher
    is better): −1 / Σ_r T_r/σ_r² over their runs r, T_r the run's steps. After T steps of
    DP-SGD the accumulated update's noise variance relative to its signal scales as σ²/T, and
    inverse-variance weights combine runs into 1 / Σ T_r/σ_r² (the contribution scales cancel
    at those weights). For runs of equal length this is :func:`merged_noise_proxy` divided by
    T, so it ranks subsets exactly as the per-step proxy does. A run counts once at its longest
    checkpoint, however many checkpoints the merge averages: they carry one noise stream, and
    averaging them is not averaging independent noise."""
    runs = longest_of_each_run(records)
    return -1.0 / math.fsum(r.steps / r.noise_multiplier**2 for r in runs)


def initialisation_conflict(members: Sequence[object]) -> str | None:
    """Why averaging these candidates' weights is not a sensible LC merge, or ``None``: records
    that start from different recorded initialisations. For a non-convex model two runs from
    different initialisations sit in different basins, and their average can be far worse than
    either (measured: 55 % for three independently initialised CNNs, 84 % each;
    docs/results.md). The rule is data-independent (it reads the records only), so calibration
    may use it to choose. An imported candidate whose profile does not state its initialisation
    starts from its own (docs/design.md#imported-candidates); other records without one are not
    compared."""
    starts: dict[str, str] = {}
    for m in members:
        if not isinstance(m, MechanismRecord | PrivacyLabel):
            continue
        if m.initialisation is not None:
            starts[m.initialisation] = f"{m.name!r} ({m.initialisation})"
        elif m.attested_by is not None:
            starts[f"unstated:{m.name}"] = f"{m.name!r} (imported, initialisation not stated)"
    if len(starts) <= 1:
        return None
    names = ", ".join(starts[start] for start in sorted(starts))
    return (
        f"candidates start from different initialisations ({names}): their weights are not "
        "averaged (docs/design.md#sharp-edges)"
    )
