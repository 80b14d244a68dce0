"""The DP-SGD-structured LC bound: the DP model merging paper's analysis
(docs/design.md#structured-bound). Opt-in per policy; the generic bound is the default gate.

Per step, the merged update carries Gaussian noise of std s = sqrt(Σ c_i²σ_i²) with
c_i = λ_i·η_i·C_i/B_i; a differing record shifts it by Σ_{i∈S} c_i for the random set S of runs
whose batch held it. The surrogate pair N(0,1) vs Σ_S P(S)·N(m_S,1), m_S = Σ_{i∈S} c_i / s, is
composed over the steps (segments of still-active candidates when step counts differ).
Candidates with one batch lineage drew identical batches and enter S together.

The bound is reported as computed. It analyses a post-processing (the merged update) of what
the generic bound analyses (every run's update), so it can never exceed the generic bound over
the same release units: :func:`check_ordering` raises ``BoundContradictionError`` if it does,
beyond the two pessimistic grids' discretisation slack. Nothing is clamped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dpmerge.accounting import pld as pld_mod
from dpmerge.accounting import profiles
from dpmerge.accounting import rdp as rdp_mod
from dpmerge.accounting.bounds import PairBound, bound_from_curves, unavailable
from dpmerge.accounting.generic import compose
from dpmerge.accounting.records import Candidate, MechanismRecord
from dpmerge.errors import BoundContradictionError
from dpmerge.vocabulary import BoundKind, Optimizer

STRUCTURED_ASSUMPTIONS = (
    "plain SGD: each update is linear in the noisy clipped-gradient sum",
    "data-independent initialisation (random seed or public checkpoint)",
    "independent noise across candidates (distinct noise lineages, as recorded)",
    "Poisson sampling as recorded: independent across distinct batch lineages, "
    "identical batches within one",
    "worst case: the differing record's clipped gradients are aligned across runs",
    "analyses the merged per-step updates; a record's influence on a run's hidden "
    "trajectory reaching later merged updates through other records' gradients is not "
    "bounded (exact for mean estimation only, docs/design.md#structured-bound)",
)

ORDERING_SLACK = 1e-3
"""How far the structured PLD ε may sit above the generic one before that is a contradiction:
both are pessimistic estimates on the 1e-4 grid, whose discretisation errors (≤ 1e-4 measured
up to 15 000 steps) differ between the mixture and the composed subsampled Gaussians."""


def structured_refusal(candidates: Sequence[Candidate], weights: Sequence[float]) -> str | None:
    """Why the structured bound does not apply to this merge, or ``None`` if it does."""
    used = [c for w, c in zip(weights, candidates, strict=True) if w > 0]
    for c in used:
        if not isinstance(c, MechanismRecord):
            return f"candidate {c.name!r} has only a privacy label: its training is unknown"
        if c.attested_by is not None:
            return (
                f"candidate {c.name!r} is imported (record attested by {c.attested_by}): the "
                "structured bound needs training dpmerge ran (docs/design.md#imported-candidates)"
            )
        if c.optimizer != Optimizer.SGD:
            return (
                f"candidate {c.name!r} was trained with {c.optimizer.value!r}: the structured "
                "bound needs plain SGD (update linear in the noisy gradient sum)"
            )
    records = [c for c in used if isinstance(c, MechanismRecord)]
    lineages: dict[str, MechanismRecord] = {}
    rates: dict[str, MechanismRecord] = {}
    for record in records:
        other = lineages.setdefault(record.noise_lineage, record)
        if other is not record:
            return (
                f"candidates {other.name!r} and {record.name!r} share noise lineage "
                f"{record.noise_lineage!r} (checkpoints of one run or a reused noise stream): "
                "never accounted with the structured bound; use the generic bound or RS"
            )
        other = rates.setdefault(record.batch_lineage, record)
        if other.sample_rate != record.sample_rate:
            return (
                f"candidates {other.name!r} and {record.name!r} share batch lineage "
                f"{record.batch_lineage!r} but record different sample rates: their batches "
                "cannot be identical"
            )
    return None


@dataclass(frozen=True)
class StepMixture:
    """One segment of the surrogate: ``steps`` compositions of N(0,1) vs Σ p_S·N(m_S,1)."""

    sensitivities: tuple[float, ...]
    probabilities: tuple[float, ...]
    steps: int

    @property
    def is_subsampled_gaussian(self) -> bool:
        """Two components {0, m}: a Poisson-subsampled Gaussian with σ = 1/m."""
        return len(self.sensitivities) == 2 and self.sensitivities[0] == 0.0


def structured_segments(
    records: Sequence[MechanismRecord], weights: Sequence[float]
) -> tuple[StepMixture, ...]:
    """The surrogate's segments for the records with λ_i > 0."""
    used = [(w, r) for w, r in zip(weights, records, strict=True) if w > 0]
    segments = []
    previous = 0
    for end in sorted({r.steps for _, r in used}):
        active = [(w, r) for w, r in used if r.steps >= end]
        scale = {r.name: w * r.contribution_scale for w, r in active}
        noise = math.sqrt(sum((scale[r.name] * r.noise_multiplier) ** 2 for _, r in active))
        groups: dict[str, list[MechanismRecord]] = {}
        for _, r in active:
            groups.setdefault(r.batch_lineage, []).append(r)
        shifts = [sum(scale[r.name] for r in g) / noise for g in groups.values()]
        rates = [g[0].sample_rate for g in groups.values()]
        components: dict[float, float] = {}
        for included in itertools.product((False, True), repeat=len(shifts)):
            m = sum(s for s, inc in zip(shifts, included, strict=True) if inc)
            p = math.prod(q if inc else 1 - q for q, inc in zip(rates, included, strict=True))
            key = round(m, 12)
            components[key] = components.get(key, 0.0) + p
        keys = sorted(components)
        segments.append(
            StepMixture(tuple(keys), tuple(components[k] for k in keys), end - previous)
        )
        previous = end
    return tuple(segments)


@lru_cache(maxsize=4096)
def _segment_pld(segment: StepMixture, discretisation: float) -> pld_mod.PLD:
    if segment.is_subsampled_gaussian:
        return pld_mod.subsampled_gaussian_pld(
            1.0 / segment.sensitivities[1], segment.probabilities[1], segment.steps, discretisation
        )
    one_step = pld_mod.mixture_of_gaussians_pld(
        segment.sensitivities, segment.probabilities, discretisation
    )
    return pld_mod.self_compose(one_step, segment.steps)


@lru_cache(maxsize=4096)
def _subsampled_gaussian_segment_rdp(segment: StepMixture) -> tuple[float, ...]:
    curve = rdp_mod.subsampled_gaussian_rdp(
        1.0 / segment.sensitivities[1], segment.probabilities[1], segment.steps
    )
    return tuple(curve.tolist())


def _segment_rdp_at(segment: StepMixture, alpha: float) -> float:
    if segment.is_subsampled_gaussian:
        return _subsampled_gaussian_segment_rdp(segment)[rdp_mod.ORDERS.index(alpha)]
    per_step = rdp_mod.mixture_of_gaussians_rdp_at(
        segment.sensitivities, segment.probabilities, alpha
    )
    return per_step * segment.steps


def structured_epsilon_rdp(segments: Sequence[StepMixture], delta: float) -> tuple[float, float]:
    """RDP (ε, order) of the surrogate. Subsampled-Gaussian segments use dp_accounting's curve
    at every order; mixtures use the quadrature at a searched subset of orders."""
    if all(s.is_subsampled_gaussian for s in segments):
        curve = np.sum([_subsampled_gaussian_segment_rdp(s) for s in segments], axis=0)
        return rdp_mod.epsilon_from_rdp(curve, delta)
    return rdp_mod.epsilon_from_rdp_function(
        lambda alpha: sum(_segment_rdp_at(s, alpha) for s in segments), delta
    )


def structured_epsilon_pld(
    segments: Sequence[StepMixture], delta: float, discretisation: float
) -> float:
    """PLD ε of the surrogate."""
    plds = [_segment_pld(s, discretisation) for s in segments]
    return profiles.epsilon_for_delta(compose(plds), delta)


def structured_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
    *,
    with_rdp: bool = True,
) -> PairBound:
    """The structured bound as computed; unavailable, with the reason, where it does not
    apply."""
    refusal = structured_refusal(candidates, weights)
    if refusal is not None:
        return unavailable(BoundKind.STRUCTURED, delta, refusal)
    pairs = [(w, c) for w, c in zip(weights, candidates, strict=True) if w > 0]
    records = [c for _, c in pairs if isinstance(c, MechanismRecord)]
    segments = structured_segments(records, [w for w, _ in pairs])
    notes = list(STRUCTURED_ASSUMPTIONS)
    unknown_init = [r.name for r in records if r.initialisation is None]
    if unknown_init:
        notes.append(
            f"initialisation not recorded for {', '.join(unknown_init)}: assumed data-independent"
        )
    return bound_from_curves(
        BoundKind.STRUCTURED,
        delta,
        pld=lambda: structured_epsilon_pld(segments, delta, discretisation),
        rdp=None,
        rdp_epsilon=(lambda: structured_epsilon_rdp(segments, delta)) if with_rdp else None,
        discretisation=discretisation,
        assumptions=tuple(notes),
    )


def check_ordering(generic: PairBound, structured: PairBound) -> None:
    """Raise ``BoundContradictionError`` where the structured PLD ε exceeds the generic one
    over the same release units by more than :data:`ORDERING_SLACK` (see module docstring)."""
    if generic.epsilon_pld is None or structured.epsilon_pld is None:
        return
    if structured.epsilon_pld > generic.epsilon_pld + ORDERING_SLACK:
        raise BoundContradictionError(
            f"structured bound ε = {structured.epsilon_pld:.6f} exceeds the generic bound "
            f"ε = {generic.epsilon_pld:.6f} (PLD, δ = {generic.delta:g}) over the same release "
            "units; one of the two analyses is wrong — please report this merge"
        )
