"""The release-state store's core: JSON objects under a key layout, written create-once or by
compare-and-swap, and signed where a gate trusts them (docs/design.md#release-state).

The key layout (one prefix per kind of fact, so storage permissions can differ per prefix):

* ``policies/<name>/<version>.json`` — a policy version (create-once; operators);
* ``outcomes/<name>/<version>/<stamp>.json`` — how a run of that version ended (create-once;
  the workflow);
* ``dispatch/<name>/<version>.json`` — the flow run a version became (create-once; the
  workflow);
* ``datasets/<dataset id>.json`` — the ledger and every alias's owner and serving pointer
  (compare-and-swap, signed; the workflow);
* ``quarantine/<model>/<version>.json`` — a version taken out of use (create-once; operators
  and the workflow);
* ``leases/<policy>.json`` — which run works on a policy, until when (compare-and-swap; the
  workflow).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from dpmerge.errors import IntegrityError
from dpmerge.keys import WorkflowKey
from dpmerge.state.backend import Backend, ObjectChangedError, ObjectExistsError
from dpmerge.vocabulary import KeyPurpose

T = TypeVar("T")
MAX_WRITE_ATTEMPTS = 30
SIGNATURE = "signature"


class StateIntegrityError(IntegrityError):
    """A state object is unreadable or its signature does not verify; the message names the
    repair (docs/design.md#release-state)."""


class StateConflictError(IntegrityError):
    """A compare-and-swap lost to other writers too many times in a row."""


def now() -> datetime:
    return datetime.now(UTC)


def stamp(moment: datetime | None = None) -> str:
    """An ISO 8601 UTC time as stored."""
    return (moment or now()).astimezone(UTC).isoformat()


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
            document = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise StateIntegrityError(
                f"state object {self.where}/{key} cannot be read ({error}); restore it from "
                "its earlier versions: `dpmerge state restore`"
            ) from None
        if not isinstance(document, dict):
            raise StateIntegrityError(f"state object {self.where}/{key} is not a JSON object")
        return document

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
