"""Private tuning against the data-independent ``auto`` on the convex frontier
(docs/design.md#private-tuning, docs/results.md §2.6): the candidates of the frontier study,
at its targets, ``auto`` and ``auto-private`` (the exponential mechanism on validation counts,
ε = 1 on the validation rows) paired by seed; no retrains.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pandas as pd

from dpmerge.data import load_dataset
from dpmerge.studies import engine
from dpmerge.studies.convex import FrontierStudy
from dpmerge.studies.engine import Group, confidence_interval
from dpmerge.studies.frontier import AUTO, AUTO_PRIVATE
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table, mean_std

STUDY = "frontier-tuning"


def paired(table: pd.DataFrame, kind: str, reference: str) -> pd.DataFrame:
    """Per target: ``kind`` − ``reference`` test accuracy in the same seed, mean and 95 %
    Student-t interval (:func:`engine.confidence_interval`)."""
    a = table[table.kind == kind][["seed", "target_epsilon", "test_accuracy"]]
    b = table[table.kind == reference][["seed", "target_epsilon", "test_accuracy"]]
    merged = a.merge(b, on=["seed", "target_epsilon"], suffixes=("", "_reference"))
    merged["gap"] = merged.test_accuracy - merged.test_accuracy_reference
    out = []
    for target, rows in merged.groupby("target_epsilon", sort=True):
        mean, std = mean_std(rows.gap)
        low, high = confidence_interval(mean, std, len(rows))
        out.append(dict(target_epsilon=target, gap=mean, ci_low=low, ci_high=high, seeds=len(rows)))
    return pd.DataFrame(out)


def verdict(gaps: pd.DataFrame, kind: str, reference: str) -> dict[str, int]:
    """The counts of §2: targets where the mean gap is ≥ 0, where the interval lies wholly
    above 0, wholly below 0."""
    return {
        "targets": len(gaps),
        f"{kind} >= {reference}": int((gaps.gap >= 0).sum()),
        f"{kind} significantly above {reference}": int((gaps.ci_low > 0).sum()),
        f"{kind} significantly below {reference}": int((gaps.ci_high < 0).sum()),
    }


def run_tuning_study(study: FrontierStudy, folder: StudyFolder) -> StudyResult:
    data = load_dataset(study.dataset, study.data_root, limit=study.limit)
    setup = engine.training_setup(study)
    k, methods = len(study.sigmas), (AUTO, AUTO_PRIVATE)
    rows: list[dict[str, Any]] = []
    targets: list[float] = []
    with engine.running(folder, study.seeds * (k + study.points), STUDY):
        for seed in range(study.seed_base, study.seed_base + study.seeds):
            group = Group("convex", seed, study.sigmas, (0,) * k)
            candidates = engine.train_group(folder, data, setup, group)
            targets = targets or engine.study_targets(study, candidates)
            rows += engine.group_rows(
                folder, data, setup, group, candidates, targets, methods, retrains=()
            )
    table = pd.DataFrame(rows)
    gaps = paired(table, AUTO_PRIVATE.kind, AUTO.kind)
    counts = verdict(gaps, AUTO_PRIVATE.kind, AUTO.kind)
    merges = table[table.kind.isin([AUTO.kind, AUTO_PRIVATE.kind])]
    accuracy = (
        merges.groupby(["target_epsilon", "kind"]).test_accuracy.agg(["mean", "std"]).reset_index()
    )
    chosen = (
        table[table.kind == AUTO_PRIVATE.kind]
        .groupby("target_epsilon")
        .agg(chosen=("chosen", lambda c: "; ".join(sorted(set(c)))), options=("options", "max"))
        .reset_index()
    )
    lines = [
        f"# Private tuning vs auto: {study.dataset}, {study.model}",
        "",
        f"σ = {', '.join(f'{s:g}' for s in study.sigmas)}, {study.epochs} epochs, "
        f"{study.seeds} seeds, limit {study.limit}, δ = {study.delta:g}; selection ε = 1 on "
        "the validation rows.",
        "",
        "## Test accuracy (mean, std over seeds)",
        "",
        markdown_table(accuracy),
        "",
        "## auto-private − auto (paired by seed, 95 % CI)",
        "",
        markdown_table(gaps),
        "",
        "## Options and choices",
        "",
        markdown_table(chosen),
        "",
        *[f"* {key}: {value}" for key, value in counts.items()],
    ]
    files = [
        folder.write_table("tuning", table),
        folder.write_table("tuning_gaps", gaps),
        folder.write_text("tuning.md", "\n".join(lines) + "\n"),
    ]
    return folder.result(STUDY, files, {**asdict(study), "targets": targets}, [], counts)
