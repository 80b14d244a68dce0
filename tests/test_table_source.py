"""A Parquet or CSV table as a dataset (dpmerge.data.table; docs/design.md#your-data): keyed
splits by unit, the identity the record names, and one line for each bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import dpmerge.cli
from dpmerge.data import load_dataset
from dpmerge.data.own import DEFAULT_FRACTIONS, DEFAULT_SPLIT_KEY, split_of
from dpmerge.errors import DatasetError
from dpmerge.vocabulary import SplitName


def table(rows: int = 200) -> pd.DataFrame:
    """Unit ``u<i>`` has one row whose feature ``a`` is ``i / 1000`` (so a split's rows name
    their units); ``y`` is learnable from ``b``."""
    rng = np.random.default_rng(7)
    b = rng.normal(size=rows)
    return pd.DataFrame(
        {
            "user": [f"u{i}" for i in range(rows)],
            "a": np.arange(rows) / 1000,
            "b": b,
            "y": (b > 0).astype(np.int64),
        }
    )


def write(folder: Path, frame: pd.DataFrame, name: str = "t.csv", **spec: object) -> Path:
    """Write ``frame`` as ``name`` (CSV or Parquet by its suffix) and its spec; the spec path."""
    folder.mkdir(parents=True, exist_ok=True)
    if name.endswith(".csv"):
        frame.to_csv(folder / name, index=False)
    else:
        frame.to_parquet(folder / name, index=False)
    declared = {"path": name, "features": ["a", "b"], "label": "y", "classes": [0, 1]}
    declared |= {"unit": "user"} | spec
    path = folder / "spec.json"
    path.write_text(json.dumps(declared))
    return path


def units_by_split(spec: Path) -> dict[str, set[int]]:
    data = load_dataset("table", spec)
    parts = {"train": data.train, "validation": data.validation, "test": data.test}
    return {
        name: {round(a * 1000) for a in part.features[:, 0].tolist()}
        for name, part in parts.items()
    }


def test_csv_and_parquet_split_each_unit_by_its_keyed_hash(tmp_path: Path) -> None:
    frame = table()
    csv = units_by_split(write(tmp_path / "csv", frame))
    parquet = units_by_split(write(tmp_path / "pq", frame, "t.parquet"))
    assert csv == parquet
    assert sorted(i for units in csv.values() for i in units) == list(range(len(frame)))
    for name, units in csv.items():  # each unit is where its hash alone sends it
        assert all(
            split_of(f"u{i}", DEFAULT_SPLIT_KEY, DEFAULT_FRACTIONS) == SplitName(name)
            for i in units
        )
    assert all(csv.values())  # no split is empty at 200 units


def test_split_is_stable_and_changes_with_the_key(tmp_path: Path) -> None:
    spec = write(tmp_path / "a", table())
    first, again = load_dataset("table", spec), load_dataset("table", spec)
    assert first.fingerprint == again.fingerprint
    assert units_by_split(spec) == units_by_split(spec)
    keyed = write(tmp_path / "b", table(), split_key="another key")
    assert units_by_split(keyed)["train"] != units_by_split(spec)["train"]
    assert load_dataset("table", keyed).fingerprint != first.fingerprint


def test_n_is_the_training_units_and_without_a_unit_column_a_row_is_a_unit(
    tmp_path: Path,
) -> None:
    spec = write(tmp_path / "unit", table())
    data = load_dataset("table", spec)
    assert data.dataset_size == len(units_by_split(spec)["train"])
    assert data.fingerprint.startswith("table-sha256:")
    assert (data.input_shape, data.num_classes) == ((2,), 2)
    rows = write(tmp_path / "rows", table().drop(columns="user"), unit=None)
    by_row = units_by_split(rows)
    assert all(
        split_of(str(i), DEFAULT_SPLIT_KEY, DEFAULT_FRACTIONS) == SplitName(name)
        for name, units in by_row.items()
        for i in units
    )


def test_identity_changes_when_one_cell_changes(tmp_path: Path) -> None:
    frame = table()
    before = load_dataset("table", write(tmp_path / "a", frame)).fingerprint
    frame.loc[5, "b"] += 1e-6
    assert load_dataset("table", write(tmp_path / "b", frame)).fingerprint != before


def _bad(frame: pd.DataFrame, change: str) -> tuple[pd.DataFrame, dict]:
    """``frame`` spoiled as ``change`` says, and the spec keys that go with it."""
    frame = frame.copy()
    if change == "missing column":
        return frame.drop(columns="b"), {}
    if change == "extra column":
        return frame.assign(z=1.0), {}
    if change == "non-numeric feature":
        frame["b"] = frame["b"].astype(str)  # a text column, one cell not a number
        frame.loc[3, "b"] = "abc"
        return frame, {}
    if change == "NaN":
        frame.loc[4, "a"] = np.nan
        return frame, {}
    if change == "one class":
        return frame.assign(y=1), {}
    if change == "label outside the classes":
        frame.loc[6, "y"] = 7
        return frame, {}
    assert change == "duplicate unit id"
    frame.loc[9, "user"] = "u2"
    return frame, {}


BAD = {
    "missing column": "missing column 'b'",
    "extra column": "column 'z' is not declared",
    "non-numeric feature": "column 'b', row 4: not a number ('abc')",
    "NaN": "column 'a', row 5: empty cell",
    "one class": "column 'y' holds one class only",
    "label outside the classes": "column 'y', row 7: label 7",
    "duplicate unit id": "column 'user', row 10: unit 'u2' also holds row 3",
}


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
@pytest.mark.parametrize("change", sorted(BAD))
def test_bad_table_is_one_line_naming_file_column_and_row(
    tmp_path: Path, change: str, suffix: str
) -> None:
    frame, spec = _bad(table(), change)
    path = write(tmp_path, frame, f"t.{suffix}", **spec)
    with pytest.raises(DatasetError) as refused:
        load_dataset("table", path)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / f"t.{suffix}")), message
    assert BAD[change] in message, message


def test_empty_file_and_bad_spec_are_one_line(tmp_path: Path) -> None:
    spec = write(tmp_path, table())
    (tmp_path / "t.csv").write_text("")
    with pytest.raises(DatasetError, match=r"t\.csv: empty file$"):
        load_dataset("table", spec)
    (tmp_path / "t.csv").write_text("user,a,b,y\n")
    with pytest.raises(DatasetError, match=r"t\.csv: no rows$"):
        load_dataset("table", spec)
    spec.write_text(json.dumps({"path": "t.csv", "features": ["a"], "label": "y", "class": [0]}))
    with pytest.raises(DatasetError, match=r"spec\.json: unknown key 'class'"):
        load_dataset("table", spec)


def test_a_yaml_spec_declares_the_same_dataset(tmp_path: Path) -> None:
    spec = write(tmp_path, table())
    declared = json.loads(spec.read_text())
    yaml_spec = tmp_path / "spec.yaml"
    yaml_spec.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in declared.items()))
    assert load_dataset("table", yaml_spec).fingerprint == load_dataset("table", spec).fingerprint
    yaml_spec.write_text(yaml_spec.read_text().replace("classes: [0, 1]", "classes: [[0], 1]"))
    with pytest.raises(DatasetError, match=r"spec\.yaml: classes must list"):
        load_dataset("table", yaml_spec)


def train(tmp_path: Path, spec: Path, out: Path) -> int:
    return dpmerge.cli.main(
        [
            *("train", "--dataset", "table", "--data-root", str(spec), "--model", "logreg"),
            *(
                "--noise-multiplier",
                "1.0",
                "--delta",
                "1e-3",
                "--batch-size",
                "32",
                "--epochs",
                "5",
            ),
            *("--out", str(out), "--no-progress", "--json"),
        ]
    )


def test_train_on_a_csv_table_records_its_identity_and_n(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write(tmp_path, table())
    data = load_dataset("table", spec)
    assert train(tmp_path, spec, tmp_path / "cand") == 0
    summary = json.loads(capsys.readouterr().out)
    record = json.loads((tmp_path / "cand" / "record.json").read_text())["record"]
    assert record["dataset"] == summary["dataset"] == data.fingerprint
    assert record["dataset_size"] == summary["dataset_size"] == data.dataset_size
    assert summary["validation_accuracy"] > 0.7  # b decides y


def test_train_on_a_bad_table_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frame, _ = _bad(table(), "NaN")
    spec = write(tmp_path, frame)
    assert train(tmp_path, spec, tmp_path / "cand") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "column 'a', row 5: empty cell" in err, err
    assert not (tmp_path / "cand").exists()
    assert train(tmp_path, tmp_path / "absent.json", tmp_path / "cand") == 2
    assert "is not a file" in capsys.readouterr().err
