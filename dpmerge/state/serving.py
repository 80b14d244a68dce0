"""The ledger and the serving pointers of one dataset: one signed document, changed only by
compare-and-swap (docs/design.md#release-state).

``datasets/<dataset id>.json`` holds, for the dataset's published (keyed) identifier:

* ``releases``: the releases counted under this identifier — every release whose evaluation
  was ever published (registered), with the candidates it used and the records they were
  counted with. The **ledger** is the data source's, not the identifier's: a source (today the
  dataset's file, named by :func:`source_of`) has one identifier per subset a candidate trained
  on (a row limit gives another fingerprint), and every release of any of them is charged to
  everyone in the source (docs/design.md#release-ledger). :attr:`DatasetState.ledger` merges the
  releases of every document of the source, so the documents written one per identifier before
  are read and merged as they are (nothing is rewritten);
* ``aliases``: per ``<registered model>@<alias>``, its owner (the policy that first claimed
  it) and its **serving pointer** — which release the alias serves (or that it was revoked, or
  is kept although it no longer meets its policy), since when, for which policy version and
  run, why, and the earlier states.

Because both live in one document, "count the release and point the alias at it" is one
conditional write (:func:`serve`): no crash can leave a release served but uncounted. The
MLflow alias is a projection of the pointer, moved after it and repaired from it. The document
is signed with the workflow's key: a ledger entry or pointer changed outside the workflow
fails closed (:class:`~dpmerge.state.store.StateIntegrityError`, naming the repair).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dpmerge.accounting.private_accuracy import Evaluation
from dpmerge.accounting.private_selection import Selection
from dpmerge.documents import shorten
from dpmerge.errors import InputError, RefusalError
from dpmerge.formatting import epsilon_text
from dpmerge.state.store import StateIntegrityError, StateStore, stamp
from dpmerge.vocabulary import ServingState

if TYPE_CHECKING:  # the accountants are imported only where a bound is computed
    from dpmerge.accounting.bounds import PairBound
    from dpmerge.accounting.ledger import LedgerStatement, Release

SCHEMA = "dpmerge.dataset-state/1"
HISTORY = 50
"""Earlier states kept per alias (the newest ones)."""
MAX_SELECTIONS = 100
"""The most private selections one ledger entry holds (a bigger one is a damaged document)."""


class AliasOwnershipError(InputError):
    """A policy named an alias that another policy owns (docs/design.md#release-state)."""


class SupersededError(Exception):
    """A later version of the policy already changed the alias: this run changes nothing."""

    def __init__(self, later: int) -> None:
        super().__init__(f"policy version {later} already set the alias")
        self.later = later


def dataset_key(dataset: str) -> str:
    return f"datasets/{dataset.replace(':', '=')}.json"


def source_of(dataset: str) -> str:
    """The data source a dataset identifier (or fingerprint) is a subset of: the dataset's name
    (``digits-hmac:…`` → ``digits``), and one source ``own`` for every dataset of your own
    (table, image folder, npz, saved Hugging Face dataset: docs/design.md#your-data). Every
    identifier of one source shares a ledger: two files of one source would be charged
    together, which only raises the bound."""
    from dpmerge.data.sources import OWN_DATA, OWN_SOURCE
    from dpmerge.publication import dataset_name

    name = dataset_name(dataset)
    return OWN_SOURCE if name in OWN_DATA else name


def alias_key(model: str, alias: str) -> str:
    return f"{model}@{alias}"


@dataclass(frozen=True)
class Guarantee:
    """What a served release promises, as the gate checked it: its gating ε, δ, bound and
    accountant, and its test accuracy."""

    epsilon: float
    delta: float
    bound: str
    accountant: str | None = None
    accuracy: float | None = None


@dataclass(frozen=True)
class CountedRelease:
    """A ledger entry: a release — its candidates with non-zero weight, as published (keyed
    dataset identifier and lineages; every number the accountants use) — who asked for it,
    where each candidate is registered, and what its published accuracy estimate spent on the
    test rows (``evaluation``; ``None`` in entries counted before the ledger recorded it:
    no published DP estimate recorded, docs/design.md#release-ledger), and what each private
    selection that ended in this release spent on the validation rows (``selections``; empty
    where none was made; two policies' selections can choose the same merge, and each spent)."""

    release_id: str
    dataset: str
    method: str
    candidates: tuple[dict[str, Any], ...]
    versions: dict[str, str]
    delta: float
    policy: str
    policy_version: int
    counted_at: str = ""
    evaluation: Evaluation | None = None
    selections: tuple[Selection, ...] = ()

    @classmethod
    def of(
        cls,
        release: Release,
        *,
        versions: Mapping[str, str],
        delta: float,
        policy: str,
        policy_version: int,
        evaluation: Evaluation | None = None,
        selections: Sequence[Selection] = (),
    ) -> CountedRelease:
        data = release.to_dict()
        return cls(
            release_id=release.release_id,
            dataset=release.dataset,
            method=release.method,
            candidates=tuple(data["candidates"]),
            versions=dict(versions),
            delta=delta,
            policy=policy,
            policy_version=policy_version,
            evaluation=evaluation,
            selections=tuple(selections),
        )

    def joined(self, other: CountedRelease) -> CountedRelease:
        """This entry (the release counted before) with what ``other`` — the same release
        asked for again — adds: candidates it consulted that this one did not and its
        selections not counted yet (told apart by draw key). The evaluation stays this entry's:
        a release's estimate is drawn once, when it is first counted (``other`` carries only
        the one a plan anticipates, and an entry counted without one stays unbounded)."""
        names = set(self.names)
        known = {s.key for s in self.selections if s.key}
        return replace(
            self,
            candidates=(*self.candidates, *(c for c in other.candidates if c["name"] not in names)),
            versions={**other.versions, **self.versions},
            selections=(
                *self.selections,
                *(
                    s
                    for s in other.selections
                    if (s.key not in known if s.key else s not in self.selections)
                ),
            ),
        )

    def release(self) -> Release:
        """The entry as the accountants take it."""
        from dpmerge.accounting.ledger import Release

        return Release.from_dict(
            {
                "release_id": self.release_id,
                "dataset": self.dataset,
                "method": self.method,
                "candidates": list(self.candidates),
            }
        )

    @property
    def names(self) -> list[str]:
        return [str(c["name"]) for c in self.candidates]

    def parents(self) -> list[tuple[str, str]]:
        """``(registered model, version)`` of each candidate the release uses (every component
        of a mixture), where :attr:`versions` names it."""
        found = []
        for name in self.names:
            model, _, version = self.versions.get(name, "").rpartition(" v")
            if model and version.isdigit():
                found.append((model, version))
        return found

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidates"] = list(self.candidates)
        data.pop("evaluation")  # absent, not null, where none is recorded (as entries before)
        if self.evaluation is not None:
            data["evaluation"] = self.evaluation.to_dict()
        data.pop("selections")  # absent where no private selection was made
        if self.selections:
            data["selections"] = [s.to_dict() for s in self.selections]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CountedRelease:
        candidates = data["candidates"]
        if not isinstance(candidates, list) or not all(isinstance(c, dict) for c in candidates):
            raise TypeError("candidates must be a list of records")
        return cls(
            release_id=str(data["release_id"]),
            dataset=str(data["dataset"]),
            method=str(data["method"]),
            candidates=tuple(candidates),
            versions={str(k): str(v) for k, v in data["versions"].items()},
            delta=float(data["delta"]),
            policy=str(data["policy"]),
            policy_version=int(data["policy_version"]),
            counted_at=str(data.get("counted_at", "")),
            evaluation=Evaluation.from_dict(data["evaluation"]) if "evaluation" in data else None,
            selections=_selections(data),
        )


def _selections(data: Mapping[str, Any]) -> tuple[Selection, ...]:
    """An entry's selections: ``selections`` (at most :data:`MAX_SELECTIONS`), or the one
    ``selection`` of entries counted before a release could hold several."""
    if "selection" in data:
        return (Selection.from_dict(data["selection"]),)
    found = data.get("selections", [])
    if not isinstance(found, list) or len(found) > MAX_SELECTIONS:
        raise ValueError(f"selections must be a list of at most {MAX_SELECTIONS} records")
    return tuple(Selection.from_dict(s) for s in found)


@dataclass(frozen=True)
class AliasState:
    """One alias: its owner and what it serves (see the module docstring). ``policy_version``
    is the version of the owner's policy the state reflects; ``run`` the flow run (or process)
    that set it."""

    model: str
    alias: str
    owner: str
    state: ServingState = ServingState.UNSET
    release: str | None = None
    version: str | None = None
    guarantee: Guarantee | None = None
    policy_version: int = 0
    run: str | None = None
    since: str = ""
    reason: str = ""
    history: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def serving(self) -> str | None:
        """The version the MLflow alias must name (``None``: no version)."""
        return self.version if self.state in SERVED else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        data["history"] = list(self.history)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AliasState:
        guarantee = data.get("guarantee")
        return cls(
            **{
                **{k: data[k] for k in cls.__dataclass_fields__ if k in data},
                "state": ServingState(data["state"]),
                "guarantee": Guarantee(**guarantee) if guarantee else None,
                "history": tuple(data.get("history") or ()),
            }
        )

    def moved(self, **changes: Any) -> AliasState:
        """This alias in a new state, the current one kept in ``history``."""
        previous = {k: v for k, v in self.to_dict().items() if k not in ("history", "model")}
        kept = (*self.history, previous)[-HISTORY:] if self.state != ServingState.UNSET else ()
        return replace(self, **changes, since=stamp(), history=kept)


SERVED = frozenset({ServingState.SERVING, ServingState.NONCOMPLIANT})
"""States in which the alias names a version."""


@dataclass(frozen=True)
class DatasetState:
    """The ledger and aliases of one dataset (see the module docstring)."""

    dataset: str
    releases: tuple[CountedRelease, ...] = ()
    aliases: dict[str, AliasState] = field(default_factory=dict)
    siblings: tuple[CountedRelease, ...] = field(default=(), compare=False)
    """Releases counted in the other documents of the same source (read, never written here)."""

    @property
    def ledger(self) -> tuple[CountedRelease, ...]:
        """Every release of the data source: this document's and its siblings', once each."""
        own = {r.release_id for r in self.releases}
        return (*self.releases, *(r for r in self.siblings if r.release_id not in own))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "dataset": self.dataset,
            "releases": [r.to_dict() for r in self.releases],
            "aliases": {k: a.to_dict() for k, a in sorted(self.aliases.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> DatasetState:
        try:
            if data.get("schema") != SCHEMA:
                raise ValueError(f"schema {data.get('schema')!r}")
            releases = tuple(CountedRelease.from_dict(r) for r in data["releases"])
            aliases = {str(k): AliasState.from_dict(v) for k, v in data["aliases"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise StateIntegrityError(
                f"state object {where} cannot be read ({shorten(str(error))}); restore it with "
                "`dpmerge state restore`"
            ) from None
        return cls(str(data["dataset"]), releases, aliases)

    def entry(self, release_id: str) -> CountedRelease | None:
        return next((r for r in self.releases if r.release_id == release_id), None)

    def alias(self, model: str, alias: str) -> AliasState | None:
        return self.aliases.get(alias_key(model, alias))

    def cumulative(self, delta: float, extra: CountedRelease | None = None) -> PairBound:
        """The source ledger's bound at ``delta``: the joint release of the union of every
        counted release's candidates, in any document of the source (with ``extra`` added),
        docs/design.md#release-ledger."""
        from dpmerge.accounting.ledger import cumulative_bound

        return cumulative_bound([e.release() for e in self._with(extra)], delta)

    def _with(self, extra: CountedRelease | None) -> list[CountedRelease]:
        """The source ledger's entries with ``extra`` counted: added, or joined to the entry of
        its release (:meth:`CountedRelease.joined`)."""
        entries = list(self.ledger)
        if extra is None:
            return entries
        at = next((i for i, e in enumerate(entries) if e.release_id == extra.release_id), None)
        if at is None:
            return [*entries, extra]
        entries[at] = entries[at].joined(extra)
        return entries

    def statement(self, delta: float, extra: CountedRelease | None = None) -> LedgerStatement:
        """The source ledger's statement per split at ``delta`` (with ``extra`` counted): the
        training rows' bound (:meth:`cumulative`), the test rows' (every release's recorded
        evaluation ε summed) and one person's (the two's largest where every release and every
        candidate used one dataset identifier, else their sum), docs/design.md#release-ledger."""
        from dpmerge.accounting.ledger import (
            LedgerStatement,
            evaluation_bound,
            person_bound,
            sum_up,
        )

        entries = self._with(extra)
        training = self.cumulative(delta, extra)
        test = evaluation_bound({e.release_id: e.evaluation for e in entries})
        datasets = {e.dataset for e in entries} | {
            c.dataset for e in entries for c in e.release().candidates
        }
        one_split = len(datasets) <= 1
        validation = sum_up([s.epsilon for e in entries for s in e.selections])
        person = person_bound(training, test, one_split, validation)
        return LedgerStatement(training, test, person, validation)

    def cap_refusal(self, entry: CountedRelease, cap: float) -> str | None:
        """Why ``cap`` refuses the ledger with ``entry`` counted (``None``: it does not). The
        cap bounds every person of the source (docs/design.md#release-ledger): the training
        rows' cumulative ε and one person's ε (training, test and validation rows composed);
        where the test rows are not bounded (a release without a recorded estimate) no cap can
        hold."""
        statement = self.statement(entry.delta, entry)
        training, person = statement.training, statement.person
        where = f"δ = {entry.delta:g}, {training.accountant}"
        if training.epsilon > cap:
            return (
                f"release ledger: the cumulative ε with this release is "
                f"{epsilon_text(training.epsilon)} ({where}), above the cap {cap:g}"
            )
        if person.epsilon is None:
            unrecorded = statement.test.unrecorded
            return (
                f"release ledger: the cap {cap:g} cannot hold: the test rows' ε is not bounded "
                f"({len(unrecorded)} release(s) without a recorded estimate, e.g. "
                f"{unrecorded[0][:12]}…; `dpmerge ledger rebuild` restores what their records "
                "keep)"
            )
        if person.epsilon > cap:
            return (
                f"release ledger: one person's ε with this release is "
                f"{epsilon_text(person.epsilon)} ({where}; training, test and validation rows "
                f"composed {person.composition.value}), above the cap {cap:g}"
            )
        return None

    def with_entry(self, entry: CountedRelease, cap: float | None) -> DatasetState:
        """This state with ``entry`` counted (unchanged when it is already), after checking
        its records agree with those counted before, and that the cumulative bound with it
        stays within ``cap`` (:class:`RefusalError`; checked for a release counted before too:
        a cap refuses serving any release while the ledger is above it)."""
        check_records(self, entry)
        refusal = None if cap is None else self.cap_refusal(entry, cap)
        if refusal is not None:
            raise RefusalError(refusal)
        before = self.entry(entry.release_id)
        if before is None:
            return replace(self, releases=(*self.releases, replace(entry, counted_at=stamp())))
        joined = before.joined(entry)
        if joined == before:
            return self
        return replace(self, releases=tuple(joined if r is before else r for r in self.releases))


def check_records(state: DatasetState, entry: CountedRelease) -> None:
    """Refuse a candidate the ledger counted with another record (its registered record
    changed after it was released): the repair is to quarantine it."""
    counted: dict[str, tuple[dict[str, Any], str]] = {
        str(c["name"]): (c, r.release_id) for r in state.releases for c in r.candidates
    }
    for candidate in entry.candidates:
        name = str(candidate["name"])
        known = counted.get(name)
        if known is not None and known[0] != candidate:
            where = entry.versions.get(name, name)
            raise StateIntegrityError(
                f"candidate {name!r} ({where}) has another record than the one release "
                f"{known[1][:12]}… was counted with: its registered record changed after it was "
                f"released; take it out of use with `dpmerge registry quarantine "
                f"{where.replace(' v', ' ')}` and merge without it"
            )


def _read_own(store: StateStore, dataset: str) -> DatasetState:
    key = dataset_key(dataset)
    found = store.read_signed(key)
    if found is None:
        return DatasetState(dataset)
    state = DatasetState.from_dict(found.document, f"{store.where}/{key}")
    if state.dataset != dataset:
        raise StateIntegrityError(
            f"state object {store.where}/{key} belongs to {state.dataset!r}, not {dataset!r}"
        )
    return state


def _siblings(store: StateStore, dataset: str) -> tuple[CountedRelease, ...]:
    """The releases counted in the other documents of ``dataset``'s source."""
    source = source_of(dataset)
    others = [d for d in datasets(store) if d != dataset and source_of(d) == source]
    return tuple(r for d in sorted(others) for r in _read_own(store, d).releases)


def read_state(store: StateStore, dataset: str) -> DatasetState:
    """The dataset's state (empty when none was written), signature checked, with its source's
    other releases (:attr:`DatasetState.ledger`)."""
    return replace(_read_own(store, dataset), siblings=_siblings(store, dataset))


def sources(store: StateStore) -> dict[str, list[str]]:
    """Each data source with a state document, and its dataset identifiers."""
    found: dict[str, list[str]] = {}
    for dataset in sorted(datasets(store)):
        found.setdefault(source_of(dataset), []).append(dataset)
    return found


def _update(store: StateStore, dataset: str, change: Any) -> Any:
    """Apply ``change(state) -> (new state or None, result)`` by compare-and-swap. The source's
    other documents are read once, before: a release counted in one of them meanwhile is not
    seen by this write's cap check (it is by the next)."""
    key = dataset_key(dataset)
    siblings = _siblings(store, dataset)

    def apply(document: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
        state = replace(
            DatasetState(dataset)
            if document is None
            else DatasetState.from_dict(document, f"{store.where}/{key}"),
            siblings=siblings,
        )
        new, result = change(state)
        return (None if new is None else new.to_dict()), result

    return store.update(key, apply)


def _owned(state: DatasetState, model: str, alias: str, policy: str) -> AliasState:
    current = state.alias(model, alias)
    if current is not None and current.owner != policy:
        raise AliasOwnershipError(
            f"alias {shorten(alias)} of {model} belongs to policy {current.owner!r}; policy "
            f"{policy!r} may not change it (give the policy its own alias, e.g. 'policy-{policy}')"
        )
    return current or AliasState(model, alias, policy)


def _not_superseded(current: AliasState, policy_version: int) -> None:
    if current.policy_version > policy_version:
        raise SupersededError(current.policy_version)


def claim(store: StateStore, dataset: str, model: str, alias: str, policy: str) -> AliasState:
    """Make ``policy`` the owner of ``alias`` unless another policy owns it
    (:class:`AliasOwnershipError`); one compare-and-swap, so of two racing claims exactly one
    wins and the other is refused."""

    def change(state: DatasetState) -> tuple[DatasetState | None, AliasState]:
        current = _owned(state, model, alias, policy)
        if state.alias(model, alias) is not None:
            return None, current
        aliases = {**state.aliases, alias_key(model, alias): replace(current, since=stamp())}
        return replace(state, aliases=aliases), current

    return _update(store, dataset, change)


def count(store: StateStore, entry: CountedRelease, cap: float | None) -> PairBound:
    """Count ``entry`` in the ledger (idempotent), before anything of it is published; the
    cumulative bound with it (:class:`RefusalError` above ``cap``)."""
    dataset = entry.dataset

    def change(state: DatasetState) -> tuple[DatasetState | None, PairBound]:
        new = state.with_entry(entry, cap)
        return (None if new is state else new), new.cumulative(entry.delta)

    return _update(store, dataset, change)


@dataclass(frozen=True)
class Served:
    """What :func:`serve` did: the alias's state before and after, and the ledger bound."""

    before: AliasState
    after: AliasState
    cumulative: PairBound

    @property
    def changed(self) -> bool:
        return self.before.serving != self.after.serving


def serve(
    store: StateStore,
    entry: CountedRelease,
    *,
    model: str,
    alias: str,
    version: str,
    guarantee: Guarantee,
    cap: float | None,
    run: str | None,
) -> Served:
    """Count ``entry`` (if it is not yet) and point ``alias`` at its ``version`` — one
    compare-and-swap. Refused when another policy owns the alias, a later policy version
    already changed it (:class:`SupersededError`), or the cap refuses the release."""
    dataset = entry.dataset

    def change(state: DatasetState) -> tuple[DatasetState, Served]:
        current = _owned(state, model, alias, entry.policy)
        _not_superseded(current, entry.policy_version)
        counted = state.with_entry(entry, cap)
        same = current.serving == version and current.release == entry.release_id
        fields: dict[str, Any] = dict(
            state=ServingState.SERVING,
            release=entry.release_id,
            version=version,
            guarantee=guarantee,
            policy_version=entry.policy_version,
            run=run,
            reason="",
        )
        after = replace(current, **fields) if same else current.moved(**fields)
        aliases = {**counted.aliases, alias_key(model, alias): after}
        bound = counted.cumulative(entry.delta)
        return replace(counted, aliases=aliases), Served(current, after, bound)

    return _update(store, dataset, change)


def withdraw(
    store: StateStore,
    dataset: str,
    *,
    model: str,
    alias: str,
    policy: str,
    policy_version: int,
    state: ServingState,
    reason: str,
    run: str | None,
) -> tuple[AliasState, AliasState]:
    """Set ``alias`` to ``state`` (``revoked``: serves nothing; ``noncompliant``: keeps its
    version, flagged) for ``reason``; the alias's state before and after."""
    if state not in (ServingState.REVOKED, ServingState.NONCOMPLIANT):
        raise ValueError(f"withdraw to {state!r}")

    def change(current_state: DatasetState) -> tuple[DatasetState, tuple[AliasState, AliasState]]:
        current = _owned(current_state, model, alias, policy)
        _not_superseded(current, policy_version)
        fields: dict[str, Any] = dict(
            state=state, policy_version=policy_version, run=run, reason=reason
        )
        if state == ServingState.REVOKED:
            fields |= dict(version=None, release=None, guarantee=None)
        after = current.moved(**fields)
        aliases = {**current_state.aliases, alias_key(model, alias): after}
        return replace(current_state, aliases=aliases), (current, after)

    return _update(store, dataset, change)


def touch(
    store: StateStore, dataset: str, *, model: str, alias: str, policy: str, policy_version: int
) -> AliasState:
    """Record that ``policy_version`` re-checked the alias and left it as it is (so an older
    version's run cannot change it any more)."""

    def change(state: DatasetState) -> tuple[DatasetState | None, AliasState]:
        current = _owned(state, model, alias, policy)
        _not_superseded(current, policy_version)
        if current.policy_version == policy_version:
            return None, current
        after = replace(current, policy_version=policy_version)
        return replace(state, aliases={**state.aliases, alias_key(model, alias): after}), after

    return _update(store, dataset, change)


def datasets(store: StateStore) -> list[str]:
    """The datasets with a state document."""
    return [
        key.removeprefix("datasets/").removesuffix(".json").replace("=", ":")
        for key in store.keys("datasets/")
    ]


def attempts(state: DatasetState, policy: str, release_id: str) -> list[CountedRelease]:
    """Earlier releases evaluated for ``policy`` that no alias ever served (their evaluation
    was published when they were registered, so a release made after them is a selection among
    them: its card lists them)."""
    served = {a.release for a in state.aliases.values()} | {
        h.get("release") for a in state.aliases.values() for h in a.history
    }
    return [
        r
        for r in state.releases
        if r.policy == policy and r.release_id != release_id and r.release_id not in served
    ]


def every_alias(store: StateStore) -> list[AliasState]:
    """Every alias the store knows, over every dataset (signatures checked with the key)."""
    return [
        alias
        for dataset in datasets(store)
        for alias in read_state(store, dataset).aliases.values()
    ]
