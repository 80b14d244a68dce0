"""Where each dataset comes from, checked without reading it (docs/design.md#studies).

A command checks its dataset options here first, so a missing dataset, or a folder given to a
dataset that takes none, is refused in one line before torch loads or anything is written.
:func:`~dpmerge.data.datasets.load_dataset` then reads the files (and names a missing one).
"""

from __future__ import annotations

from pathlib import Path

from dpmerge.errors import DatasetError
from dpmerge.vocabulary import DatasetName, values

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FOLDERLESS = frozenset({DatasetName.DIGITS})
"""Datasets bundled with a library (scikit-learn's digits): a folder does not apply."""
OWN_DATA = {
    DatasetName.TABLE: "spec file",
    DatasetName.IMAGE_FOLDER: "spec file",
    DatasetName.NPZ: "spec file",
    DatasetName.HF_DATASET: "spec file",
    DatasetName.TOKENS: ".npz file",
}
"""Datasets of your own, each read through the one file given as the data root (and what that
file is); they share the ledger source :data:`OWN_SOURCE` (docs/design.md#your-data)."""
OWN_SOURCE = "own"
"""The one ledger source of every dataset of your own, whatever its kind."""
DEFAULT_ROOTS = {DatasetName.FASHION_MNIST: FASHION_MNIST_ROOT}
"""Where a dataset is found when no folder is given (its Debian package)."""


def check_source(name: str, root: str | Path | None) -> None:
    """Refuse (:class:`~dpmerge.errors.DatasetError`) an unknown dataset, a folder given to a
    dataset that takes none, a dataset whose folder is absent and a dataset of your own without
    its spec file."""
    if name not in values(DatasetName):
        raise DatasetError(f"unknown dataset {name!r}; known: {', '.join(values(DatasetName))}")
    dataset = DatasetName(name)
    if dataset in OWN_DATA:
        if root is None or not Path(root).is_file():
            given = "none was given" if root is None else f"{str(root)!r} is not a file"
            raise DatasetError(
                f"{name} reads the {OWN_DATA[dataset]} given as its data root "
                f"(--data-root FILE), but {given} (docs/design.md#your-data)"
            )
        return
    if dataset in FOLDERLESS:
        if root is not None:
            raise DatasetError(
                f"{name} is scikit-learn's bundled dataset and reads no folder, but the folder "
                f"{str(root)!r} was given; leave the folder out, or name the dataset it holds"
            )
        return
    folder = root if root is not None else DEFAULT_ROOTS.get(dataset)
    if folder is None:
        raise DatasetError(f"no folder given for {name}: it reads its files from a folder you name")
    if not Path(folder).is_dir():
        provider = "pass the folder holding its files"
        if dataset == DatasetName.FASHION_MNIST:
            provider = (
                f"install the Debian package {FASHION_MNIST_PACKAGE}, which provides "
                f"{FASHION_MNIST_ROOT}, or pass a folder holding the Fashion-MNIST IDX files"
            )
        raise DatasetError(f"dataset folder of {name} not found: {folder} ({provider})")


def default_dataset() -> str:
    """Fashion-MNIST where its Debian package is installed, else scikit-learn's digits."""
    installed = Path(FASHION_MNIST_ROOT).is_dir()
    return DatasetName.FASHION_MNIST.value if installed else DatasetName.DIGITS.value
