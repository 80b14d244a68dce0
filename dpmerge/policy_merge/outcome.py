"""What applying a policy did: its status and its outcome (docs/design.md#policies)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from dpmerge.formatting import number_text, within_text
from dpmerge.state.policies import PolicyVersion
from dpmerge.vocabulary import ServingState

SEQUENCES = ("weights", "rungs", "candidates", "reachable_epsilon_range", "reasons")
"""The outcome's tuple fields (lists in JSON)."""


class Status(StrEnum):
    """How applying a policy ended (docs/design.md#policies)."""

    PROMOTED = "promoted"  # a release passed the gates; the alias moved to it
    UNCHANGED = "unchanged"  # the alias already named this release
    NOT_PROMOTED = "not_promoted"  # a gate (or the cap) refused the release
    REFUSED = "refused"  # the release is not its signed files and model; the alias kept or revoked
    INFEASIBLE = "infeasible"  # no merge meets the target
    SUPERSEDED = "superseded"  # a later version of the policy exists; nothing touched


@dataclass(frozen=True)
class PolicyOutcome:
    """What applying a policy did. JSON-safe; holds no RS draw."""

    policy: str
    status: Status
    alias: str
    target_epsilon: float
    target_delta: float
    policy_version: int | None = None
    serving: str | None = None  # the alias's ServingState after the run
    serving_version: str | None = None  # the version the alias names after the run
    merged_model: str | None = None
    version: str | None = None
    previous_version: str | None = None
    reused: bool = False
    method: str | None = None
    weights: tuple[float, ...] | None = None  # RS: π; LC: λ; the mixture: see rungs
    rungs: tuple[dict[str, Any], ...] = ()  # the mixture's merges: probability, members, λ
    epsilon: float | None = None
    accountant: str | None = None
    bound: str | None = None
    test_accuracy: float | None = None
    cumulative_epsilon: float | None = None
    candidates: tuple[str, ...] = ()
    reachable_epsilon_range: tuple[float, float] | None = None
    revoked_version: str | None = None
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # e.g. why the release spends less than the target
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, stored: PolicyVersion, status: Status, **fields: Any) -> PolicyOutcome:
        """The outcome of ``stored`` policy version (its name, alias, targets) with ``status``."""
        policy = stored.policy
        return cls(
            policy=policy.name,
            status=status,
            alias=str(policy.alias),
            target_epsilon=policy.target_epsilon,
            target_delta=policy.target_delta,
            policy_version=stored.version,
            **fields,
        )

    @property
    def compliant(self) -> bool:
        """Whether the alias serves a release that meets this policy version after the run
        (superseded runs leave that to the later version)."""
        return self.status == Status.SUPERSEDED or self.serving == ServingState.SERVING

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyOutcome:
        """The inverse of :meth:`to_dict` (e.g. read back from a run's artifact)."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for key in SEQUENCES:
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        return cls(**{**fields, "status": Status(fields["status"])})

    def summary(self) -> str:
        """One line for people: the status, the release and its ε (rounded up), the alias."""
        number = f" v{self.policy_version}" if self.policy_version else ""
        head = f"policy {self.policy}{number}: {self.status.value.replace('_', ' ')}"
        release = ""
        if self.version:
            release = (
                f" — {self.merged_model} v{self.version}{' (reused)' if self.reused else ''} by "
                f"{str(self.method).upper()}, {within_text(self.epsilon, self.target_epsilon)} "
                f"({self.accountant}, {self.bound} bound, δ = {self.target_delta:g})"
            )
            if self.test_accuracy is not None:
                release += f", test accuracy {number_text(self.test_accuracy)}"
        alias = repr(self.alias)
        tails = {
            Status.PROMOTED: f"alias {alias} → v{self.version}"
            + (f" (was v{self.previous_version})" if self.previous_version else ""),
            Status.UNCHANGED: f"alias {alias} already names v{self.version}",
        }
        parts = [*self.reasons, *([tails[self.status]] if self.status in tails else [])]
        if not parts:
            return head + release
        return head + (f"{release}; " if release else " — ") + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        for key in (*SEQUENCES, "notes"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data
