"""The generic LC bound over release units (docs/design.md#generic-bound,
docs/design.md#release-units).

An LC merge θ = Σ λ_i·θ_i is post-processing of releasing every candidate with λ_i ≠ 0, so its ε
is at most the ε of their joint release, whatever λ is. Composition bounds a joint release only
between mechanisms with independent randomness, so the used candidates are first grouped into
*release units*, each analysed as one mechanism, and the units are composed:

* one DP-SGD run is one unit; checkpoints of it (same ``run_id``, streams and
  hyper-parameters, different step counts) are covered by the longest, since DP-SGD's
  accounting already covers every iterate of a run;
* runs that drew the *same* Poisson batches (one ``batch_lineage``) with independent noise are
  ONE unit: at each step the differing record is in the shared batch with probability q and
  then shifts every active run's noisy sum by at most C, so the joint release is one
  Poisson-subsampled Gaussian with σ_eff(t) = (Σ_{i active at t} σ_i⁻²)^(−1/2) — segmented by
  the set of still-active runs when step counts differ. Composing such runs as if
  independent understates ε;
* a noise lineage shared by different runs (a reused noise stream) is refused: noises can
  cancel in a linear combination, and composition assumes fresh randomness. So is a shared
  noise lineage without a ``run_id`` that identifies the records as checkpoints of one run;
* a label-only candidate is one unit, its randomness assumed independent of the others'; two
  or more *imported* label-only candidates are refused together, since their batches and noise
  are unknown and no composition bounds them (docs/design.md#imported-candidates);
* imported runs whose batches are unknown share the batch lineage ``unknown:<dataset>``, so
  they form one shared-batch unit (the conservative reading).

Units are composed in one pessimistic PLD accounting and their RDP curves are summed. The same
units bound the release ledger (docs/design.md#release-ledger).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from dp_accounting import dp_event

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import PairBound, bound_from_curves
from dpmerge.accounting.records import (
    UNKNOWN_BATCH_LINEAGE,
    Candidate,
    MechanismRecord,
    PrivacyLabel,
)
from dpmerge.errors import RefusalError, UnsupportedError
from dpmerge.vocabulary import BoundKind, UnitKind

SIGMA_ROUNDING = 1e-12
"""σ_eff is lowered by this relative amount, so float rounding never favours privacy."""


@dataclass(frozen=True)
class Segment:
    """``steps`` Poisson-subsampled Gaussian steps at rate ``sample_rate``, noise
    ``noise_multiplier`` (add-or-remove-one, sensitivity 1)."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def dp_event(self) -> dp_event.DpEvent:
        return dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(
                self.sample_rate, dp_event.GaussianDpEvent(self.noise_multiplier)
            ),
            self.steps,
        )


@dataclass(frozen=True)
class ReleaseUnit:
    """One mechanism of the joint release: DP-SGD segments, or a privacy label."""

    kind: UnitKind
    members: tuple[str, ...]
    """Names of every candidate the unit covers (collapsed checkpoints included)."""
    segments: tuple[Segment, ...] = ()
    label: PrivacyLabel | None = None
    unknown_batches: bool = False
    """Imported runs whose batches are unknown, taken as shared
    (docs/design.md#imported-candidates)."""

    def dp_event(self) -> dp_event.DpEvent:
        """The dp_accounting event of a DP-SGD unit (the composition of its segments)."""
        if self.label is not None:
            raise UnsupportedError("event", f"label {self.label.name!r} has no DP-SGD event")
        return dp_event.ComposedDpEvent([s.dp_event() for s in self.segments])

    def describe(self) -> str:
        names = ", ".join(repr(m) for m in self.members)
        if self.kind == UnitKind.LABEL:
            return f"label-only candidate {names}: taken as given, randomness assumed independent"
        if self.kind == UnitKind.SHARED_BATCHES:
            sigmas = ", ".join(f"{s.noise_multiplier:.4g}×{s.steps}" for s in self.segments)
            drew = "may have drawn (imported, batches unknown)" if self.unknown_batches else "drew"
            return (
                f"{names} {drew} the same Poisson batches: one release unit, a subsampled "
                f"Gaussian per step with σ_eff = (Σσ_i⁻²)^(−1/2) (σ_eff×steps: {sigmas})"
            )
        return f"checkpoints {names} of one run: covered by the longest (one release unit)"


def _collapse_runs(records: Sequence[MechanismRecord]) -> list[tuple[MechanismRecord, list[str]]]:
    """One (longest record, covered names) per noise lineage; refuses a shared noise lineage
    that is not explicitly one run."""
    runs: dict[str, tuple[MechanismRecord, list[str]]] = {}
    for record in records:
        lineage = record.noise_lineage
        if lineage not in runs:
            runs[lineage] = (record, [record.name])
            continue
        longest, names = runs[lineage]
        if not longest.same_run_except_steps(record):
            raise RefusalError(_shared_noise_reason(longest, record))
        names.append(record.name)
        if record.steps > longest.steps:
            runs[lineage] = (record, names)
    return list(runs.values())


def _shared_noise_reason(a: MechanismRecord, b: MechanismRecord) -> str:
    pair = f"candidates {a.name!r} and {b.name!r} share noise lineage {a.noise_lineage!r}"
    if a.run_id is None or b.run_id is None:
        why = "without a run_id naming one run, they may be different runs reusing a noise stream"
    elif a.run_id != b.run_id:
        why = f"they are different runs ({a.run_id!r}, {b.run_id!r}) reusing a noise stream"
    else:
        why = "they claim one run but differ in more than the step count"
    return (
        f"{pair}: {why}; reused noise can cancel in a linear combination, so no LC bound "
        "applies (RS stays valid)"
    )


def _shared_batch_segments(runs: Sequence[MechanismRecord]) -> tuple[Segment, ...]:
    rates = {r.sample_rate for r in runs}
    if len(rates) != 1:
        names = ", ".join(repr(r.name) for r in runs)
        if runs[0].batch_lineage.startswith(UNKNOWN_BATCH_LINEAGE):
            raise RefusalError(
                f"imported candidates {names} have unknown batches and different sample rates: "
                "no bound covers their joint release; use RS or one of them"
            )
        raise RefusalError(
            f"candidates {names} share batch lineage {runs[0].batch_lineage!r} but record "
            "different sample rates: their batches cannot be identical"
        )
    (rate,) = rates
    segments = []
    previous = 0
    for end in sorted({r.steps for r in runs}):
        active = [r for r in runs if r.steps >= end]
        precision = math.fsum(r.noise_multiplier**-2 for r in active)
        sigma = precision**-0.5 * (1 - SIGMA_ROUNDING)
        segments.append(Segment(sigma, rate, end - previous))
        previous = end
    return tuple(segments)


def release_units(candidates: Sequence[Candidate]) -> tuple[ReleaseUnit, ...]:
    """The release units whose composition bounds releasing all ``candidates``.

    Raises ``RefusalError`` for a noise lineage shared by records that are not explicitly
    checkpoints of one run, and for a shared batch lineage with disagreeing sample rates.
    """
    records = [c for c in candidates if isinstance(c, MechanismRecord)]
    groups: dict[str, list[tuple[MechanismRecord, list[str]]]] = {}
    for run, names in _collapse_runs(records):
        groups.setdefault(run.batch_lineage, []).append((run, names))
    units = []
    for lineage, group in groups.items():
        names = tuple(sorted(n for _, covered in group for n in covered))
        if len(group) == 1:
            run = group[0][0]
            segment = Segment(run.noise_multiplier, run.sample_rate, run.steps)
            units.append(ReleaseUnit(UnitKind.RUN, names, (segment,)))
        else:
            segments = _shared_batch_segments([run for run, _ in group])
            unknown = lineage.startswith(UNKNOWN_BATCH_LINEAGE)
            units.append(ReleaseUnit(UnitKind.SHARED_BATCHES, names, segments, None, unknown))
    imported = sorted(c.name for c in candidates if isinstance(c, PrivacyLabel) and c.attested_by)
    if len(imported) > 1:
        raise RefusalError(
            f"imported profile-only candidates {', '.join(map(repr, imported))} may share "
            "batches and noise (unknown lineage): no composition bounds their joint release "
            "(an LC merge, a mixture's merge, or their source's release ledger); use one of them"
        )
    labels = [
        ReleaseUnit(UnitKind.LABEL, (c.name,), label=c)
        for c in candidates
        if isinstance(c, PrivacyLabel)
    ]
    return tuple(sorted(units + labels, key=lambda u: u.members))


@lru_cache(maxsize=4096)
def unit_pld(unit: ReleaseUnit, discretisation: float) -> pld_mod.PLD:
    """Pessimistic PLD of one unit. ``UnsupportedError`` for an RDP-only label."""
    if unit.label is not None:
        return pld_mod.candidate_pld(unit.label, discretisation)
    plds = [
        pld_mod.subsampled_gaussian_pld(s.noise_multiplier, s.sample_rate, s.steps, discretisation)
        for s in unit.segments
    ]
    return compose(plds)


@lru_cache(maxsize=4096)
def unit_rdp(unit: ReleaseUnit) -> tuple[float, ...]:
    """RDP curve of one unit on ``rdp.ORDERS``. ``UnsupportedError`` for an (ε, δ) label."""
    if unit.label is not None:
        return rdp_mod.candidate_rdp(unit.label)
    curves = [
        rdp_mod.subsampled_gaussian_rdp(s.noise_multiplier, s.sample_rate, s.steps)
        for s in unit.segments
    ]
    return tuple(np.sum(curves, axis=0).tolist())


def compose(plds: Sequence[pld_mod.PLD]) -> pld_mod.PLD:
    result = plds[0]
    for other in plds[1:]:
        result = result.compose(other)
    return result


@lru_cache(maxsize=4096)
def composed_pld(units: tuple[ReleaseUnit, ...], discretisation: float) -> pld_mod.PLD:
    """PLD of the joint release of ``units`` (composition, one pessimistic accounting); with
    the disk cache on (a policy run, each in a fresh process) kept there, keyed by every
    segment in order, so only the first run of a subset composes it."""

    def build() -> pld_mod.PLD:
        return compose([unit_pld(u, discretisation) for u in units])

    if any(u.label is not None for u in units):
        return build()
    segments = tuple(
        tuple((float(s.noise_multiplier), float(s.sample_rate), int(s.steps)) for s in u.segments)
        for u in units
    )
    return pld_mod.disk_cached(("composed", float(discretisation), segments), build)


def composed_rdp(units: tuple[ReleaseUnit, ...]) -> tuple[float, ...]:
    return tuple(np.sum([unit_rdp(u) for u in units], axis=0).tolist())


def units_bound(
    units: tuple[ReleaseUnit, ...],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
    *,
    kind: BoundKind = BoundKind.GENERIC,
) -> PairBound:
    """ε of the joint release of ``units`` under PLD and RDP, with what it rests on."""
    assumptions = tuple(u.describe() for u in units if u.kind != UnitKind.RUN or len(u.members) > 1)
    return bound_from_curves(
        kind,
        delta,
        pld=lambda: profiles.epsilon_for_delta(composed_pld(units, discretisation), delta),
        rdp=lambda: composed_rdp(units),
        discretisation=discretisation,
        assumptions=assumptions,
    )


def generic_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PairBound:
    """ε of the joint release of the candidates with λ_i ≠ 0 (independent of λ otherwise)."""
    used = [c for w, c in zip(weights, candidates, strict=True) if w > 0]
    return units_bound(release_units(used), delta, discretisation)
