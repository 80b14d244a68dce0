"""Train / validation / test splits and the dataset fingerprint (docs/design.md#mechanism-record,
docs/design.md#random-selection).

The validation split is carved from the training file with a seeded permutation, so it is
disjoint from the rows DP-SGD trains on: utilities measured on it are not computed on the
training set (docs/design.md#random-selection). The fingerprint hashes exactly the training rows,
so it names the data
the mechanism record's privacy claim is about (docs/design.md#mechanism-record "dataset
fingerprint, n").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from dpmerge.errors import DatasetError


@dataclass(frozen=True, eq=False)
class Split:
    """Feature rows (float32, images as (C, H, W)) and their int64 labels."""

    features: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def as_dataset(self) -> RowDataset:
        return RowDataset(self.features, self.labels)


class RowDataset(Dataset):
    """A map-style dataset over two tensors that also serves whole batches.

    ``__getitems__`` lets ``DataLoader`` fetch a sampled batch with one tensor index instead of
    one ``__getitem__`` per row and a stack; it returns a one-element list so Opacus' empty-batch
    collate wrapper sees a non-empty list even for an empty Poisson batch, and ``collate_batch``
    unwraps it.
    """

    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features = features
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[index], self.labels[index]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = torch.as_tensor(indices, dtype=torch.long)
        return [(self.features.index_select(0, rows), self.labels.index_select(0, rows))]


def collate_batch(
    batch: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate function for :class:`RowDataset` loaders: the batch is already stacked."""
    return batch[0]


@dataclass(frozen=True, eq=False)
class DatasetSplits:
    """A loaded dataset: disjoint train / validation / test splits and the training fingerprint."""

    name: str
    train: Split
    validation: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    fingerprint: str
    root: str | None

    @property
    def dataset_size(self) -> int:
        """n of the mechanism record: the number of training rows."""
        return len(self.train)


def fingerprint(name: str, split: Split) -> str:
    """SHA-256 of the dataset name, shapes, features and labels of the training rows."""
    digest = hashlib.sha256()
    digest.update(name.encode())
    digest.update(repr((tuple(split.features.shape), str(split.features.dtype))).encode())
    digest.update(split.features.contiguous().numpy().tobytes())
    digest.update(split.labels.contiguous().numpy().tobytes())
    return f"{name}-sha256:{digest.hexdigest()[:32]}"


def make_splits(
    name: str,
    *,
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    scale: float,
    seed: int,
    validation_fraction: float,
    root: str | None,
) -> DatasetSplits:
    """Scale pixels to [0, 1], carve a seeded validation split and fingerprint the training rows.

    Images arrive as (N, C, H, W) or (N, H, W) integer arrays; labels as (N,) integers.
    """
    if not 0 <= validation_fraction < 1:
        raise DatasetError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    for part, images, labels in (
        ("train", train_images, train_labels),
        ("test", test_images, test_labels),
    ):
        if images.shape[0] != labels.shape[0]:
            raise DatasetError(
                f"{name}: {part} images and labels disagree "
                f"({images.shape[0]} images, {labels.shape[0]} labels)"
            )
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise DatasetError(f"{name}: {part} labels outside 0..{num_classes - 1}")
    train_x, test_x = (_to_features(images, scale) for images in (train_images, test_images))
    train_y, test_y = (
        torch.from_numpy(labels.astype(np.int64)) for labels in (train_labels, test_labels)
    )
    n = train_x.shape[0]
    n_validation = round(n * validation_fraction)
    if n - n_validation < 1:
        raise DatasetError(f"{name}: no training rows left after the validation split")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    validation_rows = order[:n_validation].sort().values
    train_rows = order[n_validation:].sort().values
    train = Split(train_x[train_rows], train_y[train_rows])
    return DatasetSplits(
        name=name,
        train=train,
        validation=Split(train_x[validation_rows], train_y[validation_rows]),
        test=Split(test_x, test_y),
        num_classes=num_classes,
        input_shape=tuple(train_x.shape[1:]),
        fingerprint=fingerprint(name, train),
        root=root,
    )


def _to_features(images: np.ndarray, scale: float) -> torch.Tensor:
    if images.ndim == 3:
        images = images[:, None, :, :]
    if images.ndim != 4:
        raise DatasetError(
            f"expected images of shape (N, C, H, W) or (N, H, W), got {images.shape}"
        )
    return torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32) / np.float32(scale))
