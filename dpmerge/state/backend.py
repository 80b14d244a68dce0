"""Where the release-state store keeps its objects: an S3 bucket (the stack, production) or a
directory (the embedded home), behind one small interface (docs/design.md#release-state).

Every write is conditional, so concurrent writers never lose each other's changes:

* :meth:`Backend.create` writes a key only if it does not exist (S3 ``If-None-Match: *``;
  locally ``O_EXCL`` and a hard link), else :class:`ObjectExistsError`;
* :meth:`Backend.replace` writes a key only if it still holds what was read (S3 ``If-Match``
  on the ETag; locally under an exclusive lock, comparing a SHA-256 of the content), else
  :class:`ObjectChangedError`.

Both keep earlier content restorable: the stack's state bucket is versioned, and the local
backend keeps each replaced object under ``.versions/`` (:meth:`Backend.history`), so a
document whose signature fails can be restored to its newest good version.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dpmerge.storage import ObjectChangedError, ObjectExistsError, S3Store, StorageError

__all__ = [
    "MAX_OBJECT_BYTES",
    "Backend",
    "LocalBackend",
    "ObjectChangedError",
    "ObjectExistsError",
    "S3Backend",
    "Stored",
]


MAX_OBJECT_BYTES = 16 * 2**20
"""Largest state object read whole (a dataset document with a long ledger is far smaller):
:meth:`Backend.read` returns at most one byte more, so a reader sees it is too large without
holding a runaway object in memory."""


@dataclass(frozen=True)
class Stored:
    """An object's bytes and the tag a conditional replace must name (an ETag, a digest)."""

    data: bytes
    tag: str


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(not p or p.startswith(".") or not p.isprintable() for p in parts):
        raise StorageError(f"invalid state key {key!r}")
    return key


class Backend(ABC):
    """The object operations the state store needs (see the module docstring)."""

    where: str

    @abstractmethod
    def read(self, key: str) -> Stored | None:
        """The object at ``key`` (its first :data:`MAX_OBJECT_BYTES` + 1 bytes), or ``None``
        when there is none."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> None:
        """Write ``key`` only if it does not exist (:class:`ObjectExistsError`)."""

    @abstractmethod
    def replace(self, key: str, data: bytes, tag: str) -> None:
        """Write ``key`` only if it still holds the content tagged ``tag``
        (:class:`ObjectChangedError`)."""

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (a folder, ending in ``/``), sorted."""

    @abstractmethod
    def history(self, key: str) -> list[bytes]:
        """Earlier contents of ``key``, newest first (the current one included first)."""


class S3Backend(Backend):
    """The state bucket of an S3 store (versioned: earlier contents stay readable)."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.bucket = store.config.state_bucket
        self.where = f"s3://{self.bucket}"

    def read(self, key: str) -> Stored | None:
        found = self.store.get_versioned(
            _check_key(key), bucket=self.bucket, limit=MAX_OBJECT_BYTES + 1
        )
        return None if found is None else Stored(found[0], found[1])

    def create(self, key: str, data: bytes) -> None:
        self.store.put_bytes(
            _check_key(key),
            data,
            bucket=self.bucket,
            if_absent=True,
            content_type="application/json",
        )

    def replace(self, key: str, data: bytes, tag: str) -> None:
        self.store.put_bytes(
            _check_key(key), data, bucket=self.bucket, if_match=tag, content_type="application/json"
        )

    def keys(self, prefix: str) -> list[str]:
        return self.store.list_keys(prefix, bucket=self.bucket)

    def history(self, key: str) -> list[bytes]:
        return [
            self.store.get_version(key, version, bucket=self.bucket)
            for version in self.store.versions(_check_key(key), bucket=self.bucket)
        ]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalBackend(Backend):
    """A private directory (0700, files 0600): the embedded home's ``state/``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.where = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _private_parent(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root.chmod(0o700)

    def read(self, key: str) -> Stored | None:
        path = self._path(key)
        try:
            with path.open("rb") as handle:
                data = handle.read(MAX_OBJECT_BYTES + 1)
        except FileNotFoundError:
            return None
        return Stored(data, _digest(data))

    def _stage(self, path: Path, data: bytes) -> Path:
        self._private_parent(path)
        staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return staging

    def create(self, key: str, data: bytes) -> None:
        path = self._path(key)
        staging = self._stage(path, data)
        try:
            os.link(staging, path)  # never replaces what another writer created
        except FileExistsError:
            raise ObjectExistsError(f"{path} already exists") from None
        finally:
            staging.unlink()

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        self._private_parent(path)
        lock = path.with_name(f".{path.name}.lock")
        with lock.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def replace(self, key: str, data: bytes, tag: str) -> None:
        path = self._path(key)
        with self._locked(path):
            current = self.read(key)
            if current is None or current.tag != tag:
                raise ObjectChangedError(f"{path} changed since it was read")
            kept = self.root / ".versions" / key
            kept.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.link(path, kept / f"{time.time_ns():020d}")
            os.replace(self._stage(path, data), path)

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        found = []
        for path in base.rglob("*"):
            relative = path.relative_to(self.root)
            if path.is_file() and not any(p.startswith(".") for p in relative.parts):
                found.append(relative.as_posix())
        return sorted(found)

    def history(self, key: str) -> list[bytes]:
        current = self.read(key)
        kept = self.root / ".versions" / _check_key(key)
        older = sorted(kept.iterdir(), reverse=True) if kept.is_dir() else []
        return ([current.data] if current else []) + [p.read_bytes() for p in older]
