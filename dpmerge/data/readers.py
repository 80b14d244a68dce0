"""Readers for the on-disk formats of the supported datasets (no downloads, docs/design.md#studies).

* IDX (MNIST, Fashion-MNIST): big-endian header, plain or gzip-compressed.
* CIFAR-10 python batches: pickles of ``{b"data": uint8 (N, 3072), b"labels": [...]}``, read
  with an unpickler that only builds numpy arrays and plain containers (a pickle can otherwise
  run arbitrary code).
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dpmerge.errors import DatasetError

_IDX_TYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def find_file(root: Path, stem: str) -> Path | None:
    """``root/stem`` or ``root/stem.gz``, whichever exists (plain first)."""
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _open(path: Path) -> BinaryIO:
    with path.open("rb") as handle:
        compressed = handle.read(2) == _GZIP_MAGIC
    return gzip.open(path, "rb") if compressed else path.open("rb")


def read_idx(path: Path, limit: int | None = None) -> np.ndarray:
    """Read an IDX file (plain or gzip); ``limit`` reads only the first rows."""
    try:
        with _open(path) as handle:
            header = handle.read(4)
            if len(header) != 4 or header[:2] != b"\0\0" or header[2] not in _IDX_TYPES:
                raise DatasetError(f"{path}: not an IDX file (bad magic number {header.hex()})")
            dtype, ndim = _IDX_TYPES[header[2]], header[3]
            dims = list(struct.unpack(f">{ndim}I", handle.read(4 * ndim)))
            if limit is not None and dims:
                dims[0] = min(dims[0], limit)
            count = int(np.prod(dims))
            payload = handle.read(count * dtype.itemsize)
    except (OSError, EOFError, struct.error) as error:
        raise DatasetError(f"{path}: unreadable IDX file ({error})") from None
    if len(payload) != count * dtype.itemsize:
        raise DatasetError(f"{path}: truncated IDX file (expected {count} values of shape {dims})")
    return np.frombuffer(payload, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and builtin containers only (CIFAR-10 batches need no more)."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")
        return super().find_class(module, name)


def read_cifar_batch(path: Path, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch as (uint8 images (N, 3, 32, 32), int labels (N,))."""
    try:
        batch = _ArrayUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as error:
        raise DatasetError(f"{path}: not a CIFAR-10 python batch ({error})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DatasetError(f"{path}: CIFAR-10 data must have shape (N, 3072), got {data.shape}")
    images = data.reshape(-1, 3, 32, 32)
    return images[:limit], labels[:limit]
