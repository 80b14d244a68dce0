"""The utility–privacy frontier of a set of candidates (docs/design.md#studies): for each
target ε, the best merge of each method and its test accuracy, beside the candidates themselves.

Calibration follows docs/design.md#calibration: every choice (RS probabilities, the generic
gate's subset, the mixture's rungs and odds, the structured path, which method ``auto``
releases) is data-independent, and LC weights within a subset are the default
inverse-variance ones (the studies report the default; tuning them on validation accuracy is
opt-in and not used here). Reported accuracies are on the test split; for RS and the mixture
the expected accuracy over the draw and, where asked, the accuracy of one simulated draw. Every
ε is the certified gating bound of the calibration, reported under PLD and RDP beside it.

A merge method is a :class:`MergeMethod`: adding one (say, a new option of ``calibrate``) is one
more entry in :data:`METHODS` (or in the ``methods`` a caller passes). ``auto`` is the provable
default: among RS, LC (generic gate) and the mixture, the release
``dpmerge.accounting.choice.choose_method`` picks from the records.
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
from dpmerge.accounting.calibrated import Calibration
from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.choice import choose_method
from dpmerge.accounting.private_selection import SELECTION_EPSILON, noisy_max
from dpmerge.accounting.records import MechanismRecord
from dpmerge.accounting.tuning import option_counts, tuned_release, tuning_plan
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


AUTO_METHOD = "auto"
AUTO_CHOICES = (Method.RS, Method.LC, Method.MIXTURE)
"""What ``auto`` chooses among (LC under the generic gate: the provable default)."""


@dataclass(frozen=True)
class MergeMethod:
    """One merge method of the frontier: ``calibrate(records, method, target, delta,
    gating_bound=…)`` reported under ``kind``; ``method`` ``auto`` is the release
    ``choose_method`` picks among :data:`AUTO_CHOICES`."""

    kind: str
    method: Method | str
    gating_bound: GatingBound = "generic"


RS = MergeMethod("rs", Method.RS)
LC_GENERIC = MergeMethod("lc-generic", Method.LC, "generic")
MIXTURE = MergeMethod("mixture", Method.MIXTURE)
"""A secret draw between two LC merges of subsets (generic gates), certified by the mixture
bound."""
LC_STRUCTURED = MergeMethod("lc-structured", Method.LC, "structured")
AUTO = MergeMethod(AUTO_METHOD, AUTO_METHOD)
"""The provable default: RS, LC (generic) or the mixture, chosen from the records."""
METHODS = (RS, LC_GENERIC, MIXTURE, AUTO, LC_STRUCTURED)
AUTO_PRIVATE_METHOD = "auto-private"
AUTO_PRIVATE = MergeMethod(AUTO_PRIVATE_METHOD, AUTO_PRIVATE_METHOD)
"""Private tuning: among ``auto``'s release and a simplex grid of LC weights over the generic
gate's subset, the one the exponential mechanism picks on validation counts
(docs/design.md#private-tuning); its ε is the consulted candidates' bound."""
COLUMNS = [
    "kind",
    "method",
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
        used: Sequence[str],
        test: float,
        validation: float,
        drawn: float | None = None,
        *,
        method: str,
        weights: Any,
    ) -> dict[str, Any]:
        runs: dict[str, MechanismRecord] = {}  # checkpoints of one run: its longest
        for record in (r for r in self.records if r.name in set(used)):
            key = record.run_id or record.name
            if key not in runs or record.steps > runs[key].steps:
                runs[key] = record
        return dict(
            kind=kind,
            method=method,
            target_epsilon=target,
            **bound_columns(bound),
            test_accuracy=test,
            validation_accuracy=validation,
            drawn_test_accuracy=drawn,
            members=len(runs),
            per_example_gradients=sum(r.expected_batch_size * r.steps for r in runs.values()),
            weights=json.dumps(weights),
            candidates=json.dumps(self.names),
        )

    def candidate_rows(self) -> list[dict[str, Any]]:
        return [
            self._row(
                "candidate",
                None,
                candidate_bound(record, self.delta),
                [record.name],
                self.test_acc[i],
                self.val_acc[i],
                method="candidate",
                weights=[round(w, 6) for w in self.one_hot[i]],
            )
            for i, record in enumerate(self.records)
        ]

    def release_row(
        self, kind: str, target: float, result: Calibration, draw: random.Random | None
    ) -> dict[str, Any]:
        """The row of one calibrated release: its certified ε, its test and validation accuracy
        (RS and mixture: expected over the draw; with ``draw``, also one simulated draw's)."""
        report = result.report
        if report.method == Method.LC:
            choices, odds = [report.weights], [1.0]
            weights: Any = [round(w, 6) for w in report.weights]
        elif report.method == Method.RS:
            choices, odds = self.one_hot, list(report.weights)
            weights = [round(w, 6) for w in report.weights]
        else:
            choices, odds = [r.weights for r in report.rungs], [r.probability for r in report.rungs]
            weights = [
                {k: v for k, v in r.to_dict(report.names).items() if k != "bound"}
                for r in report.rungs
            ]
        used = [i for i, p in enumerate(odds) if p > 0]
        tests = {i: self.evaluator.accuracy(choices[i], "test") for i in used}
        validations = {i: self.evaluator.accuracy(choices[i], "validation") for i in used}
        drawn = None
        if draw is not None and report.method != Method.LC:
            drawn = tests[draw_index(odds, rng=draw)]
        return self._row(
            kind,
            float(target),
            report.gating,
            report.used_candidates,
            expected_accuracy([tests.get(i, 0.0) for i in range(len(odds))], odds),
            expected_accuracy([validations.get(i, 0.0) for i in range(len(odds))], odds),
            drawn,
            method=str(report.method),
            weights=weights,
        )

    def tuned_row(
        self,
        target: float,
        auto: Calibration,
        lc: Calibration,
        epsilon: float,
        draw: random.Random | None,
    ) -> dict[str, Any]:
        """The row of the privately tuned release (:data:`AUTO_PRIVATE`): the option
        :func:`noisy_max` picks on validation counts (``draw`` seeds it in a study)."""
        plan = tuning_plan(self.records, auto, lc)
        validation = len(self.evaluator.data.validation)
        counts = option_counts(plan, lambda w: self.evaluator.accuracy(w, "validation"), validation)
        index = noisy_max(counts, epsilon, draw)
        release = tuned_release(plan, index, self.records)
        row = self.release_row(AUTO_PRIVATE.kind, target, release, draw)
        return {**row, "options": len(plan.options), "chosen": plan.options[index].label}

    def rows_at(
        self,
        target: float,
        methods: Sequence[MergeMethod] = METHODS,
        draw: random.Random | None = None,
        selection_epsilon: float = SELECTION_EPSILON,
    ) -> list[dict[str, Any]]:
        """One row per method feasible at ``target``. With ``draw`` (a seeded generator: a
        study's simulated release, not a secret draw), RS and mixture rows also hold the test
        accuracy of one drawn release; ``auto`` repeats the row of the method it chose;
        ``auto-private`` selects at ``selection_epsilon`` on the validation rows."""
        calibrations: dict[tuple[str, str], Calibration | None] = {}
        rows: dict[tuple[str, str], dict[str, Any]] = {}

        def calibrated(method: str, gate: str) -> Calibration | None:
            if (method, gate) not in calibrations:
                try:
                    calibrations[method, gate] = calibrate(
                        self.records, method, float(target), self.delta, gating_bound=gate
                    )
                except InfeasibleTargetError:
                    calibrations[method, gate] = None
            return calibrations[method, gate]

        def row(method: str, gate: str, kind: str) -> dict[str, Any] | None:
            result = calibrated(method, gate)
            if result is not None and (method, gate) not in rows:
                rows[method, gate] = self.release_row(kind, target, result, draw)
            return rows.get((method, gate))

        out = []
        for spec in methods:
            if spec.method in (AUTO_METHOD, AUTO_PRIVATE_METHOD):
                offered = {m: calibrated(m, "generic") for m in AUTO_CHOICES}
                if any(c is None for c in offered.values()):
                    continue
                choice = choose_method(offered, self.records)  # type: ignore[arg-type]
                if spec.method == AUTO_PRIVATE_METHOD:
                    lc = offered[Method.LC]
                    auto = choice.calibration
                    out.append(self.tuned_row(target, auto, lc, selection_epsilon, draw))  # type: ignore[arg-type]
                    continue
                found = row(choice.method, "generic", str(choice.method))
            else:
                found = row(spec.method, spec.gating_bound, spec.kind)
            if found is not None:
                out.append({**found, "kind": spec.kind})
        return out


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
