"""Datasets for DP-SGD candidates: readers, disjoint splits and fingerprints
(docs/design.md#mechanism-record, docs/design.md#random-selection, docs/design.md#studies)."""

from dpmerge.data.datasets import DATASET_NAMES, FASHION_MNIST_PACKAGE, load_dataset
from dpmerge.data.splits import DatasetSplits, RowDataset, Split, collate_batch, fingerprint

__all__ = [
    "DATASET_NAMES",
    "FASHION_MNIST_PACKAGE",
    "DatasetSplits",
    "RowDataset",
    "Split",
    "collate_batch",
    "fingerprint",
    "load_dataset",
]
