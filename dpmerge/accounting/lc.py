"""Linear combination θ = Σ λ_i·θ_i: the generic bound (SPEC §5.1) and the DP-SGD-structured
bound of the DP model merging paper (SPEC §5.2).

Generic: the merge is post-processing of releasing every candidate with λ_i ≠ 0, so ε_LC is at
most the ε of their joint release, i.e. the composition of their mechanisms. Candidates that are
checkpoints of one run (same noise lineage and hyper-parameters, SPEC §2) are released jointly by
that run's longest checkpoint, whose DP-SGD accounting already covers every earlier iterate; they
count once. Candidates that share a noise lineage but are *not* checkpoints of one run (a reused
noise stream across different runs) are refused even here: their noises can cancel in a linear
combination, and composition — which assumes fresh randomness — does not bound that.

Structured: per step, the merged update carries Gaussian noise of std s = sqrt(Σ c_i²σ_i²) with
c_i = λ_i·η_i·C_i/B_i; a differing record shifts it by Σ_{i∈S} c_i for the random set S of runs
whose batch held it. The surrogate pair N(0,1) vs Σ_S P(S)·N(m_S,1), m_S = Σ_{i∈S} c_i / s, is
composed over the steps (segments of still-active candidates when step counts differ).
Candidates with one batch lineage drew identical batches and enter S together.
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
from dpmerge.accounting.bounds import PairBound, unavailable
from dpmerge.accounting.records import Candidate, MechanismRecord, Optimizer
from dpmerge.errors import RefusalError

STRUCTURED_ASSUMPTIONS = (
    "plain SGD: each update is linear in the noisy clipped-gradient sum",
    "data-independent initialisation (random seed or public checkpoint)",
    "independent noise across candidates (distinct noise lineages, as recorded)",
    "Poisson sampling as recorded: independent across distinct batch lineages, "
    "identical batches within one",
    "worst case: the differing record's clipped gradients are aligned across runs",
    "analyses the merged per-step updates; a record's influence on a run's hidden "
    "trajectory reaching later merged updates through other records' gradients is not "
    "bounded (exact for mean estimation only, SPEC §5.2)",
)


# --------------------------------------------------------------------------------------------
# Generic bound (SPEC §5.1)


def release_units(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """The mechanisms whose joint release covers releasing all ``candidates``.

    Checkpoints of one run collapse to the longest one. Raises ``RefusalError`` for a noise
    lineage shared by candidates that are not checkpoints of one run.
    """
    units: dict[str, MechanismRecord] = {}
    labels: list[Candidate] = []
    for candidate in candidates:
        if not isinstance(candidate, MechanismRecord):
            labels.append(candidate)
            continue
        lineage = candidate.noise_lineage
        previous = units.get(lineage)
        if previous is None:
            units[lineage] = candidate
            continue
        if not previous.is_checkpoint_of_same_run(candidate):
            raise RefusalError(
                f"candidates {previous.name!r} and {candidate.name!r} share noise lineage "
                f"{lineage!r} but are not checkpoints of one run: a reused noise stream can "
                "cancel in a linear combination, so no LC bound applies; use RS"
            )
        if candidate.steps > previous.steps:
            units[lineage] = candidate
    return tuple(sorted(units.values(), key=lambda c: c.name)) + tuple(labels)


@lru_cache(maxsize=4096)
def composed_pld(units: tuple[Candidate, ...], discretisation: float) -> pld_mod.PLD:
    """PLD of the joint release of ``units`` (composition, in one pessimistic accounting)."""
    plds = [pld_mod.candidate_pld(u, discretisation) for u in units]
    result = plds[0]
    for other in plds[1:]:
        result = result.compose(other)
    return result


def generic_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
) -> PairBound:
    """ε of the joint release of the candidates with λ_i ≠ 0 (independent of λ otherwise)."""
    used = [c for w, c in zip(weights, candidates, strict=True) if w > 0]
    units = release_units(used)
    assumptions: list[str] = []
    if len(units) < len(used):
        assumptions.append(
            "checkpoints of one run are covered by that run's longest checkpoint "
            "(DP-SGD accounting covers every iterate)"
        )
    labels = [u.name for u in units if not isinstance(u, MechanismRecord)]
    if labels:
        assumptions.append(
            "label-only candidates taken as given, with randomness independent of the other "
            f"candidates: {', '.join(labels)}"
        )
    reasons = []
    try:
        epsilon_pld = profiles.epsilon_for_delta(composed_pld(units, discretisation), delta)
    except ValueError:
        epsilon_pld = None
        reasons.append("PLD unavailable: a used candidate has only an RDP label")
    curves = [rdp_mod.candidate_rdp(u) for u in units]
    if any(curve is None for curve in curves):
        epsilon_rdp, order = None, None
        reasons.append("RDP unavailable: a used candidate has only an (ε, δ) label")
    else:
        epsilon_rdp, order = rdp_mod.epsilon_from_rdp(np.sum(curves, axis=0), delta)
    return PairBound(
        kind="generic",
        delta=delta,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=epsilon_rdp,
        rdp_order=order,
        discretisation=discretisation if epsilon_pld is not None else None,
        assumptions=tuple(assumptions),
        reason="; ".join(reasons) or None,
    )


# --------------------------------------------------------------------------------------------
# Structured bound (SPEC §5.2)


def structured_refusal(candidates: Sequence[Candidate], weights: Sequence[float]) -> str | None:
    """Why the structured bound does not apply to this merge, or ``None`` if it does."""
    used = [c for w, c in zip(weights, candidates, strict=True) if w > 0]
    for c in used:
        if not isinstance(c, MechanismRecord):
            return f"candidate {c.name!r} has only a privacy label: its training is unknown"
        if c.optimizer != Optimizer.SGD:
            return (
                f"candidate {c.name!r} was trained with {c.optimizer.value!r}: the structured "
                "bound needs plain SGD (update linear in the noisy gradient sum)"
            )
    records = [c for c in used if isinstance(c, MechanismRecord)]
    for a, b in itertools.combinations(records, 2):
        if a.noise_lineage == b.noise_lineage:
            return (
                f"candidates {a.name!r} and {b.name!r} share noise lineage {a.noise_lineage!r} "
                "(checkpoints of one run or a reused noise stream): never accounted with the "
                "structured bound (SPEC §5.2); use the generic bound or RS"
            )
        if a.batch_lineage == b.batch_lineage and a.sample_rate != b.sample_rate:
            return (
                f"candidates {a.name!r} and {b.name!r} share batch lineage {a.batch_lineage!r} "
                "but record different sample rates: their batches cannot be identical"
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
    """The surrogate's segments for the records with λ_i > 0 (SPEC §5.2)."""
    used = [(w, r) for w, r in zip(weights, records, strict=True) if w > 0]
    boundaries = sorted({r.steps for _, r in used})
    segments = []
    previous = 0
    for end in boundaries:
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
    """RDP ε of the surrogate (raw). A single subsampled-Gaussian segment uses dp_accounting's
    curve at every order; mixtures use the quadrature at a searched subset of orders."""
    if all(s.is_subsampled_gaussian for s in segments):
        curve = np.sum([_subsampled_gaussian_segment_rdp(s) for s in segments], axis=0)
        return rdp_mod.epsilon_from_rdp(curve, delta)
    return rdp_mod.epsilon_from_rdp_function(
        lambda alpha: sum(_segment_rdp_at(s, alpha) for s in segments), delta
    )


def structured_epsilon_pld(
    segments: Sequence[StepMixture], delta: float, discretisation: float
) -> float:
    """PLD ε of the surrogate (raw: not yet capped by the generic bound)."""
    plds = [_segment_pld(s, discretisation) for s in segments]
    result = plds[0]
    for other in plds[1:]:
        result = result.compose(other)
    return profiles.epsilon_for_delta(result, delta)


def structured_bound(
    candidates: Sequence[Candidate],
    weights: Sequence[float],
    delta: float,
    discretisation: float = pld_mod.FINE_DISCRETISATION,
    *,
    generic: PairBound | None = None,
    with_rdp: bool = True,
) -> PairBound:
    """The structured bound, capped by the generic one (both are upper bounds; SPEC §5.2 check
    "never exceeds the generic bound"). Unavailable, with the reason, where it does not apply."""
    refusal = structured_refusal(candidates, weights)
    if refusal is not None:
        return unavailable("structured", delta, refusal)
    # Label-only candidates carry zero weight here (else the refusal above applies).
    pairs = [(w, c) for w, c in zip(weights, candidates, strict=True) if w > 0]
    records = [c for _, c in pairs if isinstance(c, MechanismRecord)]
    segments = structured_segments(records, [w for w, _ in pairs])
    epsilon_pld = structured_epsilon_pld(segments, delta, discretisation)
    epsilon_rdp, order = None, None
    if with_rdp:
        epsilon_rdp, order = structured_epsilon_rdp(segments, delta)
    notes = list(STRUCTURED_ASSUMPTIONS)
    unknown_init = [r.name for r in records if r.initialisation is None]
    if unknown_init:
        notes.append(
            f"initialisation not recorded for {', '.join(unknown_init)}: assumed data-independent"
        )
    if generic is not None:
        capped = []
        if generic.epsilon_pld is not None and generic.epsilon_pld < epsilon_pld:
            epsilon_pld = generic.epsilon_pld
            capped.append("PLD")
        if (
            epsilon_rdp is not None
            and generic.epsilon_rdp is not None
            and generic.epsilon_rdp < epsilon_rdp
        ):
            epsilon_rdp, order = generic.epsilon_rdp, generic.rdp_order
            capped.append("RDP")
        if capped:
            notes.append(f"capped by the generic bound ({', '.join(capped)}): it is smaller")
    return PairBound(
        kind="structured",
        delta=delta,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=epsilon_rdp,
        rdp_order=order,
        discretisation=discretisation,
        assumptions=tuple(notes),
    )


def merged_noise_proxy(records: Sequence[MechanismRecord], weights: Sequence[float]) -> float:
    """Σ c_i²σ_i² / (Σ c_i)²: the merged update's noise variance relative to its signal scale
    (SPEC §6's utility proxy; smaller is better)."""
    c = [w * r.contribution_scale for w, r in zip(weights, records, strict=True)]
    signal = sum(c)
    noise = sum((ci * r.noise_multiplier) ** 2 for ci, r in zip(c, records, strict=True))
    return noise / signal**2


def inverse_variance_weights(records: Sequence[MechanismRecord]) -> tuple[float, ...]:
    """λ minimising :func:`merged_noise_proxy`: c_i ∝ σ_i⁻², i.e. λ_i ∝ σ_i⁻² / (η_i C_i / B_i)
    (λ_i ∝ σ_i⁻² for equal learning rates, batches and clipping; SPEC §5.1)."""
    raw = [1.0 / (r.noise_multiplier**2 * r.contribution_scale) for r in records]
    total = math.fsum(raw)
    return tuple(v / total for v in raw)
