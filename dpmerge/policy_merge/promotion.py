"""Registration and promotion (steps 6–7), revocation when the target is infeasible, and the
event-time order of alias changes (tag ``dp.alias_time.<alias>``)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mlflow.exceptions import MlflowException

from dpmerge.accounting.ledger import Release as LedgerRelease
from dpmerge.errors import InfeasibleTargetError, RefusalError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.outcome import PolicyOutcome, Status
from dpmerge.policy_merge.release import MergeRequest, Release
from dpmerge.policy_merge.release_ledger import open_ledger
from dpmerge.policy_merge.workspace import Workspace
from dpmerge.registry import GateError, Registry, RegistryError, tag_float

ALIAS_TIME_TAG = "dp.alias_time."


@dataclass(frozen=True)
class Registered:
    name: str
    version: str
    reused: bool
    epsilon: float | None
    accuracy: float | None
    content_hash: str


def find_release(registry: Registry, request: MergeRequest) -> Registered | None:
    """The ready version of this exact request, if one was registered before."""
    found = registry.find_ready_version(request.pool.merged_model, request.content_hash)
    if found is None:
        return None
    return Registered(
        name=request.pool.merged_model,
        version=str(found.version),
        reused=True,
        epsilon=tag_float(found.tags.get("dp.epsilon")),
        accuracy=tag_float(found.tags.get("dp.accuracy")),
        content_hash=request.content_hash,
    )


def register_release(
    registry: Registry, request: MergeRequest, release: Release, ledger: Mapping[str, Any] | None
) -> Registered:
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
    mv = registry.client.get_model_version(registered.name, registered.version)
    return Registered(
        name=registered.name,
        version=registered.version,
        reused=registered.reused,
        epsilon=tag_float(mv.tags.get("dp.epsilon")),
        accuracy=tag_float(mv.tags.get("dp.accuracy")),
        content_hash=registered.content_hash,
    )


def parse_time(value: str | datetime | None) -> datetime:
    """An event time (ISO 8601, naive means UTC); ``None`` is now."""
    if value is None or value == "":
        return datetime.now(UTC)
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _model_tags(registry: Registry, name: str) -> dict[str, str] | None:
    try:
        return dict(registry.client.get_registered_model(name).tags)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise RegistryError(f"reading registered model {name}: {error.message}") from None


def superseded_by(registry: Registry, name: str, alias: str, occurred: datetime) -> str | None:
    """The time of a *later* policy event that already set ``alias``, else ``None``."""
    tags = _model_tags(registry, name) or {}
    applied = tags.get(ALIAS_TIME_TAG + alias)
    if applied and parse_time(applied) > occurred:
        return applied
    return None


def mark_alias_time(registry: Registry, name: str, alias: str, occurred: datetime) -> None:
    try:
        registry.client.set_registered_model_tag(name, ALIAS_TIME_TAG + alias, occurred.isoformat())
    except MlflowException as error:
        raise RegistryError(f"tagging {name} with the policy time: {error.message}") from None


def promote_release(
    workspace: Workspace,
    registry: Registry,
    policy: Policy,
    registered: Registered,
    ledger_entry: LedgerRelease,
    occurred: datetime,
) -> tuple[Status, str | None, tuple[str, ...], float | None]:
    """Gates, alias, ledger. Returns (status, previous version, reasons, cumulative ε).

    Order: a later event already applied → ``superseded``; the ledger cap (SPEC §7); the
    registry's gates (:meth:`Registry.promote`); then the release is recorded in the ledger. If
    recording fails the alias is moved back and the error raised: a release is never served
    without being counted."""
    alias = str(policy.alias)
    later = superseded_by(registry, registered.name, alias, occurred)
    if later is not None:
        return "superseded", None, (f"a later policy event ({later}) already set {alias!r}",), None
    promotion = None
    try:
        with open_ledger(workspace) as ledger:  # written back when the block ends
            try:
                ledger.check(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
            except RefusalError as refusal:
                return "not_promoted", None, (f"release ledger: {refusal}",), None
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
                return "not_promoted", None, gate.reasons, None
            bound = ledger.record(ledger_entry, policy.target_delta, policy.cumulative_epsilon_cap)
    except BaseException:
        if promotion is not None and promotion.changed:
            with suppress(MlflowException):
                if promotion.previous is None:
                    registry.client.delete_registered_model_alias(registered.name, alias)
                else:
                    registry.client.set_registered_model_alias(
                        registered.name, alias, promotion.previous
                    )
        raise
    mark_alias_time(registry, registered.name, alias, occurred)
    status: Status = "promoted" if promotion.changed else "unchanged"
    return status, promotion.previous, (), bound.epsilon


def handle_infeasible(
    registry: Registry,
    policy: Policy,
    pool: CandidatePool,
    error: InfeasibleTargetError,
    occurred: datetime,
) -> PolicyOutcome:
    """``on_infeasible``: ``revoke`` removes the policy's alias (a model that violates the
    current policy must not stay served), ``keep`` leaves it. Nothing is registered."""
    alias = str(policy.alias)
    low, high = error.reachable_epsilon_range
    base = dict(
        policy=policy.name,
        alias=alias,
        target_epsilon=policy.target_epsilon,
        target_delta=policy.target_delta,
        merged_model=pool.merged_model,
        reachable_epsilon_range=(float(low), float(high)),
    )
    later = superseded_by(registry, pool.merged_model, alias, occurred)
    if later is not None:
        reason = f"a later policy event ({later}) already set {alias!r}"
        return PolicyOutcome(status="superseded", reasons=(reason, str(error)), **base)
    revoked = None
    if policy.on_infeasible == "revoke" and _model_tags(registry, pool.merged_model) is not None:
        revoked = registry.revoke(pool.merged_model, alias)
        mark_alias_time(registry, pool.merged_model, alias, occurred)
    action = (
        f"alias {alias!r} removed (was v{revoked})"
        if revoked
        else "alias kept"
        if policy.on_infeasible == "keep"
        else f"alias {alias!r} was not set"
    )
    return PolicyOutcome(
        status="infeasible", revoked_version=revoked, reasons=(str(error), action), **base
    )
