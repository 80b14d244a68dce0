"""An optional file cache of accounting arrays (docs/design.md#sharp-edges): PLDs, their
compositions and RDP curves, kept across processes because every policy run is a fresh process
that would rebuild them (seconds of every time to policy).

Off unless :func:`set_directory` is called (:meth:`dpmerge.policy_merge.Workspace.use_caches`
does, with a private 0700 directory). Files hold the arrays exactly (``np.savez``, no pickle)
and are named by a digest of their key, which must name every input (plain floats, ints,
strings and tuples of them: its ``repr`` is the identity) and includes the dp-accounting
version, so a cached value is bit-identical to a rebuilt one. Each file also holds the SHA-256
of its key and arrays: a file that is unreadable, truncated, altered or stored under another
key's name is ignored (the caller rebuilds).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 2
_DIRECTORY: Path | None = None


def set_directory(directory: str | Path | None) -> None:
    """Keep cached arrays in ``directory`` (``None``: off)."""
    global _DIRECTORY
    _DIRECTORY = None if directory is None else Path(directory)


def _identity(key: tuple[Any, ...]) -> bytes:
    return repr((FORMAT, metadata.version("dp-accounting"), *key)).encode()


def path(kind: str, key: tuple[Any, ...]) -> Path | None:
    """The file of ``key`` (``kind``: its name's prefix), ``None`` when the cache is off."""
    if _DIRECTORY is None:
        return None
    return _DIRECTORY / f"{kind}-{hashlib.sha256(_identity(key)).hexdigest()[:40]}.npz"


def _digest(identity: bytes, arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over the key and every array (name, dtype, shape, bytes), in name order."""
    digest = hashlib.sha256(identity)
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def read(kind: str, key: tuple[Any, ...]) -> dict[str, np.ndarray] | None:
    """The arrays stored for ``key``, or ``None`` (off, absent, unreadable or not matching its
    digest)."""
    where = path(kind, key)
    if where is None or not where.is_file():
        return None
    try:
        with np.load(where, allow_pickle=False) as stored:
            arrays = {name: stored[name] for name in stored.files if name != "digest"}
            if str(stored["digest"]) != _digest(_identity(key), arrays):
                return None
    except (OSError, KeyError, ValueError):
        return None
    return arrays


def write(kind: str, key: tuple[Any, ...], arrays: dict[str, Any]) -> None:
    """Store ``arrays`` for ``key`` (atomically; a failure leaves nothing: a cache only)."""
    where = path(kind, key)
    if where is None:
        return
    arrays = {name: np.asarray(value) for name, value in arrays.items()}
    arrays["digest"] = np.str_(_digest(_identity(key), arrays))
    staging = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where.parent, suffix=".npz", delete=False) as handle:
            staging = handle.name
            np.savez(handle, **arrays)
        os.replace(staging, where)
    except OSError:
        if staging is not None:
            with contextlib.suppress(OSError):
                os.unlink(staging)
