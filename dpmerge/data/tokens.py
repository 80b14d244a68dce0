"""A dataset of token sequences in a NumPy ``.npz`` file, for fine-tuning a transformer
(docs/design.md#fine-tuning).

The file holds ``input_ids`` (integers, [N, L]), ``labels`` (integers in 0..K−1, [N]) and
optionally ``attention_mask`` (0 or 1, [N, L]; all ones when absent), ``unit_ids`` ([N], one
privacy unit per row) and ``num_classes`` (a scalar K; the largest label + 1 when absent). Rows
go to train / validation / test by the keyed hash of their unit id that tables use
(:func:`~dpmerge.data.own.split_of`, its default key and fractions), the row index standing in
for a missing unit id. A row is one model input: ``input_ids`` and ``attention_mask`` stacked
as an int64 (2, L) tensor, which :class:`~dpmerge.transformer.FineTuned` unpacks. Every bad
input is refused in one line naming the file and the array.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import torch

from dpmerge.data.own import DEFAULT_FRACTIONS, DEFAULT_SPLIT_KEY, OwnSpec, assemble
from dpmerge.data.splits import DatasetSplits
from dpmerge.errors import DatasetError
from dpmerge.vocabulary import DatasetName

ARRAYS = frozenset({"input_ids", "labels", "attention_mask", "unit_ids", "num_classes"})


def _read(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DatasetError(f"token file not found: {path} (an .npz with input_ids and labels)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DatasetError(f"{path}: not a readable .npz file ({error})") from None
    unknown = sorted(set(arrays) - ARRAYS)
    if unknown:
        raise DatasetError(f"{path}: unknown array {unknown[0]!r}; known: {sorted(ARRAYS)}")
    for key in ("input_ids", "labels"):
        if key not in arrays:
            raise DatasetError(f"{path}: missing array {key!r}")
    return arrays


def _integers(path: Path, key: str, array: np.ndarray, ndim: int) -> np.ndarray:
    if array.dtype.kind not in "iu" or array.ndim != ndim:
        raise DatasetError(
            f"{path}: {key} must be an integer array of {ndim} dimension(s), "
            f"got {array.dtype} of shape {array.shape}"
        )
    return array.astype(np.int64)


def _checked(
    path: Path, arrays: dict[str, np.ndarray], limit: int | None
) -> tuple[np.ndarray, np.ndarray, list[str], int]:
    """The stacked (N, 2, L) inputs, the labels, the unit ids and K, checked."""
    ids = _integers(path, "input_ids", arrays["input_ids"], 2)[:limit]
    labels = _integers(path, "labels", arrays["labels"], 1)[:limit]
    n = len(ids)
    if n == 0 or ids.shape[1] == 0:
        raise DatasetError(f"{path}: input_ids holds no rows or no tokens")
    if len(labels) != n:
        raise DatasetError(f"{path}: {len(labels)} labels for {n} rows of input_ids")
    if ids.min() < 0:
        raise DatasetError(f"{path}: input_ids, row {int(np.argmin(ids.min(1))) + 1}: negative id")
    mask = np.ones_like(ids)
    if "attention_mask" in arrays:
        mask = _integers(path, "attention_mask", arrays["attention_mask"], 2)[:limit]
        if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
            raise DatasetError(f"{path}: attention_mask must be 0s and 1s shaped like input_ids")
    units = [str(i) for i in range(n)]
    if "unit_ids" in arrays:
        raw = arrays["unit_ids"][:limit]
        if raw.ndim != 1 or len(raw) != n or raw.dtype.kind not in "iuU":
            raise DatasetError(f"{path}: unit_ids must be {n} integers or strings, one a row")
        units = [str(u) for u in raw.tolist()]
        if len(set(units)) < n:
            raise DatasetError(
                f"{path}: unit_ids repeat a unit; a unit of several rows is refused (DP-SGD "
                "here protects one row, docs/design.md#your-data)"
            )
    classes = int(labels.max()) + 1
    if "num_classes" in arrays:
        declared = arrays["num_classes"]
        if declared.shape != () or declared.dtype.kind not in "iu":
            raise DatasetError(f"{path}: num_classes must be one integer")
        classes = int(declared)
    if labels.min() < 0 or labels.max() >= classes or len(np.unique(labels)) < 2:
        raise DatasetError(
            f"{path}: labels must lie in 0..{classes - 1} and hold at least two classes"
        )
    return np.stack([ids, mask], axis=1), labels, units, classes


def load_tokens(path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The token file at ``path`` (its first ``limit`` rows) in keyed splits by the default
    key and fractions, fingerprinted by :func:`~dpmerge.data.own.assemble` over the file's
    bytes (the file is its own spec)."""
    path = Path(path)
    inputs, labels, units, classes = _checked(path, _read(path), limit)
    spec = OwnSpec(path, path, tuple(range(classes)), None, DEFAULT_SPLIT_KEY, DEFAULT_FRACTIONS)
    content = hashlib.sha256(path.read_bytes()).hexdigest()
    return assemble(
        DatasetName.TOKENS,
        spec,
        torch.from_numpy(inputs),
        torch.from_numpy(labels),
        units,
        content,
        limit,
    )
