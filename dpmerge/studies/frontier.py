"""The utility–privacy frontier of a set of candidates (docs/design.md#studies): for each
target ε, the best merge of each method and its test accuracy, beside the candidates themselves.

Calibration follows docs/design.md#calibration: every choice beyond the released subset (RS
probabilities, the generic gate's subset, the structured path) is data-independent; the
validation split (disjoint from training) only tunes the LC weights within the generic gate's
subset. Reported accuracies are on the test split; for RS the expected accuracy Σ π_i·acc_i
and, where asked, the accuracy of one simulated draw. Every ε is the certified gating bound of
the calibration, reported under PLD and RDP beside it.

A merge method is a :class:`MergeMethod`: adding one (say, a new option of ``calibrate``) is one
more entry in :data:`METHODS` (or in the ``methods`` a caller passes). ``lc-generic-rs`` may
calibrate to a secret draw between two subset merges; its accuracy is the expectation over the
draw.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dpmerge.accounting.bounds import PairBound
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelDir
from dpmerge.data import DatasetSplits
from dpmerge.errors import InfeasibleTargetError, RecordError
from dpmerge.evaluation import MergeAccuracy, expected_accuracy
from dpmerge.merging import draw_index
from dpmerge.studies.plots import figure, log_epsilon_axis
from dpmerge.vocabulary import GatingBound, Method


def bound_columns(bound: PairBound) -> dict[str, Any]:
    """A study row's privacy columns: the gating ε, the accountant that gave it, both
    accountants' values and δ (``docs/design.md``, Studies)."""
    return dict(
        epsilon=bound.epsilon,
        accountant=bound.accountant,
        epsilon_pld=bound.epsilon_pld,
        epsilon_rdp=bound.epsilon_rdp,
        delta=bound.delta,
    )


@dataclass(frozen=True)
class MergeMethod:
    """One merge method of the frontier: ``calibrate(records, method, target, delta,
    gating_bound=…, **options)``, reported under ``kind``."""

    kind: str
    method: Method
    gating_bound: GatingBound = "generic"
    options: tuple[tuple[str, Any], ...] = ()


RS = MergeMethod("rs", "rs")
LC_GENERIC = MergeMethod("lc-generic", "lc", "generic")
LC_GENERIC_INTERPOLATED = MergeMethod("lc-generic-rs", "lc", "generic", (("interpolate", True),))
"""LC under the generic gate that may release one of two subset merges, drawn secretly."""
LC_STRUCTURED = MergeMethod("lc-structured", "lc", "structured")
METHODS = (RS, LC_GENERIC, LC_GENERIC_INTERPOLATED, LC_STRUCTURED)
COLUMNS = [
    "kind",
    "target_epsilon",
    "epsilon",
    "accountant",
    "epsilon_pld",
    "epsilon_rdp",
    "delta",
    "test_accuracy",
    "validation_accuracy",
    "drawn_test_accuracy",
    "members",
    "per_example_gradients",
    "weights",
    "candidates",
]


class _Evaluator:
    """Validation and test accuracy of LC merges of the candidates, with the released merge's
    arithmetic (:class:`~dpmerge.evaluation.MergeAccuracy`), cached by weights."""

    def __init__(
        self, candidates: Sequence[ModelDir], data: DatasetSplits, device: str = "cpu"
    ) -> None:
        specs = {c.spec for c in candidates}
        if len(specs) != 1:
            raise RecordError("the candidates do not share one architecture")
        self.merges = MergeAccuracy(
            specs.pop(), [c.weights_file for c in candidates], device=device
        )
        self.data = data

    def accuracy(self, weights: Sequence[float], split: str) -> float:
        return self.merges.accuracy(weights, getattr(self.data, split))

    def merge_utility(self, weights: tuple[float, ...]) -> float:
        return self.accuracy(weights, "validation")


class FrontierContext:
    """The candidates of one frontier, their accuracies, and the rows of their merges."""

    def __init__(
        self,
        candidates: Sequence[ModelDir],
        data: DatasetSplits,
        delta: float,
        device: str = "cpu",
    ) -> None:
        records = [c.record for c in candidates]
        if any(r is None for r in records):
            raise RecordError("the frontier needs candidate directories (with mechanism records)")
        if any(r.dataset != data.fingerprint for r in records):  # type: ignore[union-attr]
            raise RecordError("the data's fingerprint differs from the candidates' training data")
        self.records: list[MechanismRecord] = records  # type: ignore[assignment]
        self.delta = delta
        self.evaluator = _Evaluator(candidates, data, device)
        self.names = [r.name for r in self.records]
        k = len(candidates)
        self.one_hot = [tuple(1.0 if n == i else 0.0 for n in range(k)) for i in range(k)]
        self.val_acc = [self.evaluator.accuracy(w, "validation") for w in self.one_hot]
        self.test_acc = [self.evaluator.accuracy(w, "test") for w in self.one_hot]

    def _row(
        self,
        kind: str,
        target: float | None,
        bound: PairBound,
        weights: Sequence[float],
        test: float,
        validation: float,
        drawn: float | None = None,
    ) -> dict[str, Any]:
        used = [r for r, w in zip(self.records, weights, strict=True) if w > 0]
        return dict(
            kind=kind,
            target_epsilon=target,
            **bound_columns(bound),
            test_accuracy=test,
            validation_accuracy=validation,
            drawn_test_accuracy=drawn,
            members=len(used),
            per_example_gradients=sum(r.expected_batch_size * r.steps for r in used),
            weights=json.dumps([round(w, 6) for w in weights]),
            candidates=json.dumps(self.names),
        )

    def candidate_rows(self) -> list[dict[str, Any]]:
        return [
            self._row(
                "candidate",
                None,
                candidate_bound(record, self.delta),
                self.one_hot[i],
                self.test_acc[i],
                self.val_acc[i],
            )
            for i, record in enumerate(self.records)
        ]

    def rows_at(
        self,
        target: float,
        methods: Sequence[MergeMethod] = METHODS,
        draw: random.Random | None = None,
    ) -> list[dict[str, Any]]:
        """One row per method feasible at ``target``. With ``draw`` (a seeded generator: a
        study's simulated release, not a secret draw), RS rows also hold the test accuracy
        of one drawn candidate."""
        rows = []
        for spec in methods:
            tunable = (spec.method, spec.gating_bound) == ("lc", "generic")
            try:
                result = calibrate(
                    self.records,
                    spec.method,
                    float(target),
                    self.delta,
                    gating_bound=spec.gating_bound,
                    merge_utility=self.evaluator.merge_utility if tunable else None,
                    **dict(spec.options),
                )
            except InfeasibleTargetError:
                continue
            drawn = None
            if result.mixture is not None:  # one of two LC merges, drawn with these odds
                merges, odds = result.mixture.weights, result.mixture.probabilities
                test = expected_accuracy([self.evaluator.accuracy(w, "test") for w in merges], odds)
                validation = expected_accuracy(
                    [self.evaluator.accuracy(w, "validation") for w in merges], odds
                )
                if draw is not None:
                    drawn = self.evaluator.accuracy(merges[draw_index(odds, rng=draw)], "test")
                weights = tuple(max(a, b) for a, b in zip(*merges, strict=True))  # members used
            elif spec.method == "rs":
                weights = tuple(result.weights)
                test = expected_accuracy(self.test_acc, weights)
                validation = expected_accuracy(self.val_acc, weights)
                if draw is not None:
                    drawn = self.test_acc[draw_index(weights, rng=draw)]
            else:
                weights = tuple(result.weights)
                test = self.evaluator.accuracy(weights, "test")
                validation = self.evaluator.accuracy(weights, "validation")
            row = self._row(
                spec.kind, float(target), result.report.gating, weights, test, validation, drawn
            )
            if result.mixture is not None:
                row["weights"] = json.dumps(result.mixture.to_dict()["merges"])
            rows.append(row)
        return rows


def frontier(
    candidates: Sequence[ModelDir],
    data: DatasetSplits,
    targets: Sequence[float],
    delta: float,
    methods: Sequence[MergeMethod] = METHODS,
) -> pd.DataFrame:
    """One row per candidate and per (target, method); infeasible targets get no row."""
    context = FrontierContext(candidates, data, delta)
    rows = context.candidate_rows()
    for target in targets:
        rows += context.rows_at(target, methods)
    return pd.DataFrame(rows, columns=COLUMNS)


def plot_frontier(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Accuracy versus certified ε: candidates as points, one line per method (merges and
    retrains). With a ``test_accuracy_std`` column (a study's mean over seeds) each point gets
    an error bar; with a ``group`` column, one panel per group."""
    path = Path(path)
    groups = list(table.group.unique()) if "group" in table else [None]
    several = groups != [None]
    with figure(path, len(groups), size=(7, 4.8), title=title if several else "") as panels:
        for axes, label in zip(panels, groups, strict=True):
            part = table if label is None else table[table.group == label]
            for kind, rows in part.groupby("kind", sort=False):
                rows = rows.sort_values("epsilon")
                spread = rows.test_accuracy_std if "test_accuracy_std" in rows else None
                style = (
                    dict(fmt="o", color="black", zorder=3, label="candidates")
                    if kind == "candidate"
                    else dict(fmt="-o", markersize=3, capsize=2, label=kind)
                )
                axes.errorbar(rows.epsilon, rows.test_accuracy, yerr=spread, **style)
            log_epsilon_axis(axes, f"certified ε (δ = {table.delta.iloc[0]:g})")
            axes.set_title(label or title or "privacy–utility frontier")
        panels[0].set_ylabel("test accuracy (RS: expected)")
    return path
