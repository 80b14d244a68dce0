"""Policies as stored, versioned data (docs/design.md#release-state).

Every change of a policy is a new version, ``policies/<name>/<version>.json``, written
create-once: two writers racing for one version number cannot both win, the loser re-reads the
latest version and applies its change on top. A version holds the whole policy, who changed it,
where from, and the fields it changed. A *partial* change keeps every field it does not name.
Runs of a version record how they ended (``outcomes/…``), and the workflow records which flow
run a version became (``dispatch/…``): ``dpmerge policy history`` joins the three.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dpmerge.policies import NAME, Policy, PolicyError, policy_from_dict
from dpmerge.state.rejections import FieldError, exact_fields
from dpmerge.state.store import (
    MAX_WRITE_ATTEMPTS,
    StateConflictError,
    StateIntegrityError,
    StateStore,
    UnreadableObjectError,
    stamp,
)

SCHEMA = "dpmerge.policy-version/1"
ACTOR_ENV = "DPMERGE_ACTOR"
DIGITS = 8


def actor() -> str:
    """Who is changing a policy: ``$DPMERGE_ACTOR``, else ``user@host``."""
    return os.environ.get(ACTOR_ENV) or f"{getpass.getuser()}@{socket.gethostname()}"


PREFIX = "policies/"
FIELDS = ("schema", "name", "version", "policy", "created", "author", "source", "changes")
MAX_TEXT = 2000
_KEY = re.compile(rf"policies/({NAME})/([0-9]{{{DIGITS},12}})\.json")


def version_key(name: str, version: int) -> str:
    return f"{PREFIX}{name}/{version:0{DIGITS}d}.json"


@dataclass(frozen=True)
class PolicyVersion:
    """One stored version of a policy. ``changes`` maps each changed field to ``[old, new]``
    (every field of a new policy, with old ``None``)."""

    policy: Policy
    version: int
    created: str
    author: str
    source: str
    changes: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.policy.name

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "name": self.name,
            "version": self.version,
            "policy": self.policy.event_payload(),
            "created": self.created,
            "author": self.author,
            "source": self.source,
            "changes": self.changes,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], where: str, key: tuple[str, int] | None = None
    ) -> PolicyVersion:
        """A stored version, exactly as :meth:`to_dict` writes it (and, with ``key``, the
        version its key names); :class:`PolicyError` naming ``where`` and the field when it is
        not one."""
        try:
            return cls._strict(data, key)
        except FieldError as error:
            raise PolicyError(f"{where}: {error}", error.field) from None
        except PolicyError as error:
            raise PolicyError(f"{where}: {error}", f"policy.{error.field}") from None

    @classmethod
    def _strict(cls, data: Mapping[str, Any], key: tuple[str, int] | None) -> PolicyVersion:
        exact_fields(data, FIELDS)
        if data["schema"] != SCHEMA:
            raise FieldError("schema", f"must be {SCHEMA!r}")
        version = data["version"]
        if type(version) is not int or version < 1:
            raise FieldError("version", "must be a whole number ≥ 1")
        if key is not None and (data["name"], version) != key:
            field = "name" if data["name"] != key[0] else "version"
            raise FieldError(field, f"does not match its key (policy {key[0]} v{key[1]})")
        for name in ("name", "created", "author", "source"):
            if type(data[name]) is not str or len(data[name]) > MAX_TEXT:
                raise FieldError(name, f"must be a string of at most {MAX_TEXT} characters")
        changes = data["changes"]
        if not isinstance(changes, dict) or not all(
            isinstance(v, list) and len(v) == 2 for v in changes.values()
        ):
            raise FieldError("changes", "must map each changed field to [old, new]")
        if not isinstance(data["policy"], dict):
            raise FieldError("policy", "must be an object")
        policy = policy_from_dict(data["policy"])
        if policy.name != data["name"]:
            raise FieldError("name", f"names policy {data['name']!r} but holds {policy.name!r}")
        return cls(
            policy=policy,
            version=version,
            created=data["created"],
            author=data["author"],
            source=data["source"],
            changes=dict(changes),
        )


# --- keys: policies/<name>/<version>.json ---------------------------------------------------


def parse_key(key: str) -> tuple[str, int] | None:
    """``(name, version)`` of a policy version key of the right shape (``None``: another
    shape, e.g. a name no policy can have, a version of other digits, a folder deeper)."""
    match = _KEY.fullmatch(key)
    if match is None or int(match[2]) < 1 or key != version_key(match[1], int(match[2])):
        return None
    return match[1], int(match[2])


def stored_keys(store: StateStore, name: str | None = None) -> list[tuple[str, int]]:
    """``(name, version)`` of every key of the right shape (of policy ``name``, if given),
    by name and version number; keys of another shape are left out (see
    :func:`malformed_keys`)."""
    prefix = f"{PREFIX}{name}/" if name is not None else PREFIX
    found = [parsed for key in store.keys(prefix) if (parsed := parse_key(key))]
    return sorted(p for p in found if name is None or p[0] == name)


def malformed_keys(store: StateStore) -> list[str]:
    """The keys under ``policies/`` of another shape: nothing reads them as a version."""
    return [key for key in store.keys(PREFIX) if parse_key(key) is None]


def policy_names(store: StateStore) -> list[str]:
    return sorted(newest_numbers(store))


def read_version(store: StateStore, name: str, version: int) -> PolicyVersion | None:
    """Version ``version`` of ``name`` (``None``: not stored); :class:`PolicyError` naming the
    key and the field when what is stored there is not a valid policy version (an unreadable
    body, within the store's caps, is field ``body``)."""
    key = version_key(name, version)
    where = f"{store.where}/{key}"
    try:
        found = store.read(key)
    except UnreadableObjectError as error:
        raise PolicyError(f"{where}: field 'body': {error.reason}", "body") from None
    if found is None:
        return None
    return PolicyVersion.from_dict(found.document, where, (name, version))


def versions(store: StateStore, name: str) -> list[PolicyVersion | PolicyError]:
    """Every stored version of policy ``name``, oldest first; one that is not a valid policy
    version (written into the store by hand) appears as the error saying why."""
    found: list[PolicyVersion | PolicyError] = []
    for _, number in stored_keys(store, name):
        try:
            version = read_version(store, name, number)
        except PolicyError as error:
            found.append(error)
            continue
        if version is not None:
            found.append(version)
    return found


def latest(store: StateStore, name: str) -> PolicyVersion | None:
    """The newest *valid* version of ``name`` (``None``: no such policy). A version that is
    not valid never supersedes one that is: its own run is rejected."""
    for _, number in reversed(stored_keys(store, name)):
        try:
            version = read_version(store, name, number)
        except PolicyError:
            continue
        if version is not None:
            return version
    return None


def newest_numbers(store: StateStore) -> dict[str, int]:
    """The highest version number stored for each policy, valid or not (one listing)."""
    found: dict[str, int] = {}
    for name, number in stored_keys(store):
        found[name] = max(found.get(name, 0), number)
    return found


def newest_number(store: StateStore, name: str) -> int:
    """The highest version number stored for ``name``, valid or not (0: none)."""
    keys = stored_keys(store, name)
    return keys[-1][1] if keys else 0


def changed_fields(old: Policy | None, new: Policy) -> dict[str, list[Any]]:
    """Each field whose value differs, ``[old, new]`` (as stored: JSON values)."""
    before = old.event_payload() if old is not None else {}
    after = new.event_payload()
    return {k: [before.get(k), v] for k, v in after.items() if before.get(k) != v}


def merged(current: PolicyVersion | None, given: Mapping[str, Any]) -> Policy:
    """The policy ``given`` describes on top of ``current``: fields it does not name keep their
    stored values (a field given as ``None`` goes back to its default); a new policy needs
    every required field (:class:`PolicyError`)."""
    base = current.policy.event_payload() if current is not None else {}
    return policy_from_dict({**base, **given})


@dataclass(frozen=True)
class Change:
    """What :func:`set_policy` did: the version now current, and whether this call wrote it."""

    version: PolicyVersion
    written: bool


def set_policy(
    store: StateStore,
    name: str,
    given: Mapping[str, Any],
    *,
    source: str,
    rerun: bool = False,
    author: str | None = None,
) -> Change:
    """Store a new version of policy ``name`` with the fields ``given`` changed (a partial
    change; see :func:`merged`). Nothing is written when nothing changes, unless ``rerun``
    (a new version with the same fields: the workflow applies it again). A stored policy's
    alias never changes (:class:`PolicyError`): the alias it left would keep serving what it
    served last, owned by a policy that no longer moves it (docs/design.md#release-state).
    ``author``: who asked (default :func:`actor`, this process's user)."""
    for _ in range(MAX_WRITE_ATTEMPTS):
        current = latest(store, name)
        policy = merged(current, {**given, "name": name})
        changes = changed_fields(current.policy if current else None, policy)
        if current is not None and "alias" in changes:
            old, new = changes["alias"]
            raise PolicyError(
                f"policy {name}: its alias is {old!r} and cannot become {new!r} (the old alias "
                "would keep serving, moved by no policy); set a new policy for another alias"
            )
        if current is not None and not changes and not rerun:
            return Change(current, written=False)
        number = newest_number(store, name) + 1
        version = PolicyVersion(policy, number, stamp(), author or actor(), source, changes)
        if store.create(version_key(name, number), version.to_dict()):
            return Change(version, written=True)
    raise StateConflictError(f"policy {name}: {MAX_WRITE_ATTEMPTS} concurrent changes in a row")


# --- how versions ended, and the runs they became -----------------------------------------


def record_outcome(
    store: StateStore, name: str, version: int, outcome: Mapping[str, Any], run: str | None
) -> None:
    """Keep how one run of a policy version ended (create-once, one object per run)."""
    moment = stamp()
    key = f"outcomes/{name}/{version:0{DIGITS}d}/{moment.replace(':', '')}-{run or 'local'}.json"
    store.create(key, {"policy": name, "version": version, "run": run, "at": moment, **outcome})


def outcomes(store: StateStore, name: str, version: int) -> list[dict[str, Any]]:
    """The recorded outcomes of one version, oldest first."""
    found = []
    for key in store.keys(f"outcomes/{name}/{version:0{DIGITS}d}/"):
        try:
            document = store.read(key)
        except StateIntegrityError as error:  # the workflow writes these; shown, not raised
            found.append({"status": "unreadable", "reasons": [str(error)]})
            continue
        if document is not None:
            found.append(document.document)
    return found


def dispatch_key(name: str, version: int) -> str:
    return f"dispatch/{name}/{version:0{DIGITS}d}.json"


def record_dispatch(store: StateStore, name: str, version: int, run: Mapping[str, Any]) -> bool:
    """Record the flow run a version became (create-once); whether this call recorded it."""
    return store.create(dispatch_key(name, version), {"policy": name, "version": version, **run})


def dispatched(store: StateStore, name: str, version: int) -> dict[str, Any] | None:
    found = store.read(dispatch_key(name, version))
    return None if found is None else found.document
