"""A NumPy ``.npz`` of declared arrays, named by a spec file (docs/design.md#your-data).

The spec declares the file (``path``), the ``features`` array (n rows of any shape, numbers),
the ``label`` array (n labels, one of ``classes`` each), an optional ``unit`` array (n unit ids;
without it, one row is one unit) and the common split keys (:mod:`dpmerge.data.own`). An array
the spec does not declare, a missing one, object arrays, features that are not finite numbers
and a repeated unit id are refused in one line naming the file, the array and the row.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpmerge.data import own
from dpmerge.data.splits import DatasetSplits
from dpmerge.errors import DatasetError
from dpmerge.vocabulary import DatasetName

SPEC_KEYS = own.COMMON_KEYS | {"features", "label"}
REQUIRED_KEYS = ("path", "features", "label", "classes")


@dataclass(frozen=True)
class ArraySpec(own.OwnSpec):
    """A checked spec of a ``.npz``: the names of its features and label arrays."""

    features: str
    label: str

    def declared(self) -> dict[str, Any]:
        return {"features": self.features, "label": self.label}


def read_spec(spec_path: str | Path) -> ArraySpec:
    """The spec at ``spec_path``, checked; the file's ``path`` is relative to the spec file."""
    spec_path = Path(spec_path)
    raw = own.read_mapping(spec_path, DatasetName.NPZ, SPEC_KEYS, REQUIRED_KEYS)
    fields = own.common(spec_path, raw)
    features = own.text(spec_path, "features", raw["features"])
    label, unit = own.text(spec_path, "label", raw["label"]), fields["unit"]
    if len({features, label, unit or label}) != 2 + (unit is not None):
        raise DatasetError(f"{spec_path}: features, label and unit must name distinct arrays")
    return ArraySpec(**fields, features=features, label=label)


def _arrays(spec: ArraySpec, limit: int | None) -> dict[str, np.ndarray]:
    """The declared arrays (their first ``limit`` rows), refusing a missing, undeclared or
    unreadable array and arrays of different lengths."""
    path = spec.path
    if not path.is_file():
        raise DatasetError(f"npz file not found: {path} (named by {spec.spec_path})")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: empty file")
    declared = [spec.features, spec.label, *([spec.unit] if spec.unit else [])]
    try:
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                if name not in declared:
                    raise DatasetError(
                        f"{path}: array {name!r} is not declared in {spec.spec_path}"
                    )
            for name in declared:
                if name not in archive.files:
                    raise DatasetError(
                        f"{path}: missing array {name!r} (declared by {spec.spec_path})"
                    )
            arrays = {name: archive[name][:limit] for name in declared}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DatasetError(f"{path}: unreadable npz ({type(error).__name__}: {error})") from None
    for name, array in arrays.items():
        if array.ndim == 0 or (name != spec.features and array.ndim != 1):
            raise DatasetError(f"{path}: array {name!r} must hold one row per unit")
    rows = {len(array) for array in arrays.values()}
    if len(rows) > 1:
        raise DatasetError(f"{path}: the declared arrays have different lengths {sorted(rows)}")
    if not rows.pop():
        raise DatasetError(f"{path}: no rows")
    return arrays


def _features(spec: ArraySpec, values: np.ndarray) -> torch.Tensor:
    where = f"{spec.path}: array {spec.features!r}"
    if values.dtype.kind not in "iuf":
        raise DatasetError(f"{where}: not numbers (dtype {values.dtype})")
    finite = np.isfinite(values.reshape(len(values), -1).astype(np.float64)).all(axis=1)
    if not finite.all():
        raise DatasetError(f"{where}, row {int(np.argmin(finite)) + 1}: not finite")
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def load_npz(spec_path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The arrays of the spec at ``spec_path`` (their first ``limit`` rows) in keyed splits; the
    fingerprint hashes the file's bytes, the spec, the split key's id and the limit."""
    spec = read_spec(spec_path)
    arrays = _arrays(spec, limit)
    features = _features(spec, arrays[spec.features])
    units = (
        [str(u) for u in arrays[spec.unit].tolist()]
        if spec.unit
        else [str(i) for i in range(len(features))]
    )
    repeat = own.first_repeat(units)
    if repeat is not None:
        raise DatasetError(
            f"{spec.path}: array {spec.unit!r}, row {repeat[0] + 1}: unit {units[repeat[0]]!r} "
            f"also holds row {repeat[1] + 1}; a unit of several rows is refused"
        )
    labels = own.label_indices(
        f"{spec.path}: array {spec.label!r}", arrays[spec.label].tolist(), spec.classes
    )
    content = hashlib.sha256(spec.path.read_bytes()).hexdigest()
    return own.assemble(DatasetName.NPZ, spec, features, labels, units, content, limit)
