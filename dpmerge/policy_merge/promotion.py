"""Registration, serving and the serving invariant (steps 6–7, docs/design.md#release-state).

* :func:`register_release` registers a counted release with its privacy card;
* :func:`serve_release` checks that the release is its files (:func:`release_problem`: refused
  otherwise), the registry's gates on its signed facts, then counts it (if it is not yet) and
  points the policy's alias at it in **one** conditional write to the release-state store;
* :func:`enforce` keeps the serving invariant when a run could not serve a compliant release
  (infeasible target, a failed gate, the cap): the alias keeps its release only if that release
  meets the policy's *current* version; otherwise it is revoked, or — if the policy says
  ``on_noncompliant: keep`` — kept and flagged non-compliant; a release that is not its files,
  or whose candidates include a quarantined one (:func:`quarantined_parents`), is always
  revoked; :func:`hold` and :func:`hold_alias` do the same, and project the alias, for callers
  without a run's candidate pool (the dispatcher after a run that ended without an outcome,
  ``registry verify --repair``);
* :func:`project` makes the MLflow alias name what the serving pointer says (the alias is a
  projection of the pointer: moved after it, and repaired from it by every later run and by
  ``dpmerge registry verify``) and :func:`publish` signs the serving statement consumers
  check (docs/design.md#security).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from dpmerge import serving_statement
from dpmerge.errors import OutageError, RefusalError
from dpmerge.formatting import epsilon_text
from dpmerge.manifests import ReleaseSignatureError
from dpmerge.policies import Policy
from dpmerge.policy_merge.candidates import CandidatePool
from dpmerge.policy_merge.ledger import LedgerSummary
from dpmerge.policy_merge.outcome import Status
from dpmerge.policy_merge.release import MergeRequest, Release
from dpmerge.registry import GateError, Registry, RegistryError, ReleaseFacts
from dpmerge.registry.tags import SERVED_TAG, STATEMENT_TAG
from dpmerge.state import AliasState, CountedRelease, Guarantee, StateStore, SupersededError
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion
from dpmerge.state.quarantine import quarantined
from dpmerge.state.releases import keep_release
from dpmerge.vocabulary import GatingBound, OnNoncompliant, ServingState
from dpmerge.workspace import Workspace


@dataclass(frozen=True)
class Registered:
    """A ready, signed merged version of a merge request (new, or reused from an earlier run)."""

    name: str
    version: str
    reused: bool
    epsilon: float
    accuracy: float | None
    content_hash: str

    @classmethod
    def of(cls, facts: ReleaseFacts, *, reused: bool) -> Registered:
        return cls(
            facts.name, facts.version, reused, facts.epsilon, facts.accuracy, facts.content_hash
        )


def find_release(workspace: Workspace, request: MergeRequest) -> Registered | None:
    """The ready version of this exact request registered before, if it is signed by the
    workflow and not quarantined (a version planted under the release hash by someone without
    the workflow's key, or one whose tags were changed, is never reused)."""
    registry = workspace.registry()
    name = request.pool.merged_model
    out = quarantined(workspace.state(), name)
    found = registry.find_ready_version(name, request.content_hash, exclude=out)
    return None if found is None else Registered.of(registry.release_facts(found), reused=True)


def register_release(
    workspace: Workspace, request: MergeRequest, release: Release, ledger: LedgerSummary
) -> Registered:
    """Register ``release`` (already counted) as the request's merged version, its cards
    showing ``ledger``: its internal record is kept in the state store first, then the version
    is registered with its public card (docs/design.md#release-state)."""
    registry = workspace.registry()
    prepared = registry.prepare_merged(
        release.path,
        parents=request.parents,
        policy=request.policy,
        parent_model=request.pool.registered_model,
        name=request.pool.merged_model,
        ledger=ledger.card(),
        notes=release.notes,
        internal_notes=release.internal_notes,
    )
    if prepared.content_hash != request.content_hash:  # the two hashes must agree
        raise RegistryError(f"{prepared.name}: the release's hash differs from the request's")
    keep_release(workspace.state(), prepared.internal())
    registered = registry.register_merged(
        prepared, started_ms=release.started_ms, ended_ms=release.ended_ms
    )
    stored = registry.get_version(registered.name, registered.version)
    return Registered.of(registry.release_facts(stored), reused=registered.reused)


def release_problem(workspace: Workspace, name: str, version: str) -> str | None:
    """Why merged version ``version`` of ``name`` is not the release its signature says
    (``None``: it is): its signed manifest must verify against its tags, name this version's
    own MLflow model, and list exactly the files MLflow serves for it (downloaded from where
    serving reads them; docs/design.md#security). Checked on every promotion, reuse and
    unchanged rerun, and for the release an alias keeps."""
    registry = workspace.registry()
    with tempfile.TemporaryDirectory(prefix="dpmerge-release-") as scratch:
        try:
            registry.verified_model(name, version, scratch, registry.public_key)
        except (ReleaseSignatureError, RegistryError) as error:
            if isinstance(error, OutageError):  # MLflow down: nothing is known of the release
                raise
            return (
                f"{name} v{version} is not the release its signature says ({error}); take it "
                f"out of use with `dpmerge registry quarantine {name} {version}`"
            )
    return None


def read_card(workspace: Workspace, name: str, version: str) -> str:
    """The public privacy card (Markdown) of a registered merged version."""
    return workspace.registry().card_text(name, version)


def unmet(guarantee: Guarantee | None, policy: Policy) -> list[str]:
    """Why a served release with ``guarantee`` does not meet ``policy`` (empty: it does)."""
    if guarantee is None:
        return ["the alias serves no release"]
    reasons = []
    if guarantee.epsilon > policy.target_epsilon:
        reasons.append(
            f"its ε = {epsilon_text(guarantee.epsilon)} exceeds ε* = {policy.target_epsilon:g}"
        )
    if guarantee.delta > policy.target_delta:
        reasons.append(f"its δ = {guarantee.delta:g} exceeds δ* = {policy.target_delta:g}")
    if guarantee.accuracy is None or guarantee.accuracy < policy.min_accuracy:
        reasons.append(f"its accuracy {guarantee.accuracy} is below {policy.min_accuracy:g}")
    if policy.gating_bound == GatingBound.GENERIC and guarantee.bound == GatingBound.STRUCTURED:
        reasons.append("it is gated by the structured bound; the policy asks for the generic one")
    return reasons


@dataclass(frozen=True)
class ServeResult:
    """What :func:`serve_release` did: its status, the version the alias served before, why
    it did not serve, and the ledger's cumulative ε once counted."""

    status: Status
    previous: str | None = None
    reasons: tuple[str, ...] = ()
    cumulative_epsilon: float | None = None


def serve_release(
    workspace: Workspace,
    version: PolicyVersion,
    registered: Registered,
    entry: CountedRelease,
    run: str | None,
) -> ServeResult:
    """Gates, then count-and-point in one conditional write (see the module docstring).
    ``superseded`` when a later version of the policy already changed the alias;
    ``refused`` when the version is not its signed files and model (:func:`release_problem`);
    ``not_promoted`` when a gate, the quarantine or the ledger cap refuses."""
    policy = version.policy
    registry = workspace.registry()
    model = registered.name
    problem = release_problem(workspace, model, registered.version)
    if problem is not None:
        return ServeResult(Status.REFUSED, reasons=(problem,))
    try:
        facts = registry.check_gates(
            model,
            registered.version,
            target_epsilon=policy.target_epsilon,
            target_delta=policy.target_delta,
            min_accuracy=policy.min_accuracy,
        )
    except GateError as gate:
        return ServeResult(Status.NOT_PROMOTED, reasons=gate.reasons)
    out = [
        *(
            [f"v{registered.version} is quarantined"]
            if registered.version in quarantined(workspace.state(), model)
            else []
        ),
        *quarantined_parents(workspace.state(), entry),
    ]
    if out:
        return ServeResult(Status.NOT_PROMOTED, reasons=tuple(out))
    guarantee = Guarantee(facts.epsilon, facts.delta, facts.bound, facts.accountant, facts.accuracy)
    try:
        served = state_serving.serve(
            workspace.state(),
            entry,
            model=model,
            alias=str(policy.alias),
            version=registered.version,
            guarantee=guarantee,
            cap=policy.cumulative_epsilon_cap,
            run=run,
        )
    except SupersededError as later:
        return ServeResult(Status.SUPERSEDED, reasons=(superseded_reason(later.later, policy),))
    except RefusalError as refusal:  # a concurrent release took the room under the cap
        return ServeResult(Status.NOT_PROMOTED, reasons=(str(refusal),))
    status = Status.PROMOTED if served.changed else Status.UNCHANGED
    return ServeResult(status, served.before.serving, (), served.cumulative.epsilon)


def superseded_reason(later: int, policy: Policy) -> str:
    return f"version {later} of policy {policy.name} already exists or changed {policy.alias!r}"


@dataclass(frozen=True)
class Enforced:
    """The alias after :func:`enforce`, and what it did (one line)."""

    alias: AliasState | None
    action: str


def enforce(
    workspace: Workspace,
    version: PolicyVersion,
    pool: CandidatePool,
    reasons: Sequence[str],
    run: str | None,
) -> Enforced:
    """The serving invariant for a run that served nothing new (``reasons``: why): after it,
    the policy's alias serves a release that meets ``version``, or nothing — unless the
    policy keeps non-compliant models, which are then flagged; a release that is not its files,
    or rests on a quarantined candidate, is never kept. Raises
    :class:`~dpmerge.state.SupersededError` when a later version already changed the alias."""
    alias = str(version.policy.alias)
    return keep_invariant(workspace, version, pool.dataset, pool.merged_model, alias, reasons, run)


def keep_invariant(
    workspace: Workspace,
    version: PolicyVersion,
    dataset: str,
    model: str,
    alias: str,
    reasons: Sequence[str],
    run: str | None,
) -> Enforced:
    """:func:`enforce` for ``alias`` (owned by ``version``'s policy) on releases model
    ``model`` of ``dataset``."""
    policy = version.policy
    store = workspace.state()
    state_serving.claim(store, dataset, model, alias, policy.name)
    state = state_serving.read_state(store, dataset)
    current = state.alias(model, alias)
    assert current is not None  # claimed above
    if current.serving is None:
        after = state_serving.touch(
            store,
            dataset,
            model=model,
            alias=alias,
            policy=policy.name,
            policy_version=version.version,
        )
        was = "revoked" if current.state == ServingState.REVOKED else "not set"
        return Enforced(after, f"alias {alias!r} serves nothing ({was})")
    problem = release_problem(workspace, model, current.serving)
    problems = [
        *([problem] if problem else []),
        *quarantined_parents(store, state.entry(current.release or "")),
    ]
    failing = [*problems, *unmet(current.guarantee, policy)]
    if not failing:
        after = state_serving.touch(
            store,
            dataset,
            model=model,
            alias=alias,
            policy=policy.name,
            policy_version=version.version,
        )
        return Enforced(after, f"alias {alias!r} keeps v{current.serving}, which meets the policy")
    keep = policy.on_noncompliant == OnNoncompliant.KEEP and not problems
    why = "; ".join([*reasons, *failing])
    _, after = state_serving.withdraw(
        store,
        dataset,
        model=model,
        alias=alias,
        policy=policy.name,
        policy_version=version.version,
        state=ServingState.NONCOMPLIANT if keep else ServingState.REVOKED,
        reason=f"v{current.serving} does not meet version {version.version}: {why}",
        run=run,
    )
    action = (
        f"alias {alias!r} KEEPS v{current.serving}, which does NOT meet the policy "
        f"({'; '.join(failing)}): kept because the policy says on_noncompliant: keep"
        if keep
        else f"alias {alias!r} revoked (was v{current.serving}: {'; '.join(failing)})"
    )
    return Enforced(after, action)


def hold(
    workspace: Workspace, version: PolicyVersion, reasons: Sequence[str], run: str | None
) -> str:
    """Make the alias of ``version``'s policy meet it (:func:`keep_invariant`) wherever the
    store says the policy serves, and project it to MLflow; what was done (one line). For a
    caller that has no candidate pool: the dispatcher, after a run that ended without an
    outcome (``registry verify --repair`` calls :func:`hold_alias` for the alias it found on
    a quarantined candidate). The caller holds the policy's lease."""
    store, alias = workspace.state(), str(version.policy.alias)
    for dataset in state_serving.datasets(store):
        for each in state_serving.read_state(store, dataset).aliases.values():
            if (each.owner, each.alias) == (version.name, alias):
                return hold_alias(workspace, version, dataset, each, reasons, run)
    return f"alias {alias!r} serves nothing (not set)"


def hold_alias(
    workspace: Workspace,
    version: PolicyVersion,
    dataset: str,
    found: AliasState,
    reasons: Sequence[str],
    run: str | None,
) -> str:
    """:func:`hold` for ``found``, an alias of ``dataset`` the policy owns; what was done."""
    model, alias = found.model, found.alias
    enforced = keep_invariant(workspace, version, dataset, model, alias, reasons, run)
    project_alias(workspace, dataset, model, alias)
    return enforced.action


def quarantined_parents(store: StateStore, entry: CountedRelease | None) -> list[str]:
    """Why the release ``entry`` counts may not be served: each of its candidates (every
    component of a mixture) that is quarantined (docs/design.md#release-state)."""
    out: dict[str, set[str]] = {}
    found = []
    for model, version in entry.parents() if entry is not None else []:
        if model not in out:
            out[model] = set(quarantined(store, model))
        if version in out[model]:
            found.append(f"its candidate {model} v{version} is quarantined")
    return found


@dataclass(frozen=True)
class Projection:
    """What :func:`project` did to the MLflow alias: the version it named before and now."""

    before: str | None
    after: str | None


def project(workspace: Workspace, pool: CandidatePool, alias: str) -> Projection:
    """Make the MLflow alias name what the serving pointer says (remove it when the pointer
    serves nothing), and show what it serves as a registered-model tag, ε rounded up."""
    return project_alias(workspace, pool.dataset, pool.merged_model, alias)


def project_alias(workspace: Workspace, dataset: str, model: str, alias: str) -> Projection:
    """:func:`project` for ``alias`` on releases model ``model`` of ``dataset``."""
    record = state_serving.read_state(workspace.state(), dataset).alias(model, alias)
    registry = workspace.registry()
    if record is None or not registry.model_exists(model):
        return Projection(None, None)  # nothing registered yet: no alias to project
    return Projection(publish(registry, record), record.serving)


def publish(registry: Registry, record: AliasState, now: datetime | None = None) -> str | None:
    """Set the MLflow alias of ``record`` to the version its pointer serves (remove it when
    none), the tag showing what it serves, and the workflow's serving statement issued ``now``
    (:mod:`dpmerge.serving_statement`; removed when it serves nothing); the version the alias
    named before."""
    statement = None
    if record.serving is not None:  # signed first: without the key, nothing changes
        statement = serving_statement.issue(
            record.model,
            record.alias,
            record.serving,
            record.owner,
            record.policy_version,
            registry.keys,
            now,
        )
    before = registry.set_alias(record.model, record.alias, record.serving)
    registry.set_model_tag(record.model, SERVED_TAG + record.alias, served_text(record))
    registry.set_model_tag(record.model, STATEMENT_TAG + record.alias, statement)
    return before


def served_text(record: AliasState) -> str | None:
    """What an alias serves, for people (ε rounded up), or ``None`` when it serves nothing."""
    guarantee = record.guarantee
    if record.serving is None or guarantee is None:
        return None
    flag = "NON-COMPLIANT " if record.state == ServingState.NONCOMPLIANT else ""
    return (
        f"{flag}v{record.serving}: ε ≤ {epsilon_text(guarantee.epsilon)} "
        f"(δ = {guarantee.delta:g}, {guarantee.bound} bound, {guarantee.accountant})"
    )
