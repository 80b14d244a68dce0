"""What applying a policy did: its outcome, and the errors a flow raises with one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from dpmerge.errors import DPMergeError, InfeasibleTargetError

Status = Literal["promoted", "unchanged", "not_promoted", "infeasible", "superseded"]


class PolicyNotMetError(DPMergeError):
    """The policy's merged model was not promoted (a gate failed); ``outcome`` says why."""

    def __init__(self, message: str, outcome: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.outcome = dict(outcome or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcome))


class PolicyInfeasibleError(InfeasibleTargetError):
    """No merge meets the policy's target; the alias was revoked or kept per ``on_infeasible``."""

    def __init__(self, message: str, outcome: Mapping[str, Any]) -> None:
        low, high = outcome.get("reachable_epsilon_range") or (math.nan, math.nan)
        super().__init__(
            message,
            target_epsilon=float(outcome.get("target_epsilon", math.nan)),
            delta=float(outcome.get("target_delta", math.nan)),
            reachable_epsilon_range=(float(low), float(high)),
        )
        self.outcome = dict(outcome)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.outcome))


@dataclass(frozen=True)
class PolicyOutcome:
    """What applying a policy did. JSON-safe; holds no RS draw."""

    policy: str
    status: Status
    alias: str
    target_epsilon: float
    target_delta: float
    merged_model: str | None = None
    version: str | None = None
    previous_version: str | None = None
    reused: bool = False
    method: str | None = None
    weights: tuple[float, ...] | None = None
    epsilon: float | None = None
    accountant: str | None = None
    bound: str | None = None
    test_accuracy: float | None = None
    validation_accuracy: float | None = None
    cumulative_epsilon: float | None = None
    candidates: tuple[str, ...] = ()
    reachable_epsilon_range: tuple[float, float] | None = None
    revoked_version: str | None = None
    reasons: tuple[str, ...] = ()
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("weights", "candidates", "reachable_epsilon_range", "reasons"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data
