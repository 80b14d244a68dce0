"""Dataset readers, splits and fingerprints (dpmerge.data; docs/design.md#mechanism-record,
docs/design.md#random-selection, docs/design.md#studies)."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dpmerge.data import FASHION_MNIST_PACKAGE, load_dataset
from dpmerge.data.datasets import FASHION_MNIST_ROOT
from dpmerge.data.readers import read_cifar_batch, read_idx
from dpmerge.errors import DatasetError

RNG = np.random.default_rng(0)


def write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def write_mnist_folder(root: Path, *, n_train: int, n_test: int, compress: bool) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": RNG.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": RNG.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": RNG.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": RNG.integers(0, 10, n_test, dtype=np.uint8),
    }
    for stem, array in arrays.items():
        write_idx(root / stem, array, compress=compress)
    return arrays


def write_cifar_folder(root: Path, n_per_batch: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": RNG.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in RNG.integers(0, 10, n_per_batch)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches[name] = batch
    return batches


@pytest.mark.parametrize("compress", [False, True])
def test_idx_reader_round_trips_plain_and_gzip(tmp_path: Path, compress: bool) -> None:
    array = RNG.integers(0, 256, (7, 5, 3), dtype=np.uint8)
    write_idx(tmp_path / "x-idx3-ubyte", array, compress=compress)
    path = tmp_path / ("x-idx3-ubyte.gz" if compress else "x-idx3-ubyte")
    np.testing.assert_array_equal(read_idx(path), array)
    np.testing.assert_array_equal(read_idx(path, limit=2), array[:2])


def test_idx_reader_rejects_truncated_and_foreign_files(tmp_path: Path) -> None:
    array = RNG.integers(0, 256, (4, 3), dtype=np.uint8)
    write_idx(tmp_path / "a", array, compress=False)
    (tmp_path / "short").write_bytes((tmp_path / "a").read_bytes()[:-1])
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(tmp_path / "short")
    (tmp_path / "text").write_bytes(b"hello world")
    with pytest.raises(DatasetError, match="not an IDX file"):
        read_idx(tmp_path / "text")


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_folder_loads_scaled_images_and_disjoint_splits(
    tmp_path: Path, compress: bool
) -> None:
    arrays = write_mnist_folder(tmp_path / "mnist", n_train=50, n_test=20, compress=compress)
    data = load_dataset("mnist", tmp_path / "mnist", validation_fraction=0.2)
    assert (len(data.train), len(data.validation), len(data.test)) == (40, 10, 20)
    assert data.input_shape == (1, 28, 28) and data.dataset_size == 40
    assert data.train.features.dtype == torch.float32 and data.train.labels.dtype == torch.int64
    assert float(data.train.features.min()) >= 0.0 and float(data.train.features.max()) <= 1.0
    # every training-file row lands in exactly one of train / validation
    source = torch.from_numpy(arrays["train-images-idx3-ubyte"]).float().div(255).flatten(1)
    rows = torch.cat([data.train.features, data.validation.features]).flatten(1)
    matches = (rows[:, None, :] == source[None, :, :]).all(-1)
    assert matches.sum(0).tolist() == [1] * 50
    np.testing.assert_array_equal(data.test.labels.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_cifar10_batches_load_as_chw_images(tmp_path: Path) -> None:
    batches = write_cifar_folder(tmp_path / "cifar-10-batches-py", n_per_batch=6)
    data = load_dataset("cifar10", tmp_path, validation_fraction=0.0)  # finds the subfolder
    assert data.input_shape == (3, 32, 32) and len(data.train) == 30 and len(data.test) == 6
    first = batches["data_batch_1"][b"data"][0].reshape(3, 32, 32) / 255.0
    np.testing.assert_allclose(data.train.features[0].numpy(), first, rtol=1e-6)
    assert data.train.labels[:6].tolist() == batches["data_batch_1"][b"labels"]


def test_cifar_reader_refuses_pickles_that_build_other_objects(tmp_path: Path) -> None:
    (tmp_path / "evil").write_bytes(pickle.dumps({b"data": Path("x"), b"labels": []}))
    with pytest.raises(DatasetError, match="refusing to load"):
        read_cifar_batch(tmp_path / "evil")


def test_digits_split_is_deterministic_and_seeded() -> None:
    a, b = load_dataset("digits", seed=3), load_dataset("digits", seed=3)
    c = load_dataset("digits", seed=4)
    assert torch.equal(a.train.features, b.train.features) and a.fingerprint == b.fingerprint
    assert not torch.equal(a.validation.labels, c.validation.labels)
    assert a.fingerprint != c.fingerprint  # different training rows
    assert torch.equal(a.test.features, c.test.features)  # the test split is fixed
    assert len(a.train) + len(a.validation) + len(a.test) == 1797
    assert a.input_shape == (1, 8, 8) and float(a.train.features.max()) == 1.0


def test_fingerprint_tracks_training_rows_only(tmp_path: Path) -> None:
    write_mnist_folder(tmp_path / "m", n_train=30, n_test=10, compress=False)

    def fingerprint(**kwargs: int) -> str:
        return load_dataset("mnist", tmp_path / "m", validation_fraction=0.0, **kwargs).fingerprint

    base, first_29 = fingerprint(), fingerprint(limit=29)
    assert fingerprint() == base and first_29 != base
    images = tmp_path / "m" / "train-images-idx3-ubyte"
    content = bytearray(images.read_bytes())
    content[-1] ^= 0xFF  # one pixel of the 30th training row
    images.write_bytes(bytes(content))
    assert fingerprint() != base
    assert fingerprint(limit=29) == first_29  # rows not trained on do not count


def test_missing_data_names_the_package_or_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=FASHION_MNIST_PACKAGE):
        load_dataset("fashion-mnist", tmp_path / "nowhere")
    write_mnist_folder(tmp_path / "partial", n_train=5, n_test=5, compress=True)
    (tmp_path / "partial" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetError, match="missing t10k-labels-idx1-ubyte"):
        load_dataset("mnist", tmp_path / "partial")
    with pytest.raises(DatasetError, match="no folder given for mnist"):
        load_dataset("mnist")
    with pytest.raises(DatasetError, match="data_batch_1"):
        load_dataset("cifar10", tmp_path)
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("imagenet")


def test_mismatched_image_and_label_counts_are_refused(tmp_path: Path) -> None:
    write_mnist_folder(tmp_path / "m", n_train=8, n_test=4, compress=False)
    write_idx(tmp_path / "m" / "train-labels-idx1-ubyte", np.zeros(7, np.uint8), compress=False)
    with pytest.raises(DatasetError, match="8 images, 7 labels"):
        load_dataset("mnist", tmp_path / "m")


@pytest.mark.skipif(
    not Path(FASHION_MNIST_ROOT).is_dir(), reason=f"{FASHION_MNIST_PACKAGE} not installed"
)
def test_fashion_mnist_from_the_debian_package() -> None:
    data = load_dataset("fashion-mnist", limit=300)
    assert data.root == FASHION_MNIST_ROOT
    assert (len(data.train), len(data.validation), len(data.test)) == (270, 30, 300)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
