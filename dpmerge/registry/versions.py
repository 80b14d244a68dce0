"""What the registry hands back: stored and registered versions, loaded candidates, promotions
and the rows of ``dpmerge registry ls``. No MLflow entity leaves the registry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dpmerge.registry.tags import ROLE_CANDIDATE, tag_float

if TYPE_CHECKING:  # none is imported to read the registry (``dpmerge registry ls``)
    from mlflow.entities.model_registry import ModelVersion

    from dpmerge.accounting.records import Candidate
    from dpmerge.artifacts import ModelDir


@dataclass(frozen=True)
class StoredVersion:
    """A version as the registry stores it: model, number, run and ``dp.*`` tags."""

    name: str
    version: str
    run_id: str | None
    tags: dict[str, str]

    @classmethod
    def of(cls, mv: ModelVersion) -> StoredVersion:
        return cls(mv.name, str(mv.version), mv.run_id, dict(mv.tags))


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    content_hash: str
    run_id: str | None
    reused: bool


@dataclass(frozen=True)
class RegisteredCandidate:
    """A ready candidate version, its model directory (downloaded and checked) and its record
    as published (keyed dataset identifier and lineages, from its signed tags: what the release
    ledger counts, docs/design.md#release-ledger)."""

    name: str
    version: str
    model_dir: ModelDir
    published: Candidate


@dataclass(frozen=True)
class ReleaseFacts:
    """What a merged version promises, from its signed tags
    (:meth:`~dpmerge.registry.Registry.release_facts`)."""

    name: str
    version: str
    role: str
    content_hash: str
    dataset: str
    epsilon: float
    delta: float
    bound: str
    accountant: str | None
    accuracy: float | None

    @classmethod
    def of(cls, stored: StoredVersion) -> ReleaseFacts:
        tags = stored.tags
        return cls(
            name=stored.name,
            version=stored.version,
            role=tags.get("dp.role", ""),
            content_hash=tags.get("dp.content_hash", ""),
            dataset=tags.get("dp.dataset", ""),
            epsilon=tag_float(tags.get("dp.epsilon")) or float("inf"),
            delta=tag_float(tags.get("dp.delta")) or 1.0,
            bound=tags.get("dp.gating_bound", ""),
            accountant=tags.get("dp.accountant"),
            accuracy=tag_float(tags.get("dp.accuracy")),
        )

    def unmet(self, target_epsilon: float, target_delta: float, min_accuracy: float) -> list[str]:
        """Why these facts fail a policy's gates (empty: they pass)."""
        reasons = []
        if self.epsilon > target_epsilon:
            reasons.append(f"gating ε = {self.epsilon} exceeds the target {target_epsilon:g}")
        if self.delta > target_delta:
            reasons.append(f"δ = {self.delta} exceeds the target {target_delta:g}")
        if self.accuracy is None or self.accuracy < min_accuracy:
            reasons.append(f"accuracy {self.accuracy} is below the minimum {min_accuracy:g}")
        return reasons


@dataclass(frozen=True)
class VersionSummary:
    """One row of ``dpmerge registry ls``."""

    name: str
    version: str
    role: str
    status: str | None
    epsilon: float | None
    delta: float | None
    accountant: str | None
    bound: str | None
    accuracy: float | None
    method: str | None
    aliases: tuple[str, ...]
    policy: str | None = None
    target_epsilon: float | None = None

    @classmethod
    def of(
        cls, mv: StoredVersion, aliases: Sequence[str], *, internal: bool = False
    ) -> VersionSummary:
        """The row of version ``mv``, which ``aliases`` name; a candidate's accuracy only if
        ``internal`` (docs/design.md#rs-secrecy)."""
        public = mv.tags.get("dp.role") != ROLE_CANDIDATE or internal
        return cls(
            name=mv.name,
            version=mv.version,
            role=mv.tags.get("dp.role", ""),
            status=mv.tags.get("dp.status"),
            epsilon=tag_float(mv.tags.get("dp.epsilon")),
            delta=tag_float(mv.tags.get("dp.delta")),
            accountant=mv.tags.get("dp.accountant"),
            bound=mv.tags.get("dp.gating_bound"),
            accuracy=tag_float(mv.tags.get("dp.accuracy")) if public else None,
            method=mv.tags.get("dp.method"),
            aliases=tuple(sorted(aliases)),
            policy=mv.tags.get("dp.policy"),
            target_epsilon=tag_float(mv.tags.get("dp.target_epsilon")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "aliases": list(self.aliases)}
