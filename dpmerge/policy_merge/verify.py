"""Drift between what MLflow shows and what the release-state store and the signatures say
(docs/design.md#release-state): ``dpmerge registry verify`` and the ``verify-state`` flow.

Each check compares a projection with its source of truth and yields a :class:`Finding`; with
``repair`` the ones that are safe to repair are repaired, and the finding says how:

* ``state_unreadable`` — a dataset document fails its signature; no repair (``dpmerge state
  restore``);
* ``ledger_lacks_release`` — a signed merged version is not counted; counted (adding only
  raises the bound);
* ``alias_drift`` — the MLflow alias is not where the serving pointer says; moved back;
* ``serving_statement`` — a served alias's signed serving statement is one consumers refuse
  (missing, expired, not the workflow's, naming another version); re-issued. With ``repair``
  every served alias's statement is re-issued on every run, well before it expires
  (dpmerge.serving_statement);
* ``unmanaged_alias`` — an alias on a releases model that no pointer names; removed;

Repairs act on what is true when they act, never on the snapshot the checks read: other runs
write pointers and move aliases meanwhile. An alias is moved back only under its policy's lease
(taken without waiting: when a run of the policy holds it, that run projects the alias itself,
and the finding says so), from the pointer read under that lease; an alias no pointer named is
removed only if none names it when read again after MLflow showed it (a run writes its pointer
before it projects the alias, so a pointer found then is the alias's source).
* ``served_uncounted`` — a served release is not in the ledger (cannot happen by
  construction); reported;
* ``release_unsigned`` — a served version's signature or release hash does not verify;
  reported (quarantine it);
* ``card_mismatch`` — a served card (its description or its run's card) differs from the
  signed card in its files; reported;
* ``files_mismatch`` — a served release's files (weights, pt2 program, …) differ from its
  signed manifest, or are not those of the model it names; reported (do not serve them:
  quarantine the version; its policy's next run refuses it and revokes the alias);
* ``noncompliant`` — a served release does not meet its policy's current version (its next
  run decides), or is kept on purpose by the policy; reported;
* ``quarantined_parent`` — a served release rests on a quarantined candidate (one of its
  parents, any component of a mixture): the alias is revoked (never kept, whatever
  ``on_noncompliant`` says), as a run of its policy would;
* ``quarantine_drift`` — MLflow's tag disagrees with a quarantine record; set back;
* ``candidate_forged`` — a ready candidate version's signed record (its manifest over the
  record as published and every ``dp.*`` tag) does not verify: its tags were changed, or it was
  planted without the workflow's key. A merge run refuses it; reported (quarantine it).
* ``request_rejected`` — an object under ``quarantine/`` is no quarantine record (a key of
  another shape, a body that is not one): never applied; reported (dpmerge.state.rejections).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import suppress

from dpmerge import serving_statement
from dpmerge.findings import Finding
from dpmerge.locate import command
from dpmerge.manifests import ReleaseSignatureError
from dpmerge.policy_merge.ledger import LedgerIntegrityError, check_witnessed, rebuild_ledger
from dpmerge.policy_merge.promotion import hold_alias, publish, quarantined_parents, unmet
from dpmerge.registry import Registry, RegistryError
from dpmerge.registry.tags import STATUS_QUARANTINED
from dpmerge.serving_statement import ServingStatementError
from dpmerge.state import (
    AliasState,
    DatasetState,
    StateIntegrityError,
    StateStore,
    SupersededError,
)
from dpmerge.state import policies as stored_policies
from dpmerge.state import quarantine as stored_quarantine
from dpmerge.state import serving as state_serving
from dpmerge.state.leases import LeaseTimeoutError, lease
from dpmerge.state.quarantine import quarantined
from dpmerge.state.rejections import Rejection
from dpmerge.vocabulary import FindingKind, ServingState
from dpmerge.workspace import Workspace


def verify(
    workspace: Workspace, *, repair: bool = False, dataset: str | None = None
) -> list[Finding]:
    """Every finding over every dataset the store knows and every releases model MLflow has
    (see the module docstring); with ``dataset`` (a published identifier), over that dataset
    and its releases models only (after a policy run)."""
    store, registry = workspace.state(), workspace.registry()
    findings: list[Finding] = []
    managed: dict[str, set[str]] = {}
    known = state_serving.datasets(store)
    for each in [d for d in known if d == dataset] if dataset else known:
        try:
            state = state_serving.read_state(store, each)
        except StateIntegrityError as error:
            findings.append(Finding(FindingKind.STATE_UNREADABLE, each, str(error)))
            continue
        findings += _ledger(workspace, registry, state, repair)
        for alias in state.aliases.values():
            managed.setdefault(alias.model, set()).add(alias.alias)
            findings += _alias(workspace, state, alias, repair)
    findings += _unmanaged(store, registry, managed, repair, dataset)
    findings += _quarantine(store, registry, repair)
    findings += _forged_candidates(store, registry, dataset)
    return findings


def _ledger(
    workspace: Workspace, registry: Registry, state: DatasetState, repair: bool
) -> Iterator[Finding]:
    try:
        check_witnessed(registry, state)
    except LedgerIntegrityError as error:
        done = None
        if repair:
            added = rebuild_ledger(workspace)
            done = f"{len(added)} release(s) counted from their signed versions"
        yield Finding(FindingKind.LEDGER_LACKS_RELEASE, state.dataset, str(error), done)


def _alias(
    workspace: Workspace, state: DatasetState, alias: AliasState, repair: bool
) -> Iterator[Finding]:
    store, registry = workspace.state(), workspace.registry()
    subject = f"{alias.model}@{alias.alias}"
    shown = (
        registry.aliases(alias.model).get(alias.alias)
        if registry.model_exists(alias.model)
        else None
    )
    if shown != alias.serving:
        done = _project(store, registry, state.dataset, alias) if repair else None
        yield Finding(
            FindingKind.ALIAS_DRIFT,
            subject,
            f"MLflow names {f'v{shown}' if shown else 'nothing'}, the serving pointer "
            f"{f'v{alias.serving}' if alias.serving else 'nothing'} ({alias.state.value})",
            done,
        )
    if alias.serving is None:
        return
    if shown == alias.serving:
        yield from _statement(store, registry, state.dataset, alias, repair)
    if alias.release is not None and state.entry(alias.release) is None:
        yield Finding(
            FindingKind.SERVED_UNCOUNTED, subject, f"release {alias.release[:12]}… is not counted"
        )
    yield from _served_release(registry, alias, subject)
    out = quarantined_parents(store, state.entry(alias.release or ""))
    if out:
        yield Finding(
            FindingKind.QUARANTINED_PARENT,
            subject,
            f"v{alias.serving} rests on a quarantined candidate: {'; '.join(out)}",
            _hold(workspace, state.dataset, alias, "; ".join(out)) if repair else None,
        )
        return
    current = stored_policies.latest(store, alias.owner)
    if current is None:
        return
    failing = unmet(alias.guarantee, current.policy)
    if alias.state == ServingState.NONCOMPLIANT:
        failing = failing or ["flagged non-compliant"]
        detail = f"kept on purpose by policy {alias.owner} (on_noncompliant: keep): "
    else:
        detail = f"v{alias.serving} does not meet version {current.version} of {alias.owner}: "
    if failing:
        yield Finding(FindingKind.NONCOMPLIANT, subject, detail + "; ".join(failing))


def _project(store: StateStore, registry: Registry, dataset: str, alias: AliasState) -> str:
    """Move ``alias`` back to its pointer as read now, under its policy's lease, and re-issue
    its serving statement; what was done."""
    try:
        with lease(store, alias.owner, timeout_s=0):
            fresh = state_serving.read_state(store, dataset).alias(alias.model, alias.alias)
            if fresh is None:
                return "not repaired: its pointer is gone"
            publish(registry, fresh)
    except LeaseTimeoutError:
        return f"not repaired: a run of policy {alias.owner} is applying it and projects it"
    return f"alias set back to {f'v{fresh.serving}' if fresh.serving else 'nothing'}"


def _statement(
    store: StateStore, registry: Registry, dataset: str, alias: AliasState, repair: bool
) -> Iterator[Finding]:
    """A finding when consumers would refuse the alias's serving statement; with ``repair``
    the statement is re-issued on every run, well before it expires."""
    try:
        serving_statement.check(
            registry.serving_statement(alias.model, alias.alias),
            registry.public_key,
            model=alias.model,
            alias=alias.alias,
            version=str(alias.serving),
        )
        problem = None
    except ServingStatementError as error:
        problem = str(error)
    done = _project(store, registry, dataset, alias) if repair else None
    if problem is not None:
        yield Finding(FindingKind.SERVING_STATEMENT, f"{alias.model}@{alias.alias}", problem, done)


def _hold(workspace: Workspace, dataset: str, alias: AliasState, reason: str) -> str:
    """Make ``alias`` meet its policy's newest version now, under the policy's lease
    (:func:`~dpmerge.policy_merge.promotion.hold_alias`); what was done."""
    store = workspace.state()
    current = stored_policies.latest(store, alias.owner)
    if current is None:
        return f"not repaired: policy {alias.owner} has no valid version"
    try:
        with lease(store, alias.owner, timeout_s=0):
            return hold_alias(workspace, current, dataset, alias, (reason,), None)
    except LeaseTimeoutError:
        return f"not repaired: a run of policy {alias.owner} is applying it and revokes it"
    except SupersededError as later:
        return f"not repaired: version {later.later} of policy {alias.owner} changed it"


def _served_release(registry: Registry, alias: AliasState, subject: str) -> Iterator[Finding]:
    try:
        stored = registry.get_version(alias.model, str(alias.serving))
        facts = registry.release_facts(stored)
    except (ReleaseSignatureError, RegistryError) as error:
        yield Finding(FindingKind.RELEASE_UNSIGNED, subject, str(error))
        return
    if facts.content_hash != alias.release:
        yield Finding(
            FindingKind.RELEASE_UNSIGNED,
            subject,
            f"v{alias.serving} holds release {facts.content_hash[:12]}…, the pointer says "
            f"{str(alias.release)[:12]}…",
        )
    with tempfile.TemporaryDirectory(prefix="dpmerge-verify-") as scratch:
        try:
            manifest, root = registry.verified_model(
                alias.model, str(alias.serving), scratch, registry.public_key
            )
        except ReleaseSignatureError as error:
            yield Finding(FindingKind.FILES_MISMATCH, subject, str(error))
            return
        try:
            registry.check_card(stored, manifest, root)
        except ReleaseSignatureError as error:
            yield Finding(FindingKind.CARD_MISMATCH, subject, str(error))


def _managed_now(store: StateStore) -> dict[str, set[str]]:
    """The aliases some pointer names, read now, per releases model (unreadable documents
    count as naming none: :func:`verify` reports them)."""
    managed: dict[str, set[str]] = {}
    for dataset in state_serving.datasets(store):
        with suppress(StateIntegrityError):
            for alias in state_serving.read_state(store, dataset).aliases.values():
                managed.setdefault(alias.model, set()).add(alias.alias)
    return managed


def _unmanaged(
    store: StateStore,
    registry: Registry,
    managed: dict[str, set[str]],
    repair: bool,
    dataset: str | None,
) -> Iterator[Finding]:
    now: dict[str, set[str]] | None = None  # read again only when an alias looks unmanaged
    for model in sorted({v.name for v in registry.merged_versions(dataset)}):
        for alias, version in sorted(registry.aliases(model).items()):
            if alias in managed.get(model, set()):
                continue
            now = _managed_now(store) if now is None else now
            if alias in now.get(model, set()):  # its pointer was written after the snapshot
                continue
            done = None
            if repair:
                registry.set_alias(model, alias, None)
                done = "alias removed"
            yield Finding(
                FindingKind.UNMANAGED_ALIAS,
                f"{model}@{alias}",
                f"names v{version}, but no policy's serving pointer does",
                done,
            )


def _forged_candidates(
    store: StateStore, registry: Registry, dataset: str | None
) -> Iterator[Finding]:
    """Every ready candidate version (of ``dataset`` if given) not quarantined whose signed
    record does not verify under the release key."""
    out: dict[str, set[str]] = {}
    for stored in sorted(registry.ready_candidates(), key=lambda v: (v.name, int(v.version))):
        if dataset is not None and stored.tags.get("dp.dataset") != dataset:
            continue
        if stored.name not in out:
            out[stored.name] = set(quarantined(store, stored.name))
        if stored.version in out[stored.name]:
            continue
        try:
            registry.manifest(stored)
        except ReleaseSignatureError as error:
            subject = f"{stored.name} v{stored.version}"
            yield Finding(
                FindingKind.CANDIDATE_FORGED,
                subject,
                f"its signed record does not verify ({error}); a merge refuses it: "
                f"`{command('registry', 'quarantine', stored.name, stored.version)}`",
            )


def _quarantine(store: StateStore, registry: Registry, repair: bool) -> Iterator[Finding]:
    for examined in stored_quarantine.examine(store):
        if isinstance(examined, Rejection):  # bounded reads: a finding, never a traceback
            yield Finding(FindingKind.REQUEST_REJECTED, examined.key, examined.line())
    for model in stored_quarantine.models(store):
        for version, record in sorted(quarantined(store, model).items()):
            status = registry.get_version(model, version).tags.get("dp.status")
            if status == STATUS_QUARANTINED:
                continue
            done = None
            if repair:
                registry.quarantine(model, version, record.reason)
                done = "tag set back to quarantined"
            yield Finding(
                FindingKind.QUARANTINE_DRIFT,
                f"{model} v{version}",
                f"quarantined by {record.by} at {record.at}, but MLflow says {status!r}",
                done,
            )
