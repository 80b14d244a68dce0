"""The utility–privacy frontier of a set of candidates (SPEC §8.2–8.4): for each target ε, the
best RS and LC merges and their test accuracy, beside the candidates themselves.

Calibration utilities come from the validation split (disjoint from training, SPEC §4): the
candidates' validation accuracies for RS, the merged weights' validation accuracy for LC.
Reported accuracies are on the test split; for RS the expected accuracy Σ π_i·acc_i (the
released model is one draw). Every ε is the certified gating bound of the calibration.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from dpmerge.accounting.calibration import calibrate
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.artifacts import ModelDir
from dpmerge.data import DatasetSplits
from dpmerge.errors import InfeasibleTargetError, RecordError
from dpmerge.evaluation import MergeAccuracy, expected_accuracy

METHODS = (("rs", "generic"), ("lc", "generic"), ("lc", "structured"))
COLUMNS = [
    "kind",
    "target_epsilon",
    "epsilon",
    "accountant",
    "delta",
    "test_accuracy",
    "validation_accuracy",
    "weights",
    "candidates",
]


class _Evaluator:
    """Validation and test accuracy of LC merges of the candidates, with the released merge's
    arithmetic (:class:`~dpmerge.evaluation.MergeAccuracy`), cached by weights."""

    def __init__(self, candidates: Sequence[ModelDir], data: DatasetSplits) -> None:
        specs = {c.spec for c in candidates}
        if len(specs) != 1:
            raise RecordError("the candidates do not share one architecture")
        self.merges = MergeAccuracy(specs.pop(), [c.weights_file for c in candidates])
        self.data = data

    def accuracy(self, weights: tuple[float, ...], split: str) -> float:
        return self.merges.accuracy(weights, getattr(self.data, split))

    def merge_utility(self, weights: tuple[float, ...]) -> float:
        return self.accuracy(weights, "validation")


def frontier(
    candidates: Sequence[ModelDir],
    data: DatasetSplits,
    targets: Sequence[float],
    delta: float,
    methods: Sequence[tuple[str, str]] = METHODS,
) -> pd.DataFrame:
    """One row per candidate and per (target, method); infeasible targets get no row."""
    records = [c.record for c in candidates]
    if any(r is None for r in records):
        raise RecordError("the frontier needs candidate directories (with mechanism records)")
    if any(r.dataset != data.fingerprint for r in records):  # type: ignore[union-attr]
        raise RecordError("the data's fingerprint differs from the candidates' training data")
    evaluator = _Evaluator(candidates, data)
    names = [r.name for r in records]  # type: ignore[union-attr]
    k = len(candidates)
    one_hot = [tuple(1.0 if n == i else 0.0 for n in range(k)) for i in range(k)]
    val_acc = [evaluator.accuracy(w, "validation") for w in one_hot]
    test_acc = [evaluator.accuracy(w, "test") for w in one_hot]
    rows = []
    for i, record in enumerate(records):
        bound = candidate_bound(record, delta)  # type: ignore[arg-type]
        rows.append(
            dict(
                kind="candidate",
                target_epsilon=None,
                epsilon=bound.epsilon,
                accountant=bound.accountant,
                delta=delta,
                test_accuracy=test_acc[i],
                validation_accuracy=val_acc[i],
                weights=json.dumps(one_hot[i]),
                candidates=json.dumps(names),
            )
        )
    for target in targets:
        for method, bound in methods:
            try:
                result = calibrate(
                    records,  # type: ignore[arg-type]
                    method,  # type: ignore[arg-type]
                    float(target),
                    delta,
                    gating_bound=bound,  # type: ignore[arg-type]
                    merge_utility=evaluator.merge_utility
                    if (method, bound) == ("lc", "generic")
                    else None,
                )
            except InfeasibleTargetError:
                continue
            weights = tuple(result.weights)
            if method == "rs":
                test, val = (
                    expected_accuracy(test_acc, weights),
                    expected_accuracy(val_acc, weights),
                )
            else:
                test, val = (
                    evaluator.accuracy(weights, "test"),
                    evaluator.accuracy(weights, "validation"),
                )
            rows.append(
                dict(
                    kind=f"{method}-{bound}" if method == "lc" else "rs",
                    target_epsilon=float(target),
                    epsilon=result.epsilon,
                    accountant=result.report.gating.accountant,
                    delta=delta,
                    test_accuracy=test,
                    validation_accuracy=val,
                    weights=json.dumps([round(w, 6) for w in weights]),
                    candidates=json.dumps(names),
                )
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def plot_frontier(table: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """Accuracy versus certified ε: candidates as points, one line per merge method."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = Path(path)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    candidates = table[table.kind == "candidate"]
    axes.scatter(
        candidates.epsilon, candidates.test_accuracy, color="black", zorder=3, label="candidates"
    )
    for kind, group in table[table.kind != "candidate"].groupby("kind"):
        group = group.sort_values("epsilon")
        axes.plot(group.epsilon, group.test_accuracy, marker="o", label=kind)
    axes.set_xscale("log")
    axes.set_xlabel(f"certified ε (δ = {table.delta.iloc[0]:g})")
    axes.set_ylabel("test accuracy (RS: expected)")
    axes.set_title(title or "privacy–utility frontier")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
