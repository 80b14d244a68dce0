"""The diamonds preparer (dpmerge.studies.diamonds; docs/design.md#second-dataset-diamonds) on a
small file in the package's format: the spec it writes loads as a table, every feature is the
documented fixed transform of its own row, and a bad file is refused with nothing written."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import dpmerge.cli
from dpmerge.data import load_dataset
from dpmerge.errors import DatasetError
from dpmerge.studies import diamonds
from dpmerge.studies.diamonds import CUTS, FEATURES, prepare_diamonds

ROWS = [
    # carat, cut, color, clarity, depth, table, price, x, y, z (the package's first rows' shape)
    (0.23, "Ideal", "E", "SI2", 61.5, 55.0, 326, 3.95, 3.98, 2.43),
    (0.21, "Premium", "E", "SI1", 59.8, 61.0, 326, 3.89, 3.84, 2.31),
    (0.23, "Good", "E", "VS1", 56.9, 65.0, 327, 4.05, 4.07, 2.31),
    (1.00, "Fair", "J", "I1", 70.0, 50.0, 10000, 0.0, 0.0, 0.0),
    (2.50, "Very Good", "D", "IF", 62.0, 58.0, 18823, 8.7, 8.6, 5.4),
]


def source(folder: Path, rows: int = 60, **changes: object) -> Path:
    """A CSV in the package's format: ``ROWS`` repeated to ``rows`` rows, ``changes`` setting a
    column's first cell (``column=value``) or dropping it (``column=None``)."""
    frame = pd.DataFrame([ROWS[i % len(ROWS)] for i in range(rows)], columns=list(diamonds.COLUMNS))
    for column, value in changes.items():
        if value is None:
            frame = frame.drop(columns=column)
        else:
            frame[column] = frame[column].astype(object)
            frame.loc[0, column] = value
    folder.mkdir(parents=True, exist_ok=True)
    frame.to_csv(folder / "diamonds.csv", index=False)
    return folder / "diamonds.csv"


def test_the_prepared_table_loads_with_five_grades_and_fixed_features(tmp_path: Path) -> None:
    prepared = prepare_diamonds(tmp_path / "out", source(tmp_path))
    assert prepared.rows == 60
    data = load_dataset("table", prepared.spec)
    assert data.num_classes == len(CUTS) == 5
    assert data.input_shape == (len(FEATURES),)
    assert len(data.train) + len(data.validation) + len(data.test) == 60
    table = pd.read_parquet(prepared.table)
    assert list(table.columns) == [*FEATURES, "cut"]
    first, fourth = table.iloc[0], table.iloc[3]
    expected_first = {
        "log_carat": math.log(0.23),
        "log_price": math.log10(326) - 3.5,
        "depth": 0.15,
        "depth_squared": 0.0225,
        "table": -0.5,
        "table_squared": 0.25,
        "colour": 5 / 6,  # E: the sixth of J…D
        "clarity": 1 / 7,  # SI2: the second of I1…IF
    }
    for name, value in expected_first.items():
        assert first[name] == pytest.approx(value, abs=1e-6), name
    assert (fourth.colour, fourth.clarity, fourth.cut) == (0.0, 0.0, "Fair")
    assert fourth.log_price == pytest.approx(0.5)  # log10(10,000) − 3.5
    # x, y and z never enter (the fourth row's zeros would have no logarithm)
    assert not {"x", "y", "z"} & set(table.columns)


def test_a_rows_features_do_not_depend_on_the_other_rows(tmp_path: Path) -> None:
    """No statistic of the data is used: the first rows prepare the same alone or among more."""
    few = pd.read_parquet(prepare_diamonds(tmp_path / "a", source(tmp_path / "s5", 5)).table)
    many = pd.read_parquet(prepare_diamonds(tmp_path / "b", source(tmp_path / "s60")).table)
    pd.testing.assert_frame_equal(few, many.iloc[:5])
    assert np.isfinite(many[list(FEATURES)].to_numpy()).all()


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"cut": "Excellent"}, "column 'cut', row 1: 'Excellent' is not one of"),
        ({"clarity": "SI3"}, "column 'clarity', row 1: 'SI3'"),
        ({"price": 0}, "column 'price', row 1: not a positive number"),
        ({"carat": "heavy"}, "column 'carat', row 1: not a positive number"),
        ({"depth": None}, "missing column 'depth'"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, changes: dict, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    csv, out = source(tmp_path, **changes), tmp_path / "out"
    with pytest.raises(DatasetError, match=said.replace("(", r"\(")):
        prepare_diamonds(out, csv)
    code = dpmerge.cli.main(["study", "diamonds-table", "--out", str(out), "--source", str(csv)])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_the_command_writes_the_spec_and_names_the_package_when_it_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["study", "diamonds-table", "--out", str(out), "--source", str(source(tmp_path))]
    assert dpmerge.cli.main(args) == 0
    assert "60 rows" in capsys.readouterr().out and (out / "diamonds.json").is_file()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert dpmerge.cli.main(["study", "diamonds-table", "--out", str(tmp_path / "o2")]) == 2
    assert "PyPI package plotnine is not installed" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_the_frontier_study_runs_on_the_prepared_table(tmp_path: Path) -> None:
    """``dpmerge study frontier --dataset table --data-root SPEC``: the candidates train on the
    table (the record names its fingerprint) and every point meets its target."""
    spec = prepare_diamonds(tmp_path / "data", source(tmp_path, rows=400)).spec
    results = tmp_path / "results"
    args = ["study", "frontier", "--dataset", "table", "--data-root", str(spec)]
    args += ["--sigmas", "1,3", "--grid", "2", "--seeds", "1", "--epochs", "1"]
    args += ["--batch-size", "32", "--no-structured", "--no-compute-matched"]
    assert dpmerge.cli.main([*args, "--no-mlflow", "--no-progress", "--results", str(results)]) == 0
    table = pd.read_csv(results / "frontier.csv")
    assert set(table.kind) >= {"candidate", "auto", "retrain"}
    points = table[table.kind != "candidate"]
    assert (points.epsilon <= points.target_epsilon * (1 + 1e-9)).all()
    fingerprint = load_dataset("table", spec).fingerprint
    records = [json.loads(p.read_text()) for p in results.glob("units/model-*/record.json")]
    assert records and {r["record"]["dataset"] for r in records} == {fingerprint}
