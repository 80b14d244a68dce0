"""Datasets for DP-SGD candidates: readers, disjoint splits and fingerprints
(docs/design.md#mechanism-record, docs/design.md#random-selection, docs/design.md#studies).

Names load on first use: :mod:`~dpmerge.data.sources` (where each dataset comes from) imports
neither numpy nor torch, so a command checks its dataset options before either loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DATASET_NAMES": "dpmerge.data.datasets",
    "load_dataset": "dpmerge.data.datasets",
    "FASHION_MNIST_PACKAGE": "dpmerge.data.sources",
    "FASHION_MNIST_ROOT": "dpmerge.data.sources",
    "check_source": "dpmerge.data.sources",
    "DatasetSplits": "dpmerge.data.splits",
    "RowDataset": "dpmerge.data.splits",
    "Split": "dpmerge.data.splits",
    "collate_batch": "dpmerge.data.splits",
    "fingerprint": "dpmerge.data.splits",
}
"""Public name → the module defining it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpmerge.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
