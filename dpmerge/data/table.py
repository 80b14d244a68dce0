"""A dataset of your own: a Parquet or CSV table named by a spec file (docs/design.md#table-data).

The spec (JSON, or YAML by its ``.yaml``/``.yml`` suffix) declares the table's file, its feature
columns, its label column and classes, an optional privacy-unit column, the split fractions and
the split key. Rows go to train / validation / test by HMAC-SHA256 of their unit id under the
split key, so the split depends on the ids and the key only. Features enter as stored (no
statistic of the data rescales them). Every bad input is refused in one line naming the file
and the key, column or row; a unit of several rows is refused (DP-SGD here protects one row).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from dpmerge.data.splits import DatasetSplits, Split
from dpmerge.errors import DatasetError
from dpmerge.formatting import cut
from dpmerge.vocabulary import DatasetName, SplitName

DEFAULT_SPLIT_KEY = "dpmerge-table-split"
"""The split key when the spec gives none: public and fixed, so the split is data-independent."""
DEFAULT_FRACTIONS = {SplitName.TRAIN: 0.8, SplitName.VALIDATION: 0.1, SplitName.TEST: 0.1}
SPEC_KEYS = {"path", "features", "label", "classes", "unit", "split_key", "fractions"}
REQUIRED_KEYS = ("path", "features", "label", "classes")
READERS = {".csv": pd.read_csv, ".parquet": pd.read_parquet, ".pq": pd.read_parquet}


@dataclass(frozen=True)
class TableSpec:
    """A checked spec: the table file and its declared columns, classes, fractions and key."""

    spec_path: Path
    path: Path
    features: tuple[str, ...]
    label: str
    classes: tuple[Any, ...]
    unit: str | None
    split_key: str
    fractions: dict[SplitName, float]

    def digest(self) -> str:
        """SHA-256 of what the spec declares, the key and the file's place excepted."""
        declared = {
            "features": self.features,
            "label": self.label,
            "classes": self.classes,
            "unit": self.unit,
            "fractions": {str(k): v for k, v in self.fractions.items()},
        }
        return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()

    def key_id(self) -> str:
        """A public name of the split key (a hash of it)."""
        return hashlib.sha256(b"dpmerge-split-key\0" + self.split_key.encode()).hexdigest()[:16]


def _names(spec_path: Path, key: str, value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list) else None
    if (
        not items
        or not all(isinstance(v, str) and v for v in items)
        or len(set(items)) < len(items)
    ):
        raise DatasetError(f"{spec_path}: {key} must be a list of distinct column names")
    return tuple(items)


def read_spec(spec_path: str | Path) -> TableSpec:
    """The spec at ``spec_path``, checked; the table's ``path`` is relative to the spec file."""
    spec_path = Path(spec_path)
    if not spec_path.is_file():
        raise DatasetError(f"table spec not found: {spec_path} (a JSON or YAML file)")
    try:
        text = spec_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{spec_path}: unreadable table spec ({error})") from None
    if spec_path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise DatasetError(f"{spec_path}: not valid YAML ({cut(str(error), 200)})") from None
    else:
        try:
            raw = json.loads(text)
        except ValueError as error:
            raise DatasetError(f"{spec_path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{spec_path}: a table spec is a mapping of {', '.join(REQUIRED_KEYS)}")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise DatasetError(f"{spec_path}: unknown key {unknown[0]!r}; known: {sorted(SPEC_KEYS)}")
    missing = [key for key in REQUIRED_KEYS if key not in raw]
    if missing:
        raise DatasetError(f"{spec_path}: missing key {missing[0]!r}")
    features = _names(spec_path, "features", raw["features"])
    label, unit = raw["label"], raw.get("unit")
    for key, value in (
        ("path", raw["path"]),
        ("label", label),
        ("unit", "-" if unit is None else unit),
    ):
        if not isinstance(value, str) or not value:
            raise DatasetError(f"{spec_path}: {key} must be a non-empty string")
    if len({*features, label, unit or label}) != len(features) + 1 + (unit is not None):
        raise DatasetError(f"{spec_path}: features, label and unit must name distinct columns")
    classes = raw["classes"]
    labels = isinstance(classes, list) and all(
        isinstance(c, int | str) and not isinstance(c, bool) for c in classes
    )
    if not labels or len(classes) < 2 or len(set(classes)) < len(classes):
        raise DatasetError(
            f"{spec_path}: classes must list at least two distinct label values (integers or "
            "strings)"
        )
    split_key = raw.get("split_key", DEFAULT_SPLIT_KEY)
    if not isinstance(split_key, str) or not split_key:
        raise DatasetError(f"{spec_path}: split_key must be a non-empty string")
    return TableSpec(
        spec_path=spec_path,
        path=spec_path.parent / raw["path"],
        features=features,
        label=label,
        classes=tuple(classes),
        unit=unit,
        split_key=split_key,
        fractions=_fractions(spec_path, raw.get("fractions", DEFAULT_FRACTIONS)),
    )


def _fractions(spec_path: Path, raw: Any) -> dict[SplitName, float]:
    wanted = {str(name) for name in SplitName}
    if not isinstance(raw, dict) or set(map(str, raw)) != wanted:
        raise DatasetError(f"{spec_path}: fractions must give {', '.join(sorted(wanted))}")
    fractions = {SplitName(k): v for k, v in raw.items()}
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw.values())
    if not numbers or fractions[SplitName.TRAIN] <= 0 or min(fractions.values()) < 0:
        raise DatasetError(f"{spec_path}: fractions must be numbers ≥ 0 with train > 0")
    if abs(sum(fractions.values()) - 1) > 1e-9:
        raise DatasetError(f"{spec_path}: fractions must sum to 1, got {sum(fractions.values())}")
    return fractions


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


def _check(spec: TableSpec, frame: pd.DataFrame) -> None:
    """Refuse a missing or undeclared column, a non-numeric feature, an empty cell, a label
    outside the classes, a single class and a repeated unit id, naming the column and row."""
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
    outside = np.flatnonzero(~frame[spec.label].isin(spec.classes).to_numpy())
    if outside.size:
        row = outside[0]
        raise DatasetError(
            f"{path}: column {spec.label!r}, row {row + 1}: label "
            f"{_cell(frame, spec.label, row)!r} is not one of the classes {list(spec.classes)}"
        )
    if frame[spec.label].nunique() < 2:
        raise DatasetError(
            f"{path}: column {spec.label!r} holds one class only; a classifier needs two"
        )
    if spec.unit is not None:
        repeated = np.flatnonzero(frame[spec.unit].duplicated().to_numpy())
        if repeated.size:
            row = repeated[0]
            unit = _cell(frame, spec.unit, row)
            first = int(np.flatnonzero((frame[spec.unit] == unit).to_numpy())[0])
            raise DatasetError(
                f"{path}: column {spec.unit!r}, row {row + 1}: unit {unit!r} also holds row "
                f"{first + 1}; a unit of several rows is refused (DP-SGD here protects one row, "
                "docs/design.md#table-data)"
            )


def _cell(frame: pd.DataFrame, column: str, row: int) -> Any:
    """The value at ``row`` (from 0) of ``column`` as a Python value, to name it in a message."""
    return frame[column].to_list()[row]


def split_of(unit_id: str, key: str, fractions: dict[SplitName, float]) -> SplitName:
    """The split of ``unit_id``: HMAC-SHA256 under ``key`` read as a number in [0, 1)."""
    mac = hmac.new(key.encode(), unit_id.encode(), hashlib.sha256).digest()
    point = int.from_bytes(mac[:8], "big") / 2**64
    edge = 0.0
    for name in (SplitName.TRAIN, SplitName.VALIDATION):
        edge += fractions[name]
        if point < edge:
            return name
    return SplitName.TEST


def load_table(spec_path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The table of the spec at ``spec_path`` (its first ``limit`` rows) in keyed splits; its
    fingerprint hashes the file's bytes, the spec, the split key's id and the limit."""
    spec = read_spec(spec_path)
    frame = _read(spec, limit)
    _check(spec, frame)
    units = frame[spec.unit].astype(str) if spec.unit else pd.Series(range(len(frame))).astype(str)
    splits = np.array([split_of(u, spec.split_key, spec.fractions) for u in units])
    features = torch.from_numpy(frame[list(spec.features)].to_numpy(dtype=np.float32, copy=True))
    index = {value: i for i, value in enumerate(spec.classes)}
    labels = torch.tensor([index[value] for value in frame[spec.label]], dtype=torch.int64)
    parts = {}
    for name in SplitName:
        rows = torch.from_numpy(np.flatnonzero(splits == name))
        parts[name] = Split(features[rows], labels[rows])
    if not len(parts[SplitName.TRAIN]):
        raise DatasetError(f"{spec.path}: the keyed split left no training rows")
    content = hashlib.sha256(spec.path.read_bytes()).hexdigest()
    identity = f"content={content};spec={spec.digest()};split-key={spec.key_id()};limit={limit}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return DatasetSplits(
        name=DatasetName.TABLE.value,
        train=parts[SplitName.TRAIN],
        validation=parts[SplitName.VALIDATION],
        test=parts[SplitName.TEST],
        num_classes=len(spec.classes),
        input_shape=(len(spec.features),),
        fingerprint=f"{DatasetName.TABLE.value}-sha256:{digest}",
        root=str(spec.spec_path),
    )
