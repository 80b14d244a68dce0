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
from dpmerge.studies.engine import RETRAIN, RETRAIN_AVERAGED, RETRAIN_MATCHED, Group
from dpmerge.studies.frontier import plot_frontier
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table
from dpmerge.studies.settings import CandidateStudy, StudyConfigError

STUDY = "frontier"


@dataclass(frozen=True)
class FrontierStudy(CandidateStudy):
    """Settings of the convex study (defaults: Fashion-MNIST as in the utility experiment).
    Seeds ``seed_base`` … ``seed_base + seeds − 1`` each train their own candidates and
    retrains (a held-out setting takes other σ and another ``seed_base``)."""

    model: str = "logreg"
    sigmas: tuple[float, ...] = (0.6, 0.8, 1.0, 1.5, 2.0, 3.0)
    grid: int = 8
    seeds: int = 5
    seed_base: int = 0
    epochs: int = 10
    compute_matched: bool = True
    checkpoints: tuple[int, ...] = ()
    """Epochs kept as candidates besides each run's end (checkpoints of one run)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoints and (
            self.epochs not in self.checkpoints
            or not all(1 <= e <= self.epochs for e in self.checkpoints)
        ):
            raise StudyConfigError(
                f"checkpoints must be epochs in 1…{self.epochs} including the last "
                f"({self.epochs}), got {list(self.checkpoints)}"
            )


QUICK = dict(dataset="digits", sigmas=(0.8, 1.0, 1.5, 2.0, 3.0), grid=5, batch_size=64)
"""``--quick``: scikit-learn's digits (always available), five candidates, five targets."""
DEFAULT = "auto"
"""The provable default: RS, LC (generic gate) or the mixture, chosen from the records."""


def run_frontier_study(study: FrontierStudy, folder: StudyFolder) -> StudyResult:
    data = load_dataset(study.dataset, study.data_root, limit=study.limit)
    setup = engine.training_setup(study)
    methods = engine.merge_methods(study)
    retrains = (RETRAIN, *((RETRAIN_MATCHED,) if study.compute_matched else ()))
    references = (RETRAIN, *((RETRAIN_AVERAGED,) if study.checkpoints else ()), *retrains[1:])
    k, grid = len(study.sigmas), study.points
    rows, targets = [], []
    with engine.running(folder, study.seeds * (k + grid * (1 + len(retrains))), STUDY):
        for seed in range(study.seed_base, study.seed_base + study.seeds):
            group = Group("convex", seed, study.sigmas, (0,) * k)
            candidates = engine.train_group(folder, data, setup, group)
            targets = targets or engine.study_targets(study, candidates)
            rows += engine.group_rows(
                folder, data, setup, group, candidates, targets, methods, retrains
            )
    table = engine.as_table(rows)
    engine.require_feasible(table, targets, study.delta)
    summary = engine.summarise(table)
    kinds = [m.kind for m in methods] + list(references[: 2 if study.checkpoints else 1])
    gaps = [
        engine.paired_gaps(table, [m.kind for m in methods], reference) for reference in references
    ]
    verdict = _verdict(gaps, methods, len(targets))
    title = f"{study.dataset} {study.model}: test accuracy vs ε (δ = {study.delta:g})"
    files = [
        folder.write_table("frontier", table),
        folder.write_table("summary", summary),
        folder.write_table("gaps", pd.concat(gaps, ignore_index=True)),
        plot_frontier(
            summary[~summary.kind.str.startswith(RETRAIN_MATCHED)],
            folder.root / "frontier.png",
            title,
        ),
        engine.plot_gaps(
            pd.concat(
                [gaps[0][gaps[0].kind.isin(["lc-generic", "lc-structured"])]]
                + [gap[gap.kind == DEFAULT] for gap in gaps],
                ignore_index=True,
            ),
            folder.root / "gap.png",
            "merge minus retrain, paired by seed (95 % CI)",
        ),
    ]
    markdown = _markdown(study, summary, kinds, gaps, verdict)
    files.append(folder.write_text("frontier.md", markdown))
    return folder.result(
        STUDY, files, {**asdict(study), "targets": targets}, engine.series_metrics(summary), verdict
    )


def _verdict(gaps: list[pd.DataFrame], methods, count: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Per method and retrain: at how many targets the method's accuracy is at least the
    retrain's (mean of the per-seed differences ≥ 0), and at how many its paired confidence
    interval lies wholly above 0 (significantly better) or wholly below 0 (significantly
    worse); the targets in neither are ties at this many seeds (docs/results.md §2.4)."""
    out: dict[str, object] = {"targets": count}
    for gap in gaps:
        for method in methods:
            rows = gap[gap.kind == method.kind]
            if rows.empty:
                continue
            reference = rows.reference.iloc[0]
            out[f"{method.kind} >= {reference}"] = int((rows.gap >= 0).sum())
            out[f"{method.kind} significantly above {reference}"] = int((rows.ci_low > 0).sum())
            out[f"{method.kind} significantly below {reference}"] = int((rows.ci_high < 0).sum())
    return out


def _markdown(study, summary, kinds, gaps, verdict) -> str:  # type: ignore[no-untyped-def]
    candidates = summary[summary.kind == "candidate"]
    seeds = range(study.seed_base, study.seed_base + study.seeds)
    lines = [
        f"# Convex frontier: {study.dataset}, {study.model}",
        "",
        f"{len(study.sigmas)} candidates (σ = {', '.join(f'{s:g}' for s in study.sigmas)}), "
        f"{study.epochs} epochs, expected batch {study.batch_size}, {study.seeds} seeds "
        f"({seeds.start}–{seeds.stop - 1}); δ = {study.delta:g}. Test accuracy in %, mean ± "
        "std over seeds. RS and mixture: expected accuracy over the draw, and one simulated "
        "draw for RS. auto: the provable default (rs, lc-generic or mixture, chosen from the "
        "records). LC weights: inverse-variance (untuned). Retrain: σ calibrated (PLD) to "
        "spend the target at the candidates' q and T. Retrain-matched: m× batch and m× epochs "
        "(same T), m = the candidates the merge's release uses.",
        "",
        "## Accuracy per target",
        "",
        markdown_table(engine.accuracy_table(summary, "convex", kinds)),
        "",
    ]
    merges = [k for k in kinds if not k.startswith(RETRAIN)]
    for gap in gaps:
        lines += [
            f"## Merge minus {gap.reference.iloc[0]} (pp, paired by seed: mean [95 % CI])",
            "",
            markdown_table(engine.gap_table(gap, merges)),
            "",
        ]
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
