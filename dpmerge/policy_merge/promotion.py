"""Registration and promotion (steps 6–7), revocation when the target is infeasible, alias
ownership (an alias belongs to the policy that first set it), the event order of alias changes
(the registry's ``dp.alias_time.<alias>``: server-received times, docs/design.md#security), and
the card of a registered release."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dpmerge.errors import InfeasibleTargetError, RefusalError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.events import trusted
from dpmerge.policy_merge.outcome import PolicyOutcome, Status
from dpmerge.policy_merge.release import MergeRequest, Release
from dpmerge.policy_merge.release_ledger import LedgerEntry, ledger_summary, record_release
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import (
    AliasOwnershipError,
    GateError,
    Registry,
    RegistryError,
    StoredVersion,
    tag_float,
)


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
        notes=release.notes,
        started_ms=release.started_ms,
        ended_ms=release.ended_ms,
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


def superseded_by(registry: Registry, name: str, alias: str, occurred: datetime) -> str | None:
    """The time of a *later* policy event that already set ``alias``, else ``None``. A
    recorded time in the future is not trusted (it would freeze the alias)."""
    applied = registry.alias_time(name, alias)
    if applied is not None and applied > occurred and trusted(applied):
        return applied.isoformat()
    return None


def check_alias_owner(registry: Registry, name: str, policy: Policy) -> None:
    """Refuse (:class:`AliasOwnershipError`) a policy that names an alias another policy owns,
    before anything is read or changed."""
    alias = str(policy.alias)
    owner = registry.alias_owner(name, alias) if registry.model_exists(name) else None
    if owner is not None and owner != policy.name:
        raise AliasOwnershipError(
            f"alias {alias!r} of {name} belongs to policy {owner!r}; policy {policy.name!r} "
            f"may not change it (give the policy its own alias, e.g. 'policy-{policy.name}')"
        )


def superseded_reason(later: str, alias: str) -> str:
    return f"a later policy event ({later}) already set {alias!r}"


def promote_release(
    workspace: Workspace,
    policy: Policy,
    registered: Registered,
    entry: LedgerEntry,
    occurred: datetime,
) -> PromotionResult:
    """Gates, alias, ledger.

    Order: a later event already applied → ``superseded``; the alias claimed for the policy
    (another policy's alias is refused); the ledger cap (docs/design.md#release-ledger); the
    registry's gates (:meth:`Registry.promote`); then the release is recorded in the ledger
    (a conditional write that keeps concurrent releases; the cap is checked again against
    them) and marked released in the registry. If recording fails or the cap now refuses, the
    alias is moved back: a release is never served without being counted."""
    registry = workspace.registry()
    alias = str(policy.alias)
    later = superseded_by(registry, registered.name, alias, occurred)
    if later is not None:
        return PromotionResult(Status.SUPERSEDED, reasons=(superseded_reason(later, alias),))
    registry.claim_alias(registered.name, alias, policy.name)
    delta, cap = policy.target_delta, policy.cumulative_epsilon_cap
    _, refusal = ledger_summary(workspace, entry, delta, cap)
    if refusal is not None:
        return PromotionResult(Status.NOT_PROMOTED, reasons=(refusal,))
    try:
        promotion = registry.promote(
            registered.name,
            registered.version,
            alias,
            target_epsilon=policy.target_epsilon,
            target_delta=delta,
            min_accuracy=policy.min_accuracy,
        )
    except GateError as gate:
        return PromotionResult(Status.NOT_PROMOTED, reasons=gate.reasons)
    try:
        bound = record_release(workspace, entry, delta, cap)
    except RefusalError as refusal_now:  # a concurrent release took the room under the cap
        registry.undo_promotion(promotion)
        return PromotionResult(Status.NOT_PROMOTED, reasons=(f"release ledger: {refusal_now}",))
    except BaseException:
        with suppress(RegistryError):  # best effort: the original error is the news
            registry.undo_promotion(promotion)
        raise
    registry.mark_released(registered.name, registered.version)
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
        registry.claim_alias(pool.merged_model, alias, policy.name)
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
