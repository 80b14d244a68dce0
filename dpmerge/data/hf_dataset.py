"""A Hugging Face dataset saved to disk (``Dataset.save_to_disk``), named by a spec file
(docs/design.md#your-data).

The spec is a table's (:mod:`dpmerge.data.table`): ``path`` (the saved folder), ``features``
(numeric scalar columns), ``label``, ``classes``, an optional ``unit`` column and the common
split keys. ``datasets.load_from_disk`` reads the folder, which must hold one ``Dataset`` (not a
``DatasetDict``: the keyed split is dpmerge's); its rows are then checked and split exactly as a
table's rows. The content digest hashes every file of the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dpmerge.data import own
from dpmerge.data.splits import DatasetSplits
from dpmerge.data.table import check_frame, frame_splits, read_spec
from dpmerge.errors import DatasetError
from dpmerge.formatting import cut
from dpmerge.vocabulary import DatasetName


def _frame(path: Path, spec_path: Path, limit: int | None) -> pd.DataFrame:
    """The saved dataset at ``path`` as a frame of its first ``limit`` rows."""
    import datasets

    if not path.is_dir():
        raise DatasetError(f"saved dataset not found: {path} (named by {spec_path})")
    if _data_files(path) == []:  # datasets 5.2 fails with an IndexError loading one
        raise DatasetError(f"{path}: no rows")
    try:
        saved = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as error:  # FileNotFoundError for a folder it does not know
        raise DatasetError(f"{path}: not a saved dataset ({cut(str(error), 200)})") from None
    if not isinstance(saved, datasets.Dataset):
        raise DatasetError(
            f"{path}: a DatasetDict ({', '.join(saved)}); save one Dataset, dpmerge splits it"
        )
    frame = saved.to_pandas().iloc[:limit].reset_index(drop=True)
    if frame.empty:
        raise DatasetError(f"{path}: no rows")
    return frame


def _data_files(path: Path) -> object:
    """The data files a saved ``Dataset``'s ``state.json`` lists (None without one)."""
    try:
        return json.loads((path / "state.json").read_text(encoding="utf-8")).get("_data_files")
    except (OSError, ValueError, AttributeError):
        return None


def load_hf_dataset(spec_path: str | Path, limit: int | None = None) -> DatasetSplits:
    """The saved dataset of the spec at ``spec_path`` (its first ``limit`` rows) in keyed
    splits; the fingerprint hashes the folder's files, the spec, the split key's id and the
    limit."""
    spec = read_spec(spec_path, DatasetName.HF_DATASET)
    frame = _frame(spec.path, spec.spec_path, limit)
    check_frame(spec, frame)
    files = [p for p in spec.path.rglob("*") if p.is_file()]
    content = own.files_digest(spec.path, files)
    return frame_splits(DatasetName.HF_DATASET, spec, frame, content, limit)
