"""Write an IDX image set (Fashion-MNIST) as CIFAR-10 python batches, to run the CIFAR-format
path of ``dpmerge study non-convex --model resnet18-gn --dataset cifar10`` where CIFAR-10
itself is not on disk (docs/results.md says which data each run used).

Each 28×28 grey image is zero-padded to 32×32 and repeated over three channels; the 60,000
training rows go to data_batch_1..5 (12,000 each), the 10,000 test rows to test_batch.

    python scripts/idx_to_cifar_format.py /usr/share/datasets/fashion-mnist OUT_DIR
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np

from dpmerge.data.readers import find_file, read_idx


def convert(images: np.ndarray) -> np.ndarray:
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[:, None], 3, axis=1).reshape(len(images), 3 * 32 * 32)


def main(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    read = {
        stem: read_idx(find_file(source, stem))
        for stem in (
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        )
    }
    train = convert(read["train-images-idx3-ubyte"])
    labels = read["train-labels-idx1-ubyte"].astype(int)
    for i, rows in enumerate(np.array_split(np.arange(len(train)), 5), start=1):
        batch = {b"data": train[rows], b"labels": labels[rows].tolist()}
        (out / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    test = {
        b"data": convert(read["t10k-images-idx3-ubyte"]),
        b"labels": read["t10k-labels-idx1-ubyte"].astype(int).tolist(),
    }
    (out / "test_batch").write_bytes(pickle.dumps(test))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
