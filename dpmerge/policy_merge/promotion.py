"""Registration and promotion (steps 6–7), revocation when the target is infeasible, the
event-time order of alias changes (the registry's ``dp.alias_time.<alias>``), and the card of
a registered release."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dpmerge.accounting.ledger import Release as LedgerRelease
from dpmerge.errors import InfeasibleTargetError, RefusalError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.outcome import PolicyOutcome, Status
from dpmerge.policy_merge.release import MergeRequest, Release
from dpmerge.policy_merge.release_ledger import open_ledger
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import GateError, Registry, RegistryError, StoredVersion, tag_float


@dataclass(frozen=True)
class Registered:
    """A ready merged version of a merge request (new, or reused from an earlier run)."""

    name: str
    version: str
    reused: bool
    epsilon: float | None
    accuracy: float | None
    content_hash: str

    @classmethod
    def of(cls, stored: StoredVersion, *, reused: bool, content_hash: str) -> Registered:
        return cls(
            name=stored.name,
            version=stored.version,
            reused=reused,
            epsilon=tag_float(stored.tags.get("dp.epsilon")),
            accuracy=tag_float(stored.tags.get("dp.accuracy")),
            content_hash=content_hash,
        )


@dataclass(frozen=True)
class PromotionResult:
    """What :func:`promote_release` did: its status, the version the alias named before,
    why it was not promoted, and the cumulative ledger ε once recorded."""

    status: Status
    previous: str | None = None
    reasons: tuple[str, ...] = ()
    cumulative_epsilon: float | None = None


def find_release(registry: Registry, request: MergeRequest) -> Registered | None:
    """The ready version of this exact request, if one was registered before."""
    found = registry.find_ready_version(request.pool.merged_model, request.content_hash)
    if found is None:
        return None
    return Registered.of(found, reused=True, content_hash=request.content_hash)


def register_release(
    workspace: Workspace,
    request: MergeRequest,
    release: Release,
    ledger: Mapping[str, Any] | None,
) -> Registered:
    """Register ``release`` as the request's merged version, its card showing ``ledger``."""
    registry = workspace.registry()
    registered = registry.register_merged(
        release.path,
        parents=request.parents,
        policy=request.policy,
        parent_model=request.pool.registered_model,
        name=request.pool.merged_model,
        ledger=ledger,
    )
    if registered.content_hash != request.content_hash:  # the two hashes must agree
        raise RegistryError(
            f"{registered.name} v{registered.version}: content hash differs from the request's"
        )
    stored = registry.get_version(registered.name, registered.version)
    return Registered.of(stored, reused=registered.reused, content_hash=registered.content_hash)


def read_card(workspace: Workspace, name: str, version: str) -> str:
    """The privacy card (Markdown) of a registered merged version."""
    return workspace.registry().card_text(name, version)


def parse_time(value: str | datetime | None) -> datetime:
    """An event time (ISO 8601, naive means UTC); ``None`` is now."""
    if value is None or value == "":
        return datetime.now(UTC)
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def superseded_by(registry: Registry, name: str, alias: str, occurred: datetime) -> str | None:
    """The time of a *later* policy event that already set ``alias``, else ``None``."""
    applied = registry.alias_time(name, alias)
    if applied is not None and applied > occurred:
        return applied.isoformat()
    return None


def superseded_reason(later: str, alias: str) -> str:
    return f"a later policy event ({later}) already set {alias!r}"


def promote_release(
    workspace: Workspace,
    policy: Policy,
    registered: Registered,
    ledger_entry: LedgerRelease,
    occurred: datetime,
) -> PromotionResult:
    """Gates, alias, ledger.

    Order: a later event already applied → ``superseded``; the ledger cap (SPEC §7); the
    registry's gates (:meth:`Registry.promote`); then the release is recorded in the ledger. If
    recording fails the alias is moved back and the error raised: a release is never served
    without being counted."""
    registry = workspace.registry()
    alias = str(policy.alias)
    later = superseded_by(registry, registered.name, alias, occurred)
    if later is not None:
        return PromotionResult(Status.SUPERSEDED, reasons=(superseded_reason(later, alias),))
    promotion = None
    try:
        with open_ledger(workspace) as ledger:  # written back when the block ends
            try:
                ledger.check(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
            except RefusalError as refusal:
                return PromotionResult(Status.NOT_PROMOTED, reasons=(f"release ledger: {refusal}",))
            try:
                promotion = registry.promote(
                    registered.name,
                    registered.version,
                    alias,
                    target_epsilon=policy.target_epsilon,
                    target_delta=policy.target_delta,
                    min_accuracy=policy.min_accuracy,
                )
            except GateError as gate:
                return PromotionResult(Status.NOT_PROMOTED, reasons=gate.reasons)
            bound = ledger.record(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
    except BaseException:
        if promotion is not None:
            with suppress(RegistryError):  # best effort: the original error is the news
                registry.undo_promotion(promotion)
        raise
    registry.mark_alias_time(registered.name, alias, occurred)
    status = Status.PROMOTED if promotion.changed else Status.UNCHANGED
    return PromotionResult(status, promotion.previous, (), bound.epsilon)


def handle_infeasible(
    workspace: Workspace,
    policy: Policy,
    pool: CandidatePool,
    error: InfeasibleTargetError,
    occurred: datetime,
) -> PolicyOutcome:
    """``on_infeasible``: ``revoke`` removes the policy's alias (a model that violates the
    current policy must not stay served), ``keep`` leaves it. Nothing is registered."""
    registry = workspace.registry()
    alias = str(policy.alias)
    low, high = error.reachable_epsilon_range
    base: dict[str, Any] = dict(
        merged_model=pool.merged_model, reachable_epsilon_range=(float(low), float(high))
    )
    later = superseded_by(registry, pool.merged_model, alias, occurred)
    if later is not None:
        reasons = (superseded_reason(later, alias), str(error))
        return PolicyOutcome.of(policy, Status.SUPERSEDED, reasons=reasons, **base)
    revoked = None
    if policy.on_infeasible == "revoke" and registry.model_exists(pool.merged_model):
        revoked = registry.revoke(pool.merged_model, alias)
        registry.mark_alias_time(pool.merged_model, alias, occurred)
    action = (
        f"alias {alias!r} removed (was v{revoked})"
        if revoked
        else "alias kept"
        if policy.on_infeasible == "keep"
        else f"alias {alias!r} was not set"
    )
    return PolicyOutcome.of(
        policy, Status.INFEASIBLE, revoked_version=revoked, reasons=(str(error), action), **base
    )
