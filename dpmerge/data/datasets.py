"""The supported datasets and :func:`load_dataset` (docs/design.md#studies).

| name            | source                                                              |
|-----------------|---------------------------------------------------------------------|
| ``digits``      | scikit-learn's bundled 8×8 digits (always available; the small set)  |
| ``fashion-mnist`` | IDX files of the Debian package ``dataset-fashion-mnist``          |
| ``mnist``       | IDX files in a folder you provide                                   |
| ``cifar10``     | the python-pickle batches in a folder you provide                   |
| ``table``       | a Parquet or CSV table named by a spec file (:mod:`dpmerge.data.table`) |
| ``image-folder`` | images in class sub-folders named by a spec file (:mod:`dpmerge.data.images`) |
| ``npz``         | a NumPy ``.npz`` named by a spec file (:mod:`dpmerge.data.npz`)     |
| ``hf-dataset``  | a saved Hugging Face dataset (:mod:`dpmerge.data.hf_dataset`)       |
| ``tokens``      | token sequences in an ``.npz`` file (:mod:`dpmerge.data.tokens`)     |

Nothing is downloaded: a missing file raises :class:`~dpmerge.errors.DatasetError` naming the
package or folder that provides it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpmerge.data.hf_dataset import load_hf_dataset
from dpmerge.data.images import load_images
from dpmerge.data.npz import load_npz
from dpmerge.data.readers import find_file, read_cifar_batch, read_idx
from dpmerge.data.sources import FASHION_MNIST_PACKAGE, FASHION_MNIST_ROOT
from dpmerge.data.splits import DatasetSplits, make_splits
from dpmerge.data.table import load_table
from dpmerge.data.tokens import load_tokens
from dpmerge.errors import DatasetError
from dpmerge.vocabulary import DatasetName, values

DIGITS_TEST_FRACTION = 0.2
DIGITS_TEST_SEED = 20_240_601
"""The digits test split is fixed (independent of ``seed``) so test accuracies compare."""

_IDX_STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

RawArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _digits(root: Path | None, limit: int | None) -> RawArrays:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.uint8)  # integer intensities 0..16
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_TEST_SEED).permutation(len(labels))
    n_test = round(len(labels) * DIGITS_TEST_FRACTION)
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return images[train][:limit], labels[train][:limit], images[test][:limit], labels[test][:limit]


def _idx(root: Path, limit: int | None, provider: str) -> RawArrays:
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root} ({provider})")
    paths = {}
    for key, stem in _IDX_STEMS.items():
        path = find_file(root, stem)
        if path is None:
            raise DatasetError(f"{root}: missing {stem}[.gz] ({provider})")
        paths[key] = path
    return tuple(read_idx(paths[key], limit) for key in _IDX_STEMS)  # type: ignore[return-value]


def _fashion_mnist(root: Path | None, limit: int | None) -> RawArrays:
    provider = (
        f"install the Debian package {FASHION_MNIST_PACKAGE}, which provides "
        f"{FASHION_MNIST_ROOT}, or pass a folder holding the Fashion-MNIST IDX files"
    )
    return _idx(root or Path(FASHION_MNIST_ROOT), limit, provider)


def _mnist(root: Path | None, limit: int | None) -> RawArrays:
    provider = "MNIST needs a folder holding its four IDX files (plain or .gz); pass it as root"
    if root is None:
        raise DatasetError(f"no folder given for mnist: {provider}")
    return _idx(root, limit, provider)


def _cifar10(root: Path | None, limit: int | None) -> RawArrays:
    provider = (
        "CIFAR-10 needs the folder of its python batches "
        "(data_batch_1..data_batch_5, test_batch; e.g. cifar-10-batches-py)"
    )
    if root is None:
        raise DatasetError(f"no folder given for cifar10: {provider}")
    if not (root / "data_batch_1").is_file() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise DatasetError(f"{root}: missing {', '.join(missing)} ({provider})")
    train = [read_cifar_batch(root / name) for name in names[:5]]
    test_images, test_labels = read_cifar_batch(root / "test_batch", limit)
    train_images = np.concatenate([images for images, _ in train])[:limit]
    train_labels = np.concatenate([labels for _, labels in train])[:limit]
    return train_images, train_labels, test_images, test_labels


_LOADERS: dict[DatasetName, tuple[Callable[[Path | None, int | None], RawArrays], int, float]] = {
    # name: (reader, number of classes, pixel scale to [0, 1])
    DatasetName.DIGITS: (_digits, 10, 16.0),
    DatasetName.FASHION_MNIST: (_fashion_mnist, 10, 255.0),
    DatasetName.MNIST: (_mnist, 10, 255.0),
    DatasetName.CIFAR10: (_cifar10, 10, 255.0),
}
DATASET_NAMES = values(DatasetName)
_OWN: dict[DatasetName, tuple[Callable[[Path, int | None], DatasetSplits], str]] = {
    # name: (reader of the spec file, the model's input in words)
    DatasetName.TABLE: (
        load_table,
        "float32 array (n, features): the declared feature columns as stored",
    ),
    DatasetName.IMAGE_FOLDER: (
        load_images,
        "float32 array (n, channels, height, width): the raw pixel values divided by 255, "
        "at the declared size and mode",
    ),
    DatasetName.NPZ: (load_npz, "float32 array (n, ...): the declared features array as stored"),
    DatasetName.HF_DATASET: (
        load_hf_dataset,
        "float32 array (n, features): the declared feature columns as stored",
    ),
    DatasetName.TOKENS: (
        load_tokens,
        "int64 array (n, 2, length): token ids stacked over their attention mask",
    ),
}
"""Datasets of your own (docs/design.md#your-data), each read from its spec file (``tokens``:
from its ``.npz`` file, docs/design.md#fine-tuning)."""


def preprocessing(name: str) -> str:
    """How raw images of dataset ``name`` become a model's input, in words (a served model's
    MLflow metadata and the README say it): channels first, pixels divided by the scale."""
    if name in _OWN:
        return _OWN[DatasetName(name)][1]
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")
    scale = _LOADERS[DatasetName(name)][2]
    return (
        f"float32 array (n, channels, height, width): the raw pixel values divided by {scale:g} "
        "(so in [0, 1]), grey-scale images with one channel"
        if name != DatasetName.CIFAR10
        else f"float32 array (n, 3, 32, 32): the raw RGB pixel values divided by {scale:g}"
    )


def load_dataset(
    name: str,
    root: str | Path | None = None,
    *,
    seed: int = 0,
    validation_fraction: float = 0.1,
    limit: int | None = None,
) -> DatasetSplits:
    """Load ``name`` from ``root`` (or its default place) into disjoint splits.

    ``limit`` keeps the first ``limit`` rows of the training file and of the test file before
    the validation split is carved; the fingerprint covers the rows actually trained on.
    A dataset of your own (``table``, ``image-folder``, ``npz``, ``hf-dataset``) reads the spec
    file ``root`` and splits by its keyed hash (``seed`` and ``validation_fraction`` do not
    apply: docs/design.md#your-data).
    """
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be a positive number of rows, got {limit}")
    if name in _OWN:
        if root is None:
            raise DatasetError(f"no file given for {name}: pass it as root")
        return _OWN[DatasetName(name)][0](Path(root), limit)
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")
    reader, num_classes, scale = _LOADERS[name]
    root_path = Path(root) if root is not None else None
    train_images, train_labels, test_images, test_labels = reader(root_path, limit)
    return make_splits(
        name,
        train_images=train_images,
        train_labels=train_labels,
        test_images=test_images,
        test_labels=test_labels,
        num_classes=num_classes,
        scale=scale,
        seed=seed,
        validation_fraction=validation_fraction,
        root=str(root_path) if root_path is not None else _default_root(name),
    )


def _default_root(name: str) -> str | None:
    return FASHION_MNIST_ROOT if name == "fashion-mnist" else None
