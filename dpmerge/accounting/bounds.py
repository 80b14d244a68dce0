"""Values that state a privacy bound: which ε, under which accountant, at which δ, resting on
what (docs/design.md#mechanism-record: "every reported ε names its accountant, δ and the
neighbouring relation").

:func:`bound_from_curves` is the one place where an accountant's "not supported"
(``UnsupportedError``) or an unbounded ε becomes a missing value with its reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dpmerge.accounting import rdp as rdp_mod
from dpmerge.errors import UnsupportedError
from dpmerge.vocabulary import Accountant, BoundKind, Method, Neighbouring

BOUND_DESCRIPTIONS: dict[BoundKind, str] = {
    BoundKind.CANDIDATE: "the candidate's own DP-SGD accounting",
    BoundKind.SELECTION: (
        "random selection: mixture of the candidates' privacy curves "
        "(docs/design.md#random-selection)"
    ),
    BoundKind.MIXTURE: (
        "secret draw between LC merges: mixture of the merges' generic-bound curves, each the "
        "composition of its subset's release units (docs/design.md#random-selection), no "
        "assumption beyond the draw's secrecy"
    ),
    BoundKind.GENERIC: (
        "generic LC bound: composition of the release units of the used candidates "
        "(docs/design.md#generic-bound), no assumption"
    ),
    BoundKind.STRUCTURED: (
        "structured (the DP model merging paper's analysis): per-step mixture-of-Gaussians "
        "surrogate of the merged updates (docs/design.md#structured-bound); rests on the "
        "assumptions listed"
    ),
    BoundKind.GAUSSIAN: "exact Gaussian mechanism (docs/design.md#mean-estimation)",
}


@dataclass(frozen=True)
class PairBound:
    """ε under PLD and under RDP for one bound. ``None`` with ``reason`` where not available.

    ``epsilon`` is the smaller of the two (both are valid upper bounds) and ``accountant`` says
    which one it is; ``inf`` when neither is available.
    """

    kind: BoundKind
    delta: float
    epsilon_pld: float | None
    epsilon_rdp: float | None
    rdp_order: float | None = None
    discretisation: float | None = None
    assumptions: tuple[str, ...] = ()
    reason: str | None = None
    neighbouring: Neighbouring = Neighbouring.ADD_OR_REMOVE_ONE

    @property
    def available(self) -> bool:
        return self.epsilon_pld is not None or self.epsilon_rdp is not None

    @property
    def epsilon(self) -> float:
        values = [e for e in (self.epsilon_pld, self.epsilon_rdp) if e is not None]
        return min(values) if values else math.inf

    @property
    def accountant(self) -> Accountant | None:
        if not self.available:
            return None
        if self.epsilon_rdp is None:
            return Accountant.PLD
        if self.epsilon_pld is None:
            return Accountant.RDP
        return Accountant.PLD if self.epsilon_pld <= self.epsilon_rdp else Accountant.RDP

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = str(self.kind)
        data["neighbouring"] = str(self.neighbouring)
        data["assumptions"] = list(self.assumptions)
        data["epsilon"] = self.epsilon if self.available else None
        data["accountant"] = None if self.accountant is None else str(self.accountant)
        data["description"] = BOUND_DESCRIPTIONS[self.kind]
        return data


def unavailable(kind: BoundKind, delta: float, reason: str) -> PairBound:
    return PairBound(kind=kind, delta=delta, epsilon_pld=None, epsilon_rdp=None, reason=reason)


def bound_from_curves(
    kind: BoundKind,
    delta: float,
    *,
    pld: Callable[[], float] | None,
    rdp: Callable[[], Sequence[float]] | None,
    discretisation: float | None,
    assumptions: tuple[str, ...] = (),
    rdp_epsilon: Callable[[], tuple[float, float]] | None = None,
) -> PairBound:
    """Evaluate a bound under each accountant that supports it.

    ``pld`` returns the PLD ε; ``rdp`` returns an RDP curve on ``rdp.ORDERS`` (or
    ``rdp_epsilon`` returns (ε, order) directly). An accountant that raises
    ``UnsupportedError``, or whose ε is unbounded at ``delta`` (a PLD's mass at +∞ above δ, an
    RDP curve infinite at every order), leaves its value ``None`` and says why in ``reason``.
    """
    reasons = []
    epsilon_pld = None
    if pld is not None:
        try:
            epsilon_pld = pld()
        except UnsupportedError as error:
            reasons.append(f"PLD unavailable: {error}")
        else:
            if not math.isfinite(epsilon_pld):
                epsilon_pld = None
                reasons.append(
                    f"PLD: no finite ε at δ = {delta:g} (the pessimistic PLD's mass at +∞ — a "
                    "label's own δ or the truncated tail — exceeds δ)"
                )
    epsilon_rdp = order = None
    if rdp is not None or rdp_epsilon is not None:
        try:
            if rdp_epsilon is not None:
                epsilon_rdp, order = rdp_epsilon()
            else:
                epsilon_rdp, order = rdp_mod.epsilon_from_rdp(rdp(), delta)
        except UnsupportedError as error:
            reasons.append(f"RDP unavailable: {error}")
        else:
            if not math.isfinite(epsilon_rdp):
                epsilon_rdp = order = None
                reasons.append(f"RDP: ε unbounded at δ = {delta:g} (infinite at every order)")
    return PairBound(
        kind=kind,
        delta=delta,
        epsilon_pld=epsilon_pld,
        epsilon_rdp=epsilon_rdp,
        rdp_order=order,
        discretisation=discretisation if epsilon_pld is not None else None,
        assumptions=assumptions,
        reason="; ".join(reasons) or None,
    )


def finite_or_none(value: float | None) -> float | None:
    """A value for JSON: infinite ε (unbounded) becomes ``null``, never ``Infinity``."""
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class MixtureRung:
    """One LC merge of a mixture release (docs/design.md#random-selection, "RS between
    merges"): drawn with ``probability``; ``weights`` over every candidate of the report (zero
    outside the rung's subset); ``bound`` is the rung's own generic bound (the joint release of
    its subset's release units)."""

    probability: float
    weights: tuple[float, ...]
    bound: PairBound

    def members(self, names: Sequence[str]) -> tuple[str, ...]:
        return tuple(n for n, w in zip(names, self.weights, strict=True) if w > 0)

    def to_dict(self, names: Sequence[str]) -> dict[str, Any]:
        return {
            "probability": self.probability,
            "weights": list(self.weights),
            "members": list(self.members(names)),
            **_values(self.bound),
            "bound": self.bound.to_dict(),
        }


def _values(bound: PairBound) -> dict[str, Any]:
    return {
        "epsilon": bound.epsilon if bound.available else None,
        "accountant": None if bound.accountant is None else str(bound.accountant),
        "epsilon_pld": bound.epsilon_pld,
        "epsilon_rdp": bound.epsilon_rdp,
    }


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy statement of one merge (RS, LC or a mixture of LC merges) at one δ.

    ``gating`` is the bound that gates promotion (docs/design.md#generic-bound: generic by
    default for LC; selection for RS; the mixture bound for a mixture). For LC the generic bound
    is always reported, and the structured one beside it (or ``None`` with the reason it does
    not apply). A mixture has no single weight vector: ``weights`` is empty and ``rungs`` holds
    each merge's weights, odds and generic bound, so nothing can LC-merge it by mistake.
    """

    method: Method
    names: tuple[str, ...]
    weights: tuple[float, ...]
    delta: float
    gating: PairBound
    generic: PairBound | None = None
    structured: PairBound | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    rungs: tuple[MixtureRung, ...] = ()
    attestations: tuple[str, ...] = ()
    """What imported candidates rest on, shown in bold on both cards
    (``records.attestation_lines``, docs/design.md#imported-candidates)."""

    @property
    def epsilon(self) -> float:
        """The gating ε: the smaller of its PLD and RDP values."""
        return self.gating.epsilon

    @property
    def used_candidates(self) -> tuple[str, ...]:
        """The candidates the release uses, in the report's order: π_i > 0 (RS), λ_i > 0 (LC),
        a member of either rung (mixture). The release ledger counts exactly these
        (docs/design.md#release-ledger); which one an RS or mixture draw picked stays secret."""
        if self.method == Method.MIXTURE:
            used = {n for rung in self.rungs for n in rung.members(self.names)}
            return tuple(n for n in self.names if n in used)
        return tuple(n for n, w in zip(self.names, self.weights, strict=True) if w > 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON shape of the CLI's ``account`` output (keys documented in the README)."""
        mixture = self.method == Method.MIXTURE
        data: dict[str, Any] = {
            "method": str(self.method),
            "candidates": list(self.names),
            "weights": None if mixture else list(self.weights),
            "used_candidates": list(self.used_candidates),
            "delta": self.delta,
            "bound": str(self.gating.kind),
            **_values(self.gating),
            "neighbouring": str(self.gating.neighbouring),
            "assumptions": list(self.gating.assumptions),
            "reason": self.gating.reason,
            "notes": list(self.notes),
            "attestations": list(self.attestations),
            "bounds": {"gating": self.gating.to_dict()},
        }
        if mixture:
            data["rungs"] = [rung.to_dict(self.names) for rung in self.rungs]
        if self.method == Method.LC:
            generic, structured = self.generic, self.structured
            data["generic_epsilon_pld"] = generic.epsilon_pld if generic else None
            data["generic_epsilon_rdp"] = generic.epsilon_rdp if generic else None
            data["structured_epsilon_pld"] = structured.epsilon_pld if structured else None
            data["structured_epsilon_rdp"] = structured.epsilon_rdp if structured else None
            data["structured_reason"] = structured.reason if structured else None
            data["bounds"]["generic"] = generic.to_dict() if generic else None
            data["bounds"]["structured"] = structured.to_dict() if structured else None
        return data
