"""The convex frontier study (docs/design.md#studies): DP-SGD logistic regression candidates,
RS and LC merges at a grid of targets between the most and the least private candidate, against
retraining at each target and a compute-matched retrain, over several seeds.

Each seed trains its own candidates (fixed, distinct noise and batch seeds: independent release
units) from the same zero initialisation; merges are calibrated on the validation split and
evaluated on the test split (docs/design.md#calibration).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd

from dpmerge.data import load_dataset
from dpmerge.studies import engine
from dpmerge.studies.engine import RETRAIN, RETRAIN_MATCHED, Group
from dpmerge.studies.frontier import plot_frontier
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table
from dpmerge.studies.settings import CandidateStudy

STUDY = "frontier"


@dataclass(frozen=True)
class FrontierStudy(CandidateStudy):
    """Settings of the convex study (defaults: Fashion-MNIST as in the utility experiment)."""

    model: str = "logreg"
    sigmas: tuple[float, ...] = (0.6, 0.8, 1.0, 1.5, 2.0, 3.0)
    grid: int = 8
    seeds: int = 3
    epochs: int = 10
    compute_matched: bool = True


QUICK = dict(dataset="digits", sigmas=(0.8, 1.0, 1.5, 2.0, 3.0), grid=5, batch_size=64)
"""``--quick``: scikit-learn's digits (always available), five candidates, five targets."""


def run_frontier_study(study: FrontierStudy, folder: StudyFolder) -> StudyResult:
    data = load_dataset(study.dataset, study.data_root, limit=study.limit)
    setup = engine.training_setup(study)
    methods = engine.merge_methods(study)
    retrains = (RETRAIN, *((RETRAIN_MATCHED,) if study.compute_matched else ()))
    k, grid = len(study.sigmas), study.points
    rows, targets = [], []
    with engine.running(folder, study.seeds * (k + grid * (1 + len(retrains))), STUDY):
        for seed in range(study.seeds):
            group = Group("convex", seed, study.sigmas, (0,) * k)
            candidates = engine.train_group(folder, data, setup, group)
            targets = targets or engine.study_targets(study, candidates)
            rows += engine.group_rows(
                folder, data, setup, group, candidates, targets, methods, retrains
            )
    table = engine.as_table(rows)
    summary = engine.summarise(table)
    kinds = [m.kind for m in methods] + list(retrains)
    gaps = [
        engine.paired_gaps(table, [m.kind for m in methods], reference) for reference in retrains
    ]
    verdict = _verdict(gaps, methods, len(targets))
    title = f"{study.dataset} {study.model}: test accuracy vs ε (δ = {study.delta:g})"
    files = [
        folder.write_table("frontier", table),
        folder.write_table("summary", summary),
        plot_frontier(summary, folder.root / "frontier.png", title),
        engine.plot_gaps(
            pd.concat(gaps, ignore_index=True),
            folder.root / "gap.png",
            "merge minus retrain, same seed",
        ),
    ]
    markdown = _markdown(study, summary, kinds, gaps, verdict)
    files.append(folder.write_text("frontier.md", markdown))
    return folder.result(
        STUDY, files, {**asdict(study), "targets": targets}, engine.series_metrics(summary), verdict
    )


def _verdict(gaps: list[pd.DataFrame], methods, count: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Per method and retrain: at how many targets the method's accuracy is at least the
    retrain's (mean of the per-seed differences ≥ 0)."""
    out: dict[str, object] = {"targets": count}
    for gap in gaps:
        for method in methods:
            rows = gap[gap.kind == method.kind]
            out[f"{method.kind} >= {rows.reference.iloc[0]}"] = int((rows.gap >= 0).sum())
    return out


def _markdown(study, summary, kinds, gaps, verdict) -> str:  # type: ignore[no-untyped-def]
    candidates = summary[summary.kind == "candidate"]
    lines = [
        f"# Convex frontier: {study.dataset}, {study.model}",
        "",
        f"{len(study.sigmas)} candidates (σ = {', '.join(f'{s:g}' for s in study.sigmas)}), "
        f"{study.epochs} epochs, expected batch {study.batch_size}, {study.seeds} seeds; "
        f"δ = {study.delta:g}. Test accuracy in %, mean ± std over seeds. RS: expected "
        "accuracy Σπ·acc and one simulated draw. Retrain: σ calibrated (PLD) to the target for "
        "the candidates' q and T. Retrain-matched: m× batch and m× epochs (same T), m = the "
        "number of candidates LC under the generic gate merged.",
        "",
        "## Accuracy per target",
        "",
        markdown_table(engine.accuracy_table(summary, "convex", kinds)),
        "",
        "## Merge minus retrain (pp, paired by seed)",
        "",
    ]
    for gap in gaps:
        view = gap.assign(gap=100 * gap.gap, gap_std=100 * gap.gap_std)
        lines += [markdown_table(view.drop(columns=["group"]), 2), ""]
    lines += [
        "## Candidates",
        "",
        markdown_table(engine.epsilon_table(candidates, "convex")),
        "",
        "## ε of every point (mean over seeds)",
        "",
        markdown_table(engine.epsilon_table(summary[summary.kind != "candidate"], "convex")),
        "",
        "## Verdict",
        "",
    ]
    lines += [
        f"* {key}: {value} of {verdict['targets']} targets"
        for key, value in verdict.items()
        if key != "targets"
    ]
    return "\n".join(lines) + "\n"
