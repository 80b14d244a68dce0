"""Where a study keeps its work: cached units, the table, the Markdown and the plots
(docs/design.md#studies).

A study is a list of *units* (one trained model, one calibrated merge at one target, …). Each
unit's result is a file under ``<results>/units/`` named by the unit's kind and a hash of
everything that determines it, written atomically once the unit is done; a rerun of the same
command finds it and skips the work, and a changed setting gives a new name, never a stale
result. The progress bar (tqdm, on stderr) counts units.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from dpmerge.formatting import epsilon_text

UNITS_DIR = "units"


def unit_key(kind: str, config: Mapping[str, Any]) -> str:
    """``<kind>-<16 hex digits>``: the hash covers the kind and every setting of the unit."""
    text = json.dumps({"kind": kind, **config}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a sibling temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as handle:
        handle.write(text)
    os.chmod(handle.name, 0o644)  # results are for reading (the temporary file was 0600)
    os.replace(handle.name, path)
    return path


@dataclass
class StudyFolder:
    """A study's results folder, its unit cache and a count of units computed and reused."""

    root: Path
    progress: bool = True
    computed: int = 0
    reused: int = 0
    _bar: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)  # created by the first write, so bad input leaves nothing

    def unit_path(self, kind: str, config: Mapping[str, Any], suffix: str = ".json") -> Path:
        return self.root / UNITS_DIR / f"{unit_key(kind, config)}{suffix}"

    def start(self, total: int, description: str) -> None:
        """Open the progress bar for ``total`` units."""
        self.close()
        self._bar = tqdm(total=total, desc=description, unit="unit", disable=not self.progress)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def done(self, computed: bool, label: str = "") -> None:
        """Count one finished unit (``computed`` now, or reused from an earlier run)."""
        if computed:
            self.computed += 1
        else:
            self.reused += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label[:40])
            self._bar.update()

    def cached(
        self, kind: str, config: Mapping[str, Any], compute: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """The unit's JSON result: read back if a run finished it, else computed and saved."""
        path = self.unit_path(kind, config)
        if path.is_file():
            self.done(False, kind)
            return json.loads(path.read_text())
        result = compute()
        write_atomic(path, json.dumps(result, indent=1, allow_nan=False))
        self.done(True, kind)
        return result

    def cached_dir(
        self, kind: str, config: Mapping[str, Any], build: Callable[[Path], Any]
    ) -> Path:
        """A unit whose result is a directory (a model): ``build(path)`` must create it
        atomically (as ``save_candidate`` does)."""
        path = self.unit_path(kind, config, suffix="")
        if path.is_dir():
            self.done(False, kind)
            return path
        build(path)
        self.done(True, kind)
        return path

    def result(
        self,
        study: str,
        files: Sequence[Path],
        params: Mapping[str, Any],
        metrics: Sequence[tuple[str, float, int]],
        summary: Mapping[str, Any],
        rows: Sequence[Mapping[str, Any]] = (),
    ) -> StudyResult:
        """What the study wrote, with this folder's count of units computed and reused."""
        return StudyResult(
            study,
            self.root,
            tuple(files),
            params,
            metrics,
            self.computed,
            self.reused,
            summary,
            rows,
        )

    def write_table(self, name: str, table: pd.DataFrame) -> Path:
        path = self.root / f"{name}.csv"
        write_atomic(path, table.to_csv(index=False))
        return path

    def write_text(self, name: str, text: str) -> Path:
        return write_atomic(self.root / name, text)


def markdown_table(table: pd.DataFrame, digits: int = 4) -> str:
    """A Markdown table of a DataFrame (floats to ``digits`` places, a column named ``epsilon``
    or ``epsilon_*`` rounded up like every ε shown to people, δ in full (``1e-05``, never
    ``0.0000``); missing values blank)."""

    def cell(column: str, value: Any) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return ""
        if str(column).startswith("epsilon") and isinstance(value, float):
            return epsilon_text(value)
        if str(column) in ("delta", "δ") and isinstance(value, float):
            return f"{value:g}"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    columns = list(table.columns)
    rows = [columns] + [
        [cell(c, v) for c, v in zip(columns, row, strict=True)] for row in table.itertuples(False)
    ]
    lines = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(table.columns))
    return "\n".join(lines)


@dataclass(frozen=True)
class StudyResult:
    """What a study wrote: its name, folder, files, the parameters and metrics to log, and how
    many units it computed now and reused from earlier runs."""

    study: str
    folder: Path
    files: tuple[Path, ...]
    params: Mapping[str, Any]
    metrics: Sequence[tuple[str, float, int]]
    computed: int
    reused: int
    summary: Mapping[str, Any] = field(default_factory=dict)
    rows: Sequence[Mapping[str, Any]] = ()

    def to_dict(self) -> dict[str, Any]:
        document = {
            "study": self.study,
            "folder": str(self.folder),
            "files": [str(f) for f in self.files],
            "units_computed": self.computed,
            "units_reused": self.reused,
            "summary": dict(self.summary),
        }
        return {**document, "rows": [dict(r) for r in self.rows]} if self.rows else document


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    series = pd.Series(list(values), dtype=float)
    return float(series.mean()), float(series.std(ddof=1)) if len(series) > 1 else 0.0
