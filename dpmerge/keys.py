"""The workflow's secret key (docs/design.md#security): HMAC-SHA256 under sub-keys derived per
purpose (:class:`~dpmerge.vocabulary.KeyPurpose`), for record signatures and for the keyed
dataset and lineage identifiers that are published instead of fingerprints and seeds.

HMAC rather than Ed25519: the workflow both signs (when it registers a candidate) and verifies
(when it merges), so a shared secret is enough, the standard library has it, and the same key
gives the keyed identifiers, which need a pseudo-random function that a signature scheme does
not provide.

Where the key comes from, first found wins:

1. ``$DPMERGE_SECRET_KEY``: at least 64 hexadecimal digits (32 bytes).
2. ``$DPMERGE_SECRET_KEY_FILE``: a file holding the same, readable by its owner only. The
   stack's workflow environment names its ``secrets/workflow.key`` here, so its flows and
   commands find the key the same way (docs/stack.md#trust-model).
3. ``<home>/secret.key`` (``$DPMERGE_HOME``, default ``./.dpmerge``): generated once (0600) on
   first use, so the dev stack and the demo work without anyone typing a key. It is never
   committed (``.dpmerge/`` is ignored) and must be backed up with the registry: a lost key
   leaves every signed record unverifiable.

Every process that registers candidates or merges them must see the same key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from dpmerge.errors import InputError
from dpmerge.home import resolve_home
from dpmerge.vocabulary import KeyPurpose

KEY_ENV = "DPMERGE_SECRET_KEY"
KEY_FILE_ENV = "DPMERGE_SECRET_KEY_FILE"
KEY_FILE = "secret.key"
KEY_BYTES = 32


class SecretKeyError(InputError):
    """The configured secret key is missing, malformed or readable by others."""


def _parse(text: str, where: str) -> bytes:
    value = text.strip()
    try:
        material = bytes.fromhex(value)
    except ValueError:
        raise SecretKeyError(
            f"{where} is not hexadecimal; generate a key with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        ) from None
    if len(material) < KEY_BYTES:
        raise SecretKeyError(
            f"{where} holds {len(material)} bytes; a key needs at least {KEY_BYTES} "
            f"({2 * KEY_BYTES} hexadecimal digits)"
        )
    return material


def _read_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as error:
        raise SecretKeyError(f"cannot read the secret key file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise SecretKeyError(f"the secret key file {path} is not text") from None
    if stat.S_IMODE(mode) & 0o077:
        raise SecretKeyError(
            f"the secret key file {path} is readable by others (mode "
            f"{stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    return _parse(text, f"the secret key file {path}")


def _generate(path: Path) -> bytes:
    """Create ``path`` (0600) with a new key unless another process did first; either way
    return the key in the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_hex(KEY_BYTES) + "\n")
    try:
        os.link(staging, path)  # never replaces a key another process just wrote
    except FileExistsError:
        pass
    finally:
        staging.unlink()
    return _read_file(path)


@dataclass(frozen=True)
class WorkflowKey:
    """The secret key and where it came from (the material never shows in ``repr``)."""

    material: bytes = field(repr=False)
    source: str

    @classmethod
    def from_env(cls, home: str | Path | None = None) -> WorkflowKey:
        """The key from ``$DPMERGE_SECRET_KEY``, else ``$DPMERGE_SECRET_KEY_FILE``, else
        ``<home>/secret.key`` (generated on first use)."""
        if os.environ.get(KEY_ENV):
            return cls(_parse(os.environ[KEY_ENV], f"${KEY_ENV}"), f"${KEY_ENV}")
        if os.environ.get(KEY_FILE_ENV):
            path = Path(os.environ[KEY_FILE_ENV])
            return cls(_read_file(path), str(path))
        path = resolve_home(home) / KEY_FILE
        return cls(_read_file(path) if path.exists() else _generate(path), str(path))

    @classmethod
    def generate(cls) -> WorkflowKey:
        """A fresh random key held in memory only (tests, one-off tools)."""
        return cls(secrets.token_bytes(KEY_BYTES), "generated in memory")

    def _subkey(self, purpose: KeyPurpose) -> bytes:
        return hmac.new(self.material, f"dpmerge/{purpose.value}".encode(), hashlib.sha256).digest()

    def mac(self, purpose: KeyPurpose, message: str | bytes) -> str:
        """HMAC-SHA256 of ``message`` under ``purpose``'s sub-key, in hexadecimal."""
        data = message.encode() if isinstance(message, str) else message
        return hmac.new(self._subkey(purpose), data, hashlib.sha256).hexdigest()

    def verify(self, purpose: KeyPurpose, message: str | bytes, tag: str | None) -> bool:
        """``tag`` is ``message``'s MAC under ``purpose`` (constant-time comparison)."""
        return tag is not None and hmac.compare_digest(self.mac(purpose, message), str(tag))

    @property
    def key_id(self) -> str:
        """A public 12-digit name of this key: says which key signed, reveals nothing of it."""
        return self.mac(KeyPurpose.KEY_ID, b"")[:12]
