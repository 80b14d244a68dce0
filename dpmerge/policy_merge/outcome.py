"""What applying a policy did: its status, its outcome, and the errors a flow raises with one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from dpmerge.errors import DPMergeError, InfeasibleTargetError
from dpmerge.policies import Policy


class Status(StrEnum):
    """How applying a policy ended (docs/design.md#policies)."""

    PROMOTED = "promoted"  # a release passed the gates; the alias moved to it
    UNCHANGED = "unchanged"  # the alias already named this release
    NOT_PROMOTED = "not_promoted"  # registered, a gate failed; the alias stayed
    INFEASIBLE = "infeasible"  # no merge meets the target; the alias revoked or kept
    SUPERSEDED = "superseded"  # a later policy event already set the alias; nothing touched


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
    notes: tuple[str, ...] = ()  # e.g. why the release spends less than the target
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, policy: Policy, status: Status, **fields: Any) -> PolicyOutcome:
        """``policy``'s outcome (its name, alias and targets) with ``status`` and ``fields``."""
        return cls(
            policy=policy.name,
            status=status,
            alias=str(policy.alias),
            target_epsilon=policy.target_epsilon,
            target_delta=policy.target_delta,
            **fields,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        for key in ("weights", "candidates", "reachable_epsilon_range", "reasons", "notes"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data
