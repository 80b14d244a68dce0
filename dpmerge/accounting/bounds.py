"""Values that state a privacy bound: which ε, under which accountant, at which δ, resting on
what (SPEC §2 "every reported ε names its accountant, δ and the neighbouring relation")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dpmerge.accounting.records import NEIGHBOURING_ADD_OR_REMOVE

Accountant = Literal["pld", "rdp"]
BoundKind = Literal["candidate", "selection", "generic", "structured", "gaussian"]

BOUND_DESCRIPTIONS: dict[str, str] = {
    "candidate": "the candidate's own DP-SGD accounting",
    "selection": "random selection: mixture of the candidates' privacy curves (SPEC §4)",
    "generic": "generic LC bound: composition of the used candidates (SPEC §5.1), no assumption",
    "structured": (
        "structured (the DP model merging paper's analysis): per-step mixture-of-Gaussians "
        "surrogate of the merged updates (SPEC §5.2); rests on the assumptions listed"
    ),
    "gaussian": "exact Gaussian mechanism (mean estimation, SPEC §5.3)",
}


@dataclass(frozen=True)
class PairBound:
    """ε under PLD and under RDP for one bound. ``None`` with ``reason`` where not available.

    ``epsilon`` is the smaller of the two (both are valid upper bounds, SPEC §4) and
    ``accountant`` says which one it is.
    """

    kind: BoundKind
    delta: float
    epsilon_pld: float | None
    epsilon_rdp: float | None
    rdp_order: float | None = None
    discretisation: float | None = None
    assumptions: tuple[str, ...] = ()
    reason: str | None = None
    neighbouring: str = NEIGHBOURING_ADD_OR_REMOVE

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
            return "pld"
        if self.epsilon_pld is None:
            return "rdp"
        return "pld" if self.epsilon_pld <= self.epsilon_rdp else "rdp"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["assumptions"] = list(self.assumptions)
        data["epsilon"] = self.epsilon if self.available else None
        data["accountant"] = self.accountant
        data["description"] = BOUND_DESCRIPTIONS[self.kind]
        return data


def unavailable(kind: BoundKind, delta: float, reason: str) -> PairBound:
    return PairBound(kind=kind, delta=delta, epsilon_pld=None, epsilon_rdp=None, reason=reason)


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy statement of one merge (RS or LC) at one δ.

    ``gating`` is the bound that gates promotion (SPEC §5.1: generic by default for LC;
    selection for RS). For LC the generic bound is always reported, and the structured one
    beside it (or ``None`` with the reason it does not apply).
    """

    method: Literal["rs", "lc"]
    names: tuple[str, ...]
    weights: tuple[float, ...]
    delta: float
    gating: PairBound
    generic: PairBound | None = None
    structured: PairBound | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def epsilon(self) -> float:
        """The gating ε: the smaller of its PLD and RDP values."""
        return self.gating.epsilon

    def to_dict(self) -> dict[str, Any]:
        """JSON shape of the CLI's ``account`` output (keys documented in the README)."""
        data: dict[str, Any] = {
            "method": self.method,
            "candidates": list(self.names),
            "weights": list(self.weights),
            "delta": self.delta,
            "bound": self.gating.kind,
            "epsilon": self.epsilon if self.gating.available else None,
            "accountant": self.gating.accountant,
            "epsilon_pld": self.gating.epsilon_pld,
            "epsilon_rdp": self.gating.epsilon_rdp,
            "neighbouring": self.gating.neighbouring,
            "assumptions": list(self.gating.assumptions),
            "notes": list(self.notes),
            "bounds": {"gating": self.gating.to_dict()},
        }
        if self.method == "lc":
            generic, structured = self.generic, self.structured
            data["generic_epsilon_pld"] = generic.epsilon_pld if generic else None
            data["generic_epsilon_rdp"] = generic.epsilon_rdp if generic else None
            data["structured_epsilon_pld"] = structured.epsilon_pld if structured else None
            data["structured_epsilon_rdp"] = structured.epsilon_rdp if structured else None
            data["structured_reason"] = structured.reason if structured else None
            data["bounds"]["generic"] = generic.to_dict() if generic else None
            data["bounds"]["structured"] = structured.to_dict() if structured else None
        return data
