"""The held-out splits that go with the candidates' training data (step 2), found by its
fingerprint and cached as safetensors."""

from __future__ import annotations

import math
import os
import uuid
from contextlib import suppress
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dpmerge.data import DatasetSplits, Split, load_dataset
from dpmerge.errors import DatasetError

DATA_ROOT_ENV = "DPMERGE_DATA_ROOT"
VALIDATION_FRACTION = 0.1
SPLIT_SEED = 0


def _limits_for(train_rows: int) -> list[int]:
    """Row limits ``L`` with ``L - round(L·0.1) = train_rows`` (the validation carve)."""
    guess = train_rows / (1 - VALIDATION_FRACTION)
    return [
        limit
        for limit in range(max(1, math.floor(guess) - 3), math.ceil(guess) + 4)
        if limit - round(limit * VALIDATION_FRACTION) == train_rows
    ]


@lru_cache(maxsize=4)
def _load(name: str, root: str | None, limit: int | None) -> DatasetSplits:
    return load_dataset(
        name, root, seed=SPLIT_SEED, validation_fraction=VALIDATION_FRACTION, limit=limit
    )


@dataclass(frozen=True, eq=False)
class EvaluationData:
    """The held-out splits of the candidates' training data: ``validation`` (carved from the
    training file, disjoint from the training rows: calibration utilities,
    docs/design.md#random-selection) and
    ``test`` (reported accuracy). ``fingerprint`` names the training rows they go with."""

    name: str
    fingerprint: str
    validation: Split
    test: Split


def _cache_file(cache_dir: Path, fingerprint: str, limit: int | None) -> Path:
    return cache_dir / f"{fingerprint.replace(':', '-')}-{limit or 'all'}.safetensors"


def load_evaluation_data(
    fingerprint: str,
    train_rows: int | None,
    *,
    root: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> EvaluationData:
    """The validation and test splits that go with training rows of ``fingerprint``
    (dpmerge's default split: seed 0, 10 % validation; a ``--limit`` run is recognised from its
    number of training rows, the match checked by fingerprint). ``root`` defaults to
    ``$DPMERGE_DATA_ROOT`` or the dataset's own place. With ``cache_dir`` the two splits are
    kept there (safetensors, keyed by fingerprint and limit) and read back next time."""
    from safetensors.torch import load_file, save_file

    name = fingerprint.split("-sha256:")[0]
    root = str(root or os.environ.get(DATA_ROOT_ENV) or "") or None
    limits: list[int | None] = [*_limits_for(train_rows)] if train_rows else []
    limits.append(None)
    if cache_dir is not None:
        for limit in limits:
            cached = _cache_file(Path(cache_dir), fingerprint, limit)
            if cached.is_file():
                with suppress(Exception):  # unreadable: rebuilt below
                    t = load_file(str(cached))
                    return EvaluationData(
                        name,
                        fingerprint,
                        Split(t["validation_x"], t["validation_y"]),
                        Split(t["test_x"], t["test_y"]),
                    )
    for limit in limits:
        data = _load(name, root, limit)
        if data.fingerprint == fingerprint:
            found = EvaluationData(name, fingerprint, data.validation, data.test)
            if cache_dir is not None:
                target = _cache_file(Path(cache_dir), fingerprint, limit)
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
                save_file(
                    {
                        "validation_x": data.validation.features.contiguous(),
                        "validation_y": data.validation.labels.contiguous(),
                        "test_x": data.test.features.contiguous(),
                        "test_y": data.test.labels.contiguous(),
                    },
                    str(staging),
                )
                os.replace(staging, target)
            return found
    raise DatasetError(
        f"no split of dataset {name!r} (root {root or 'default'}) has the candidates' training "
        f"fingerprint {fingerprint}; validation utilities need the data they were trained on "
        f"(set {DATA_ROOT_ENV} if it lives elsewhere)"
    )
