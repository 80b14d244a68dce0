"""A dataset of your own: a Parquet or CSV table named by a spec file (docs/design.md#your-data).

The spec (JSON, or YAML by its ``.yaml``/``.yml`` suffix) declares the table's file, its feature
columns, its label column and classes, an optional privacy-unit column, the split fractions and
the split key (:mod:`dpmerge.data.own`). Rows go to train / validation / test by HMAC-SHA256 of
their unit id under the split key, so the split depends on the ids and the key only. Features
enter as stored (no statistic of the data rescales them). Every bad input is refused in one line
naming the file and the key, column or row; a unit of several rows is refused (DP-SGD here
protects one row). :func:`check_frame` and :func:`frame_splits` also serve a Hugging Face dataset
(:mod:`dpmerge.data.hf_dataset`), read as a frame.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from dpmerge.data import own
from dpmerge.data.splits import DatasetSplits
from dpmerge.errors import DatasetError
from dpmerge.formatting import cut
from dpmerge.vocabulary import DatasetName

SPEC_KEYS = own.COMMON_KEYS | {"features", "label"}
REQUIRED_KEYS = ("path", "features", "label", "classes")
READERS = {".csv": pd.read_csv, ".parquet": pd.read_parquet, ".pq": pd.read_parquet}


@dataclass(frozen=True)
class TableSpec(own.OwnSpec):
    """A checked spec of named columns: features, label and (optional) unit."""

    features: tuple[str, ...]
    label: str

    def declared(self) -> dict[str, Any]:
        return {"features": self.features, "label": self.label}


def read_spec(spec_path: str | Path, kind: DatasetName = DatasetName.TABLE) -> TableSpec:
    """The spec at ``spec_path``, checked; the data's ``path`` is relative to the spec file."""
    spec_path = Path(spec_path)
    raw = own.read_mapping(spec_path, kind, SPEC_KEYS, REQUIRED_KEYS)
    fields = own.common(spec_path, raw)
    features = own.names(spec_path, "features", raw["features"])
    label, unit = own.text(spec_path, "label", raw["label"]), fields["unit"]
    if len({*features, label, unit or label}) != len(features) + 1 + (unit is not None):
        raise DatasetError(f"{spec_path}: features, label and unit must name distinct columns")
    return TableSpec(**fields, features=features, label=label)


def _read(spec: TableSpec, limit: int | None) -> pd.DataFrame:
    path = spec.path
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path}: a table is a .csv or .parquet file")
    if not path.is_file():
        raise DatasetError(f"table file not found: {path} (named by {spec.spec_path})")
    if path.stat().st_size == 0:
        raise DatasetError(f"{path}: empty file")
    try:
        frame = reader(path)
    except (OSError, ValueError) as error:  # pandas' and pyarrow's parse errors are ValueErrors
        raise DatasetError(f"{path}: unreadable table ({cut(str(error), 200)})") from None
    frame = frame.iloc[:limit].reset_index(drop=True)
    if frame.empty:
        raise DatasetError(f"{path}: no rows")
    return frame


def check_frame(spec: TableSpec, frame: pd.DataFrame) -> None:
    """Refuse a missing or undeclared column, a non-numeric feature, an empty cell and a
    repeated unit id, naming the column and row (labels: :func:`frame_splits`)."""
    path = spec.path
    declared = [*spec.features, spec.label, *([spec.unit] if spec.unit else [])]
    columns = [str(c) for c in frame.columns]
    for column in declared:
        if column not in columns:
            raise DatasetError(f"{path}: missing column {column!r} (declared by {spec.spec_path})")
    for column in columns:
        if column not in declared:
            raise DatasetError(f"{path}: column {column!r} is not declared in {spec.spec_path}")
    for column in declared:
        empty = np.flatnonzero(frame[column].isna().to_numpy())
        if empty.size:
            raise DatasetError(f"{path}: column {column!r}, row {empty[0] + 1}: empty cell")
    for column in spec.features:
        values = frame[column]
        if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
            bad = pd.to_numeric(values, errors="coerce").isna().to_numpy()
            row = int(np.argmax(bad)) if bad.any() else 0
            raise DatasetError(
                f"{path}: column {column!r}, row {row + 1}: not a number "
                f"({_cell(frame, column, row)!r})"
            )
        infinite = np.flatnonzero(~np.isfinite(values.to_numpy(dtype=np.float64)))
        if infinite.size:
            raise DatasetError(f"{path}: column {column!r}, row {infinite[0] + 1}: not finite")
    if spec.unit is not None:
        repeated = np.flatnonzero(frame[spec.unit].duplicated().to_numpy())
        if repeated.size:
            row = repeated[0]
            unit = _cell(frame, spec.unit, row)
            first = int(np.flatnonzero((frame[spec.unit] == unit).to_numpy())[0])
            raise DatasetError(
                f"{path}: column {spec.unit!r}, row {row + 1}: unit {unit!r} also holds row "
                f"{first + 1}; a unit of several rows is refused (DP-SGD here protects one row, "
                "docs/design.md#your-data)"
            )


def _cell(frame: pd.DataFrame, column: str, row: int) -> Any:
    """The value at ``row`` (from 0) of ``column`` as a Python value, to name it in a message."""
    return frame[column].to_list()[row]


def frame_splits(
    kind: DatasetName, spec: TableSpec, frame: pd.DataFrame, content: str, limit: int | None
) -> DatasetSplits:
    """A checked frame's rows in keyed splits (:func:`dpmerge.data.own.assemble`)."""
    labels = own.label_indices(
        f"{spec.path}: column {spec.label!r}", frame[spec.label].to_list(), spec.classes
    )
    units = frame[spec.unit].astype(str) if spec.unit else pd.Series(range(len(frame))).astype(str)
    features = torch.from_numpy(frame[list(spec.features)].to_numpy(dtype=np.float32, copy=True))
    return own.assemble(kind, spec, features, labels, units.to_list(), content, limit)


def load_table(spec_path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The table of the spec at ``spec_path`` (its first ``limit`` rows) in keyed splits; its
    fingerprint hashes the file's bytes, the spec, the split key's id and the limit."""
    spec = read_spec(spec_path)
    frame = _read(spec, limit)
    check_frame(spec, frame)
    content = hashlib.sha256(spec.path.read_bytes()).hexdigest()
    return frame_splits(DatasetName.TABLE, spec, frame, content, limit)
