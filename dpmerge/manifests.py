"""Signed releases a consumer can verify (docs/design.md#security).

Every registered release carries a **manifest** — its registered model, logged model, release
hash, the facts a gate trusts (the ``dp.*`` tags: ε, δ, bound, accuracy, …), the digest of its
privacy card, and the SHA-256 of every file of its MLflow model (the pt2 program, the weights,
``MLmodel``, …) — signed with **Ed25519**. The signing key is derived from the workflow's secret
key (a sub-key per purpose, :class:`~dpmerge.vocabulary.KeyPurpose`), so nothing new has to be
distributed to workers; its public key is published (``dpmerge stack env --role consumer``
prints it, and every release names its fingerprint), so anyone can check a release without
being able to make one:

* the workflow reuses or serves only releases whose manifest verifies, whose tags equal the
  signed facts, and whose files — read from the logged model the manifest names — are the
  signed ones (a version planted under a release hash, a tag changed afterwards, a signed
  release's tags copied onto other files, or swapped weights fail);
* ``dpmerge registry verify`` checks the files of every served release against the manifest;
* a consumer runs ``dpmerge verify models:/<releases>@<alias>`` (or
  :func:`dpmerge.registry.Registry.load_verified`) before serving: swapped weights are refused.

Ed25519 rather than the workflow's HMAC: verifying needs only the public key, so consumers and
operators can check releases they cannot forge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from dpmerge.errors import InputError, IntegrityError
from dpmerge.keys import WorkflowKey
from dpmerge.vocabulary import KeyPurpose

SCHEMA = "dpmerge.release-manifest/1"
PUBLIC_KEY_ENV = "DPMERGE_RELEASE_PUBLIC_KEY"
MLFLOW_BOOKKEEPING = frozenset({"registered_model_meta"})
"""Files MLflow adds to a model's directory when a version is created (metadata it never
loads); everything else of the model is signed."""


class ReleaseSignatureError(IntegrityError):
    """A release's manifest does not verify, or its files or tags differ from what was signed."""


def signing_key(key: WorkflowKey) -> Ed25519PrivateKey:
    """The workflow's Ed25519 release-signing key (derived from its secret key)."""
    seed = bytes.fromhex(key.mac(KeyPurpose.RELEASE_SIGNING, b"ed25519-seed"))
    return Ed25519PrivateKey.from_private_bytes(seed)


def public_key_hex(key: WorkflowKey) -> str:
    """The public half of :func:`signing_key`, hexadecimal (what consumers are given)."""
    public = signing_key(key).public_key()
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def fingerprint(public_hex: str) -> str:
    """A short public name of a release-signing public key."""
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:12]


def configured_public_key() -> str:
    """``$DPMERGE_RELEASE_PUBLIC_KEY``; :class:`InputError` when it is not set or malformed."""
    value = os.environ.get(PUBLIC_KEY_ENV, "").strip()
    if not value:
        raise InputError(
            f"no release public key: set {PUBLIC_KEY_ENV} (`dpmerge stack env --role consumer` "
            "prints it) or pass --public-key"
        )
    return checked_public_key(value)


def checked_public_key(value: str) -> str:
    """``value`` if it is an Ed25519 public key in hexadecimal; :class:`InputError` if not."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(value))
    except ValueError:
        raise InputError(
            f"not an Ed25519 public key (64 hexadecimal digits): {value[:80]!r}"
        ) from None
    return value


def canonical(document: Any) -> bytes:
    """``document`` as the canonical JSON every signed digest hashes."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), default=str).encode()


def card_digest(description: str, card: Any) -> str:
    """The digest a release's manifest signs of its privacy card: the Markdown shown as the
    version's description and the card's JSON (an edited card no longer matches)."""
    digest = hashlib.sha256(description.encode())
    digest.update(b"\0" + canonical(card))
    return digest.hexdigest()


def file_digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by path relative to it (``/`` separators)."""
    digests = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digests[path.relative_to(root).as_posix()] = digest.hexdigest()
    return digests


@dataclass(frozen=True)
class Manifest:
    """What a release's signature covers (see the module docstring)."""

    model: str
    logged_model: str
    release: str
    facts: dict[str, str]
    files: dict[str, str]
    card_digest: str
    key: str = ""  # the signing public key's fingerprint

    def document(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "logged_model": self.logged_model,
            "release": self.release,
            "facts": dict(sorted(self.facts.items())),
            "files": dict(sorted(self.files.items())),
            "card_digest": self.card_digest,
            "key": self.key,
        }

    def text(self) -> str:
        """The canonical JSON that is signed and stored (one line)."""
        return json.dumps(self.document(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
            if data.get("schema") != SCHEMA:
                raise ValueError("not a release manifest")
            return cls(
                model=str(data["model"]),
                logged_model=str(data["logged_model"]),
                release=str(data["release"]),
                facts={str(k): str(v) for k, v in data["facts"].items()},
                files={str(k): str(v) for k, v in data["files"].items()},
                card_digest=str(data["card_digest"]),
                key=str(data.get("key", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ReleaseSignatureError(f"the release manifest cannot be read ({error})") from None


def sign_text(text: str, key: WorkflowKey) -> str:
    """The Ed25519 signature (hex) of ``text`` under the release-signing key: every signed
    document (a manifest, a serving statement) is a JSON text naming its own schema, so one
    kind of document never reads as another."""
    return signing_key(key).sign(text.encode()).hex()


def signed_by(text: str, signature: str, public_hex: str) -> bool:
    """Whether ``signature`` (hex) is the Ed25519 signature of ``text`` under ``public_hex``."""
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(checked_public_key(public_hex))).verify(
            bytes.fromhex(signature), text.encode()
        )
    except (InvalidSignature, ValueError):
        return False
    return True


def sign(manifest: Manifest, key: WorkflowKey) -> tuple[str, str]:
    """The manifest's text (naming the signing key) and its Ed25519 signature (hex)."""
    named = Manifest(**{**manifest.__dict__, "key": fingerprint(public_key_hex(key))})
    text = named.text()
    return text, sign_text(text, key)


def verify(text: str | None, signature: str | None, public_hex: str) -> Manifest:
    """The manifest ``text`` if ``signature`` is its Ed25519 signature under ``public_hex``;
    :class:`ReleaseSignatureError` otherwise (unsigned, another key, changed)."""
    if not text or not signature:
        raise ReleaseSignatureError("the release is unsigned")
    if not signed_by(text, signature, public_hex):
        manifest_key = ""
        with contextlib.suppress(ReleaseSignatureError):
            manifest_key = Manifest.parse(text).key
        raise ReleaseSignatureError(
            f"the release's signature does not verify under key {fingerprint(public_hex)} "
            f"(the manifest names key {manifest_key or '?'}): it was changed or not made by "
            "the workflow"
        ) from None
    return Manifest.parse(text)


def check_files(manifest: Manifest, root: Path) -> None:
    """The files under ``root`` (a downloaded MLflow model) are exactly the signed ones."""
    found = {k: v for k, v in file_digests(root).items() if k not in MLFLOW_BOOKKEEPING}
    if found == manifest.files:
        return
    changed = sorted(
        k for k in found.keys() & manifest.files.keys() if found[k] != manifest.files[k]
    )
    missing = sorted(manifest.files.keys() - found.keys())
    added = sorted(found.keys() - manifest.files.keys())
    parts = [
        f"{label}: {', '.join(items[:4])}"
        for label, items in (("changed", changed), ("missing", missing), ("added", added))
        if items
    ]
    raise ReleaseSignatureError(
        f"the files of {manifest.model} (release {manifest.release[:12]}…) differ from the "
        f"signed manifest ({'; '.join(parts)}): do not serve them"
    )


def check_facts(manifest: Manifest, tags: Mapping[str, str]) -> None:
    """The version's tags still say what was signed."""
    differ = sorted(k for k, v in manifest.facts.items() if tags.get(k) != v)
    if differ:
        raise ReleaseSignatureError(
            f"the tags {', '.join(differ)} of {manifest.model} differ from the signed manifest"
        )
