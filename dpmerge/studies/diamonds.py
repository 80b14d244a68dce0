"""A second real dataset for the convex study: ggplot2's *diamonds* as plotnine ships it
(docs/design.md#second-dataset-diamonds).

:func:`prepare_diamonds` turns the package's ``diamonds.csv`` (53,940 diamonds: carat, cut,
colour, clarity, depth, table, price, x, y, z) into a Parquet table and a spec for
:mod:`dpmerge.data.table`: the label is ``cut`` (five grades), the features are fixed
transforms of the other columns. No constant is computed from the rows: the logarithms, the
round centres and scales of the percentages and the grade orders are written here, so the
preparation is the same function of each row whatever the other rows hold (one diamond's
presence changes only its own row). ``x``, ``y`` and ``z`` are left out: the millimetre sizes
repeat carat and depth, and a few rows hold 0 there (no logarithm).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dpmerge.errors import DatasetError
from dpmerge.formatting import cut as cut_text

PACKAGE = "plotnine"
"""The PyPI package whose ``data/diamonds.csv`` is read (the ``diamonds`` extra installs it)."""
CUTS = ("Fair", "Good", "Very Good", "Premium", "Ideal")
"""The label's classes, worst to best grade."""
COLOURS = ("J", "I", "H", "G", "F", "E", "D")
"""Colour grades, worst (J) to best (D): a grade's feature is its place / 6, in [0, 1]."""
CLARITIES = ("I1", "SI2", "SI1", "VS2", "VS1", "VVS2", "VVS1", "IF")
"""Clarity grades, worst (I1) to best (IF): a grade's feature is its place / 7, in [0, 1]."""
COLUMNS = ("carat", "cut", "color", "clarity", "depth", "table", "price", "x", "y", "z")
FEATURES = (
    "log_carat",
    "log_price",
    "depth",
    "depth_squared",
    "table",
    "table_squared",
    "colour",
    "clarity",
)
PERCENT_CENTRE, PERCENT_SCALE = 60.0, 10.0
"""Depth and table are percentages (of the mean girdle diameter); each enters as
(value − 60) / 10 and its square, so the model can prefer a band of proportions."""
PRICE_CENTRE = 3.5
"""log10 of the price in US dollars, minus 3.5 (prices of 10²·⁵–10⁴·³ dollars fall in ±1)."""
TABLE_FILE, SPEC_FILE = "diamonds.parquet", "diamonds.json"


@dataclass(frozen=True)
class DiamondsTable:
    """A prepared table: its spec (``--dataset table --data-root SPEC``), its file, its rows."""

    spec: Path
    table: Path
    rows: int


def package_csv() -> Path:
    """plotnine's ``data/diamonds.csv``, found without importing plotnine."""
    found = importlib.util.find_spec(PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise DatasetError(
            f"the PyPI package {PACKAGE} is not installed (pip install 'dpmerge[diamonds]'), "
            "or pass the diamonds CSV itself"
        )
    return Path(next(iter(found.submodule_search_locations))) / "data" / "diamonds.csv"


def features(raw: pd.DataFrame) -> pd.DataFrame:
    """The fixed, row-wise transforms of the diamonds columns, and the label ``cut``."""
    depth = (raw["depth"] - PERCENT_CENTRE) / PERCENT_SCALE
    table = (raw["table"] - PERCENT_CENTRE) / PERCENT_SCALE
    out = pd.DataFrame(
        {
            "log_carat": np.log(raw["carat"]),
            "log_price": np.log10(raw["price"]) - PRICE_CENTRE,
            "depth": depth,
            "depth_squared": depth**2,
            "table": table,
            "table_squared": table**2,
            "colour": raw["color"].map({g: i / 6 for i, g in enumerate(COLOURS)}),
            "clarity": raw["clarity"].map({g: i / 7 for i, g in enumerate(CLARITIES)}),
            "cut": raw["cut"],
        }
    )
    return out.astype({name: np.float32 for name in FEATURES})


def _read(source: Path) -> pd.DataFrame:
    if not source.is_file():
        raise DatasetError(f"diamonds CSV not found: {source}")
    try:
        raw = pd.read_csv(source)
    except (OSError, ValueError) as error:
        raise DatasetError(f"{source}: unreadable CSV ({cut_text(str(error), 200)})") from None
    missing = [c for c in COLUMNS if c not in raw.columns]
    if missing:
        raise DatasetError(f"{source}: missing column {missing[0]!r} (diamonds has {COLUMNS})")
    for column, grades in (("cut", CUTS), ("color", COLOURS), ("clarity", CLARITIES)):
        outside = np.flatnonzero(~raw[column].isin(grades).to_numpy())
        if outside.size:
            row = int(outside[0])
            raise DatasetError(
                f"{source}: column {column!r}, row {row + 1}: {raw[column].iloc[row]!r} is not "
                f"one of {list(grades)}"
            )
    for column in ("carat", "price"):
        values = pd.to_numeric(raw[column], errors="coerce")
        bad = np.flatnonzero(~(values > 0).to_numpy())
        if bad.size:
            raise DatasetError(
                f"{source}: column {column!r}, row {bad[0] + 1}: not a positive number"
            )
    for column in ("depth", "table"):
        if not pd.api.types.is_numeric_dtype(raw[column]) or raw[column].isna().any():
            raise DatasetError(f"{source}: column {column!r} must hold numbers in every row")
    return raw


def prepare_diamonds(out: str | Path, source: str | Path | None = None) -> DiamondsTable:
    """Write ``diamonds.parquet`` and its spec ``diamonds.json`` under ``out`` from ``source``
    (default: plotnine's copy); rows keep the file's order, one diamond one privacy unit."""
    source = Path(source) if source is not None else package_csv()
    frame = features(_read(source))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table, spec = out / TABLE_FILE, out / SPEC_FILE
    frame.to_parquet(table, index=False)
    declared = {"path": TABLE_FILE, "features": list(FEATURES), "label": "cut"}
    spec.write_text(json.dumps({**declared, "classes": list(CUTS)}, indent=2) + "\n")
    return DiamondsTable(spec=spec, table=table, rows=len(frame))
