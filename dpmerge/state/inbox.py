"""Operators' writes are requests, never state (docs/design.md#release-state).

On a stack operators write only under ``inbox/`` of the state bucket (devstack/roles.py), each
request once (create-once; a random id):

* ``inbox/policies/<name>/<request id>.json`` — a change of policy ``<name>``: the fields given
  and whether to apply it again (:func:`submit_policy`);
* ``inbox/quarantine/<model>/<version>.json`` — take a version out of use
  (:func:`submit_quarantine`).

The workflow's dispatcher reads each as untrusted input — the store's size and depth caps, the
key's shape, a strict schema, the policy's own validation — and records it in the canonical
tree, which only the workflow writes: the next policy version (``policies/…``), a quarantine
record (``quarantine/…``), or a rejection naming the key and the field. How each request was
handled is recorded once, under ``requests/<sha-256 of the key>.json``, where the operator's
command waits for it. Deleting or rewriting a request afterwards undoes nothing.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from dpmerge.errors import OutageError
from dpmerge.policies import NAME, PolicyError
from dpmerge.state import policies as stored_policies
from dpmerge.state import quarantine as stored_quarantine
from dpmerge.state.rejections import FieldError, Rejection, digest, exact_fields, shown_key
from dpmerge.state.store import StateStore, UnreadableObjectError, now, stamp

PREFIX = "inbox/"
POLICIES = f"{PREFIX}policies/"
QUARANTINE = f"{PREFIX}quarantine/"
HANDLED = "requests/"
SCHEMA = "dpmerge.policy-request/1"
FIELDS = ("schema", "name", "fields", "rerun", "author", "source", "created")
MAX_TEXT = 1000
"""Longest author, source or time a request gives (its version's source adds the request id;
a stored version holds at most 2,000 characters each)."""
_ID = r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{16}"
_POLICY_KEY = re.compile(rf"{POLICIES}({NAME})/({_ID})\.json")
WAIT_S = 60.0
POLL_S = 0.5


class RequestWaitError(OutageError):
    """The workflow did not handle a request in time (is the dispatcher running?)."""


def handled_key(key: str) -> str:
    return f"{HANDLED}{digest(key)}.json"


def submit_policy(
    store: StateStore, name: str, fields: dict[str, Any], *, source: str, rerun: bool
) -> str:
    """Write a request to change policy ``name`` (create-once); its key."""
    document = {
        "schema": SCHEMA,
        "name": name,
        "fields": fields,
        "rerun": rerun,
        "author": stored_policies.actor()[:MAX_TEXT],
        "source": source[:MAX_TEXT],
        "created": stamp(),
    }
    while True:
        request = f"{now():%Y%m%dT%H%M%SZ}-{secrets.token_hex(8)}"
        key = f"{POLICIES}{name}/{request}.json"
        if store.create(key, document):
            return key


def submit_quarantine(store: StateStore, model: str, version: str, reason: str) -> str:
    """Write a request to quarantine ``model`` ``version`` (create-once: the first stays)."""
    record = stored_quarantine.Quarantine(
        model, str(int(version)), reason, stored_policies.actor(), stamp()
    )
    key = f"{PREFIX}{stored_quarantine.key_of(model, version)}"
    store.create(key, record.__dict__)
    return key


def handled(store: StateStore, key: str) -> dict[str, Any] | None:
    found = store.read(handled_key(key))
    return None if found is None else found.document


def wait(store: StateStore, key: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
    """How the workflow handled request ``key``; :class:`RequestWaitError` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = handled(store, key)
        if found is not None:
            return found
        time.sleep(POLL_S)
    raise RequestWaitError(
        f"request {key} is stored in {store.where}, but the workflow did not handle it within "
        f"{timeout_s:g} s: is the workflow's dispatcher running? (`dpmerge stack status`)"
    )


def pending(store: StateStore) -> list[str]:
    """The requests not handled yet (two listings), oldest first within a policy."""
    done = set(store.keys(HANDLED))
    return [key for key in store.keys(PREFIX) if handled_key(key) not in done]


def rejected(store: StateStore) -> list[dict[str, Any]]:
    """The rejections of every request handled so far (``requests/`` is the workflow's)."""
    found = []
    for key in store.keys(HANDLED):
        document = store.read(key)
        if document is not None and document.document.get("status") == "rejected":
            found.append(document.document.get("rejected") or {})
    return found


@dataclass(frozen=True)
class Handled:
    """What became of one request: ``status`` ``applied``, ``unchanged`` or ``rejected``."""

    key: str
    status: str
    version: int | None = None
    rejection: Rejection | None = None

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "key": shown_key(self.key),
            "status": self.status,
            "at": stamp(),
        }
        if self.version is not None:
            document["version"] = self.version
        if self.rejection is not None:
            document["rejected"] = self.rejection.to_dict()
        return document


def handle(store: StateStore, key: str) -> Handled:
    """Record request ``key`` in the canonical tree (see the module docstring) and how it was
    handled; a rejection changes nothing else."""
    try:
        result = _apply(store, key)
    except FieldError as error:
        result = Handled(key, "rejected", rejection=Rejection(key, error.field, error.reason))
    store.create(handled_key(key), result.to_dict())
    return result


def _read(store: StateStore, key: str) -> dict[str, Any]:
    try:
        found = store.read(key)
    except UnreadableObjectError as error:
        raise FieldError("body", error.reason) from None
    if found is None:
        raise FieldError("key", "deleted before it was read")
    return found.document


def _apply(store: StateStore, key: str) -> Handled:
    if key.startswith(QUARANTINE):
        return _quarantine(store, key)
    match = _POLICY_KEY.fullmatch(key)
    if match is None:
        raise FieldError(
            "key", f"not {POLICIES}<name>/<request id>.json or {QUARANTINE}<model>/<version>.json"
        )
    name, request = match[1], match[2]
    document = _read(store, key)
    exact_fields(document, FIELDS)
    if document["schema"] != SCHEMA:
        raise FieldError("schema", f"must be {SCHEMA!r}")
    if document["name"] != name:
        raise FieldError("name", f"does not match its key (policy {name})")
    if not isinstance(document["fields"], dict):
        raise FieldError("fields", "must be an object")
    if type(document["rerun"]) is not bool:
        raise FieldError("rerun", "must be true or false")
    for field in ("author", "source", "created"):
        if type(document[field]) is not str or len(document[field]) > MAX_TEXT:
            raise FieldError(field, f"must be a string of at most {MAX_TEXT} characters")
    source = f"{document['source']} (request {request})"
    current = stored_policies.latest(store, name)
    if current is not None and current.source == source:  # recorded before a crash
        return Handled(key, "applied", current.version)
    try:
        change = stored_policies.set_policy(
            store,
            name,
            document["fields"],
            source=source,
            rerun=document["rerun"],
            author=document["author"],
        )
    except PolicyError as error:
        raise FieldError(f"fields.{error.field or 'policy'}", str(error)) from None
    return Handled(key, "applied" if change.written else "unchanged", change.version.version)


def _quarantine(store: StateStore, key: str) -> Handled:
    parsed = stored_quarantine.parse_key(key.removeprefix(PREFIX))
    if parsed is None:
        raise FieldError("key", f"not {QUARANTINE}<model>/<version>.json")
    record = stored_quarantine.record_of(*parsed, _read(store, key))
    stored_quarantine.record(store, record)
    return Handled(key, "applied", int(record.version))
