"""What every dataset of your own shares (docs/design.md#your-data): the spec file, the keyed
split by unit id and the identity a record names.

A source (:mod:`dpmerge.data.table`, :mod:`dpmerge.data.images`, :mod:`dpmerge.data.npz`,
:mod:`dpmerge.data.hf_dataset`) reads its spec with :func:`read_mapping` and :func:`common`, its own
file into features, labels and unit ids, and hands them to :func:`assemble`: units go to train /
validation / test by :func:`split_units` (HMAC-SHA256 of the unit id under the split key), and
the fingerprint is ``<kind>-sha256:<32 hex>`` over the content digest, the spec's declarations,
the split key's id and the limit. Every refusal is one :class:`~dpmerge.errors.DatasetError` line
naming the file and the key, column or row.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpmerge.data.splits import DatasetSplits, Split
from dpmerge.errors import DatasetError
from dpmerge.formatting import cut
from dpmerge.vocabulary import DatasetName, SplitName

DEFAULT_SPLIT_KEY = "dpmerge-table-split"
"""The split key when the spec gives none: public and fixed, so the split is data-independent."""
DEFAULT_FRACTIONS = {SplitName.TRAIN: 0.8, SplitName.VALIDATION: 0.1, SplitName.TEST: 0.1}
COMMON_KEYS = frozenset({"path", "classes", "unit", "split_key", "fractions"})
"""The spec keys every source reads (``unit`` where the source has unit ids to name)."""


@dataclass(frozen=True)
class OwnSpec:
    """A checked spec: the data's place, its classes, unit, split fractions and split key."""

    spec_path: Path
    path: Path
    classes: tuple[Any, ...]
    unit: str | None
    split_key: str
    fractions: dict[SplitName, float]

    def declared(self) -> dict[str, Any]:
        """What the source declares beyond the common keys (hashed into :meth:`digest`)."""
        return {}

    def digest(self) -> str:
        """SHA-256 of what the spec declares, the key and the data's place excepted."""
        declared = {
            **self.declared(),
            "classes": self.classes,
            "unit": self.unit,
            "fractions": {str(k): v for k, v in self.fractions.items()},
        }
        return hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()

    def key_id(self) -> str:
        """A public name of the split key (a hash of it)."""
        return hashlib.sha256(b"dpmerge-split-key\0" + self.split_key.encode()).hexdigest()[:16]


def read_mapping(
    spec_path: str | Path, kind: DatasetName, keys: Iterable[str], required: Sequence[str]
) -> dict[str, Any]:
    """The spec file of a ``kind`` dataset as a mapping (JSON, or YAML by its suffix), refusing
    a key outside ``keys`` and a missing ``required`` one."""
    spec_path, keys = Path(spec_path), set(keys)
    if not spec_path.is_file():
        raise DatasetError(f"{kind} spec not found: {spec_path} (a JSON or YAML file)")
    try:
        text = spec_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{spec_path}: unreadable {kind} spec ({error})") from None
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
        raise DatasetError(f"{spec_path}: a {kind} spec is a mapping of {', '.join(required)}")
    unknown = sorted(set(map(str, raw)) - keys)
    if unknown:
        raise DatasetError(f"{spec_path}: unknown key {unknown[0]!r}; known: {sorted(keys)}")
    missing = [key for key in required if key not in raw]
    if missing:
        raise DatasetError(f"{spec_path}: missing key {missing[0]!r}")
    return raw


def text(spec_path: Path, key: str, value: Any) -> str:
    """``value`` of spec key ``key``, refused unless a non-empty string."""
    if not isinstance(value, str) or not value:
        raise DatasetError(f"{spec_path}: {key} must be a non-empty string")
    return value


def names(spec_path: Path, key: str, value: Any) -> tuple[str, ...]:
    """``value`` of spec key ``key``, refused unless a non-empty list of distinct names."""
    items = value if isinstance(value, list) else None
    if (
        not items
        or not all(isinstance(v, str) and v for v in items)
        or len(set(items)) < len(items)
    ):
        raise DatasetError(f"{spec_path}: {key} must be a list of distinct column names")
    return tuple(items)


def common(spec_path: Path, raw: dict[str, Any], *, strings: bool = False) -> dict[str, Any]:
    """The common keys of a read spec as :class:`OwnSpec` fields (``classes`` only strings
    where ``strings``: an image folder's class sub-folders)."""
    path, unit = text(spec_path, "path", raw["path"]), raw.get("unit")
    if unit is not None:
        text(spec_path, "unit", unit)
    classes = raw["classes"]
    kinds = str if strings else int | str
    labels = isinstance(classes, list) and all(
        isinstance(c, kinds) and not isinstance(c, bool) for c in classes
    )
    if not labels or len(classes) < 2 or len(set(classes)) < len(classes):
        what = "strings" if strings else "integers or strings"
        raise DatasetError(
            f"{spec_path}: classes must list at least two distinct label values ({what})"
        )
    split_key = raw.get("split_key", DEFAULT_SPLIT_KEY)
    return {
        "spec_path": spec_path,
        "path": spec_path.parent / path,
        "classes": tuple(classes),
        "unit": unit,
        "split_key": text(spec_path, "split_key", split_key),
        "fractions": _fractions(spec_path, raw.get("fractions", DEFAULT_FRACTIONS)),
    }


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


def split_units(unit_ids: Sequence[str], key: str, fractions: dict[SplitName, float]) -> np.ndarray:
    """The split of each unit id (:func:`split_of`), as an array of :class:`SplitName` values in
    the ids' order: a stable entry point for every source."""
    return np.array([split_of(u, key, fractions) for u in unit_ids], dtype=object)


def first_repeat(unit_ids: Sequence[str]) -> tuple[int, int] | None:
    """The first position (from 0) whose unit id appeared before, and that earlier position."""
    seen: dict[str, int] = {}
    for row, unit in enumerate(unit_ids):
        if unit in seen:
            return row, seen[unit]
        seen[unit] = row
    return None


def label_indices(where: str, values: Sequence[Any], classes: tuple[Any, ...]) -> torch.Tensor:
    """Each label's position in ``classes``; a label outside them, or a single class, refused in
    one line starting ``where`` (the file and column) and naming the row (from 1)."""
    index = {value: i for i, value in enumerate(classes)}
    for row, value in enumerate(values):
        if isinstance(value, bool) or value not in index:
            raise DatasetError(
                f"{where}, row {row + 1}: label {value!r} is not one of the classes {list(classes)}"
            )
    if len(set(values)) < 2:
        raise DatasetError(f"{where} holds one class only; a classifier needs two")
    return torch.tensor([index[value] for value in values], dtype=torch.int64)


def files_digest(root: Path, files: Iterable[Path]) -> str:
    """SHA-256 over each file's path under ``root`` and its bytes: a folder's content digest."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def assemble(
    kind: DatasetName,
    spec: OwnSpec,
    features: torch.Tensor,
    labels: torch.Tensor,
    unit_ids: Sequence[str],
    content: str,
    limit: int | None,
) -> DatasetSplits:
    """Rows in keyed splits by their unit ids, fingerprinted ``<kind>-sha256:…`` over
    ``content`` (the data's digest), the spec's declarations, the split key's id and ``limit``.
    """
    splits = split_units(unit_ids, spec.split_key, spec.fractions)
    parts = {}
    for name in SplitName:
        rows = torch.from_numpy(np.flatnonzero(splits == name))
        parts[name] = Split(features[rows], labels[rows])
    if not len(parts[SplitName.TRAIN]):
        raise DatasetError(f"{spec.path}: the keyed split left no training units")
    identity = f"content={content};spec={spec.digest()};split-key={spec.key_id()};limit={limit}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return DatasetSplits(
        name=kind.value,
        train=parts[SplitName.TRAIN],
        validation=parts[SplitName.VALIDATION],
        test=parts[SplitName.TEST],
        num_classes=len(spec.classes),
        input_shape=tuple(features.shape[1:]),
        fingerprint=f"{kind.value}-sha256:{digest}",
        root=str(spec.spec_path),
    )
