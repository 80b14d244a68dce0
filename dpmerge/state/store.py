"""The release-state store's core: JSON objects under a key layout, written create-once or by
compare-and-swap, and signed where a gate trusts them (docs/design.md#release-state).

The key layout (one prefix per kind of fact, so storage permissions can differ per prefix):

* ``inbox/policies/<name>/<id>.json``, ``inbox/quarantine/<model>/<version>.json`` — operators'
  requests (create-once; operators), and ``requests/<sha-256 of the key>.json`` — how the
  workflow handled each (create-once; the workflow; :mod:`dpmerge.state.inbox`);
* ``policies/<name>/<version>.json`` — a policy version (create-once; the workflow, from
  requests; embedded, ``policy set``);
* ``outcomes/<name>/<version>/<stamp>.json`` — how a run of that version ended (create-once;
  the workflow);
* ``dispatch/<name>/<version>.json`` — the flow run a version became (create-once; the
  workflow);
* ``datasets/<dataset id>.json`` — the ledger and every alias's owner and serving pointer
  (compare-and-swap, signed; the workflow);
* ``quarantine/<model>/<version>.json`` — a version taken out of use (create-once; the
  workflow, from requests);
* ``rejected/<sha-256 of the key>.json`` — an object of the canonical tree that is not what its
  key says (create-once; the workflow; :mod:`dpmerge.state.rejections`);
* ``leases/<policy>.json`` — which run works on a policy, until when (compare-and-swap; the
  workflow).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from dpmerge.documents import unique_keys
from dpmerge.errors import IntegrityError
from dpmerge.keys import WorkflowKey
from dpmerge.state.backend import (
    MAX_OBJECT_BYTES,
    Backend,
    ObjectChangedError,
    ObjectExistsError,
)
from dpmerge.vocabulary import KeyPurpose

T = TypeVar("T")
MAX_WRITE_ATTEMPTS = 30
SIGNATURE = "signature"
MAX_OPERATOR_BYTES = 64 * 2**10
"""Largest object read where operators' requests and what they become live (``inbox/``,
``policies/``, ``quarantine/``): a policy version is under 2 kB."""
OPERATOR_PREFIXES = ("inbox/", "policies/", "quarantine/")
MAX_DEPTH = 32
"""Deepest nesting of arrays and objects read (a state document nests under 8): deeper input
is refused before it is parsed, so no reader meets a ``RecursionError``."""
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class StateIntegrityError(IntegrityError):
    """A state object is unreadable or its signature does not verify; the message names the
    repair (docs/design.md#release-state)."""


class UnreadableObjectError(StateIntegrityError):
    """A state object is no JSON object within the caps; ``reason`` says why, alone."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class StateConflictError(IntegrityError):
    """A compare-and-swap lost to other writers too many times in a row."""


def now() -> datetime:
    return datetime.now(UTC)


def stamp(moment: datetime | None = None) -> str:
    """An ISO 8601 UTC time as stored."""
    return (moment or now()).astimezone(UTC).isoformat()


class UnreadableError(ValueError):
    """Why bytes are not a state document (:func:`parse_document`)."""


def nesting(text: str) -> int:
    """How deep arrays and objects nest in JSON ``text`` (strings skipped), without parsing
    it: bounded time and stack, whatever the input."""
    depth = deepest = 0
    for step in map(_STEP.__getitem__, _NOT_BRACKET.sub("", _STRING.sub("", text))):
        depth += step
        deepest = max(deepest, depth)
    return deepest


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_document(data: bytes, limit: int = MAX_OBJECT_BYTES) -> dict[str, Any]:
    """A JSON object from untrusted ``data``: at most ``limit`` bytes, UTF-8, nested at most
    :data:`MAX_DEPTH` deep, no key twice, no NaN or Infinity; else :class:`UnreadableError`
    saying why (docs/design.md#release-state)."""
    if len(data) > limit:
        raise UnreadableError(f"larger than {limit:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UnreadableError("not UTF-8") from None
    depth = nesting(text)
    if depth > MAX_DEPTH:
        raise UnreadableError(f"nested {depth} deep (at most {MAX_DEPTH})")
    try:
        document = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_constant)
    except ValueError as error:  # JSONDecodeError, a key twice, NaN, an overlong integer
        raise UnreadableError(f"not valid JSON: {str(error)[:200]}") from None
    if not isinstance(document, dict):
        raise UnreadableError(f"a JSON {type(document).__name__}, not an object")
    return document


def limit_for(key: str) -> int:
    """The size cap of the object at ``key`` (tighter where operators write)."""
    return MAX_OPERATOR_BYTES if key.startswith(OPERATOR_PREFIXES) else MAX_OBJECT_BYTES


def canonical(document: Any) -> bytes:
    """The bytes a signature covers: sorted keys, no whitespace, UTF-8."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def encode(document: Any) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


@dataclass(frozen=True)
class Found:
    """A JSON document and the tag a compare-and-swap of it must name."""

    document: dict[str, Any]
    tag: str


class StateStore:
    """JSON objects of the release-state store on a :class:`Backend`. ``keys`` is the
    workflow's key (``key``), needed to sign and verify the documents a gate trusts (the dataset
    documents); readers without it (operators) get the documents unverified."""

    def __init__(self, backend: Backend, key: WorkflowKey | None = None) -> None:
        self.backend = backend
        self.key = key

    @property
    def where(self) -> str:
        return self.backend.where

    # --- plain objects -------------------------------------------------------------------

    def read(self, key: str) -> Found | None:
        """The document at ``key``; :class:`StateIntegrityError` when it is not a JSON object."""
        stored = self.backend.read(key)
        if stored is None:
            return None
        return Found(self._parse(key, stored.data), stored.tag)

    def _parse(self, key: str, data: bytes) -> dict[str, Any]:
        try:
            return parse_document(data, limit_for(key))
        except UnreadableError as error:
            raise UnreadableObjectError(
                f"state object {self.where}/{key} cannot be read ({error}); restore it from "
                "its earlier versions: `dpmerge state restore`",
                str(error),
            ) from None

    def create(self, key: str, document: dict[str, Any]) -> bool:
        """Write ``document`` at ``key`` unless something is there; whether this call wrote."""
        try:
            self.backend.create(key, encode(document))
        except ObjectExistsError:
            return False
        return True

    def keys(self, prefix: str) -> list[str]:
        return self.backend.keys(prefix)

    # --- signed documents ----------------------------------------------------------------

    def _key(self, purpose: str) -> WorkflowKey:
        if self.key is None:
            raise StateIntegrityError(
                f"writing {purpose} needs the workflow's key (the workflow role holds it)"
            )
        return self.key

    def sign(self, document: dict[str, Any]) -> dict[str, Any]:
        """``document`` with its signature: an HMAC under the workflow key's state purpose."""
        body = {k: v for k, v in document.items() if k != SIGNATURE}
        tag = self._key("a signed state document").mac(KeyPurpose.STATE_DOCUMENT, canonical(body))
        return {**body, SIGNATURE: tag}

    def verified(self, key: str, document: dict[str, Any]) -> dict[str, Any]:
        """``document`` after checking its signature (unchecked without the key)."""
        if self.key is None:
            return document
        body = {k: v for k, v in document.items() if k != SIGNATURE}
        if not self.key.verify(KeyPurpose.STATE_DOCUMENT, canonical(body), document.get(SIGNATURE)):
            raise StateIntegrityError(
                f"state object {self.where}/{key} does not match its signature: it was changed "
                "outside the workflow; restore its newest signed version with `dpmerge state "
                "restore` (the ledger and serving pointers must not be trusted as they are)"
            )
        return document

    def read_signed(self, key: str) -> Found | None:
        found = self.read(key)
        return None if found is None else Found(self.verified(key, found.document), found.tag)

    def update(
        self,
        key: str,
        change: Callable[[dict[str, Any] | None], tuple[dict[str, Any] | None, T]],
        *,
        signed: bool = True,
    ) -> T:
        """Read the document at ``key`` (its signature checked when ``signed``), let ``change``
        return ``(new document or None for no write, result)``, write it (signed) by
        compare-and-swap, and on a conflict apply ``change`` again to what the other writer
        left. Returns ``change``'s result."""
        for _ in range(MAX_WRITE_ATTEMPTS):
            found = self.read_signed(key) if signed else self.read(key)
            document, result = change(found.document if found else None)
            if document is None:
                return result
            data = encode(self.sign(document) if signed else document)
            try:
                if found is None:
                    self.backend.create(key, data)
                else:
                    self.backend.replace(key, data, found.tag)
            except (ObjectChangedError, ObjectExistsError):
                continue
            return result
        raise StateConflictError(
            f"state object {self.where}/{key}: {MAX_WRITE_ATTEMPTS} conflicting writes in a "
            "row; try again"
        )

    def restore(self, key: str) -> int | None:
        """Make the newest earlier content of ``key`` whose signature verifies current again;
        how many newer contents were skipped (``None``: no good version, nothing changed; 0:
        the current one is good)."""
        for skipped, data in enumerate(self.backend.history(key)):
            try:
                document = self.verified(key, self._parse(key, data))
            except StateIntegrityError:
                continue
            if skipped:
                current = self.backend.read(key)
                if current is None:
                    self.backend.create(key, data)
                else:
                    self.backend.replace(key, encode(document), current.tag)
            return skipped
        return None
