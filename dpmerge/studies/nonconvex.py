"""The non-convex study (docs/design.md#studies): CNN candidates (ResNet-18-GN on CIFAR-10 with
``--model resnet18-gn --dataset cifar10 --device cuda``) trained from one shared initialisation
and from independent initialisations; RS and LC merges at a grid of targets, a retrain at each
target, and the accuracy along the weight path between the two least noisy candidates and of
the equal-weight average of all of them, which show where averaging weights breaks down.

The calibrated LC picks its weights on validation accuracy, so where averaging hurts it falls
back to fewer candidates (a single one at worst): the path and the equal-weight average show
what it avoided.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from dpmerge.accounting.account import account
from dpmerge.artifacts import ModelDir
from dpmerge.data import DatasetSplits, load_dataset
from dpmerge.evaluation import MergeAccuracy
from dpmerge.studies import engine
from dpmerge.studies.engine import RETRAIN, Group
from dpmerge.studies.frontier import LC_GENERIC, RS, plot_frontier
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table
from dpmerge.studies.plots import figure
from dpmerge.studies.settings import CandidateStudy

STUDY = "non-convex"
INITIALISATIONS = ("shared", "independent")


@dataclass(frozen=True)
class NonConvexStudy(CandidateStudy):
    epochs: int = 2
    retrain: bool = True
    path_points: int = 11

    COUNTS = (*CandidateStudy.COUNTS, "path_points")


def groups_of(study: NonConvexStudy, seed: int) -> list[Group]:
    """The shared- and the independent-initialisation set of one seed. Candidate i of both
    draws the same noise and batches (its stream seed), so the sets differ only in their
    initialisations; each set is merged on its own."""
    k = len(study.sigmas)
    return [
        Group("shared", seed, study.sigmas, (seed,) * k),
        Group("independent", seed, study.sigmas, tuple(1000 * (seed + 1) + i for i in range(k))),
    ]


def merge_probes(
    folder: StudyFolder,
    data: DatasetSplits,
    group: Group,
    candidates: list[ModelDir],
    points: int,
    delta: float,
    device: str = "cpu",
) -> list[dict[str, object]]:
    """Test accuracy along (1−t)·θ_a + t·θ_b for the two least noisy candidates, and of the
    equal-weight average of all (with its generic ε): fixed weights, no calibration."""
    merges = MergeAccuracy(candidates[0].spec, [c.weights_file for c in candidates], device=device)
    order = np.argsort([c.record.noise_multiplier for c in candidates])  # type: ignore[union-attr]
    a, b = int(order[0]), int(order[1])
    k = len(candidates)

    def accuracy(weights: tuple[float, ...]) -> float:
        return merges.accuracy(weights, data.test)

    def compute() -> dict[str, object]:
        rows = []
        for t in np.linspace(0.0, 1.0, points):
            weights = tuple(
                float(t) if n == b else (1 - float(t) if n == a else 0.0) for n in range(k)
            )
            rows.append(dict(probe="path", t=float(t), test_accuracy=accuracy(weights)))
        uniform = tuple(1.0 / k for _ in range(k))
        bound = account([c.record for c in candidates], "lc", uniform, delta).gating  # type: ignore[misc]
        rows.append(
            dict(
                probe="uniform",
                t=None,
                test_accuracy=accuracy(uniform),
                epsilon=bound.epsilon,
                epsilon_pld=bound.epsilon_pld,
                epsilon_rdp=bound.epsilon_rdp,
            )
        )
        return {"rows": rows}

    identity = {"candidates": [c.path.name for c in candidates], "points": points, "delta": delta}
    found = folder.cached("probes", identity, compute)["rows"]
    names = [candidates[a].record.name, candidates[b].record.name]  # type: ignore[union-attr]
    return [{"group": group.label, "seed": group.seed, "pair": "/".join(names), **r} for r in found]


def run_nonconvex_study(study: NonConvexStudy, folder: StudyFolder) -> StudyResult:
    data = load_dataset(study.dataset, study.data_root, limit=study.limit)
    setup = engine.training_setup(study)
    methods = engine.merge_methods(study)
    k, grid = len(study.sigmas), study.points
    per_seed = 2 * (k + grid + 1) + (grid if study.retrain else 0)
    rows, probes, targets = [], [], []
    with engine.running(folder, study.seeds * per_seed, STUDY):
        for seed in range(study.seeds):
            for group in groups_of(study, seed):
                candidates = engine.train_group(folder, data, setup, group)
                targets = targets or engine.study_targets(study, candidates)
                retrains = (RETRAIN,) if study.retrain and group.label == "shared" else ()
                rows += engine.group_rows(
                    folder, data, setup, group, candidates, targets, methods, retrains
                )
                probes += merge_probes(
                    folder, data, group, candidates, study.path_points, study.delta, study.device
                )
    table, probe_table = engine.as_table(rows), pd.DataFrame(probes)
    engine.require_feasible(table, targets, study.delta)
    summary = engine.summarise(table)
    title = f"{study.dataset} {study.model}: test accuracy vs ε (δ = {study.delta:g})"
    files = [
        folder.write_table("nonconvex", table),
        folder.write_table("summary", summary),
        folder.write_table("probes", probe_table),
        plot_frontier(summary, folder.root / "frontier.png", title),
        _plot_paths(probe_table, folder.root / "paths.png", study),
    ]
    verdict = _verdict(summary, probe_table)
    files.append(
        folder.write_text(
            "nonconvex.md",
            _markdown(study, summary, probe_table, [m.kind for m in methods], verdict),
        )
    )
    return folder.result(
        STUDY, files, {**asdict(study), "targets": targets}, engine.series_metrics(summary), verdict
    )


def _verdict(summary: pd.DataFrame, probes: pd.DataFrame) -> dict[str, object]:
    """Per initialisation (means over seeds): the best candidate, the lowest point of the path
    and its middle, the equal-weight average, and at how many targets calibrated LC (generic
    gate) is below RS."""
    out: dict[str, object] = {}
    for group in INITIALISATIONS:
        best = summary[(summary.group == group) & (summary.kind == "candidate")].test_accuracy.max()
        part = probes[probes.group == group]
        path = part[part.probe == "path"].groupby("t").test_accuracy.mean()
        uniform = part[part.probe == "uniform"].test_accuracy.mean()
        merges = summary[summary.group == group].pivot_table(
            index="target_epsilon", columns="kind", values="test_accuracy"
        )
        below = int((merges.get(LC_GENERIC.kind) < merges.get(RS.kind) - 1e-12).sum())
        out[f"{group}: best candidate"] = float(best)
        out[f"{group}: path minimum"] = float(path.min())
        out[f"{group}: path midpoint"] = float(path.iloc[(abs(path.index - 0.5)).argmin()])
        out[f"{group}: equal-weight average"] = float(uniform)
        out[f"{group}: targets where lc-generic < rs"] = below
    return out


def _markdown(study, summary, probes, kinds, verdict) -> str:  # type: ignore[no-untyped-def]
    lines = [
        f"# Non-convex: {study.dataset}, {study.model}",
        "",
        f"{len(study.sigmas)} candidates per initialisation (σ = "
        f"{', '.join(f'{s:g}' for s in study.sigmas)}), {study.epochs} epochs, expected batch "
        f"{study.batch_size}, {study.seeds} seed(s), δ = {study.delta:g}; *shared*: every "
        "candidate starts from one seeded initialisation, *independent*: each from its own. "
        "Test accuracy in %.",
        "",
    ]
    for group in INITIALISATIONS:
        extra = [RETRAIN] if group == "shared" and study.retrain else []
        lines += [
            f"## {group} initialisation",
            "",
            markdown_table(engine.accuracy_table(summary, group, [*kinds, *extra])),
            "",
            markdown_table(engine.epsilon_table(summary, group)),
            "",
        ]
    lines += [
        "## Fixed-weight probes (test accuracy)",
        "",
        markdown_table(
            probes.groupby(["group", "probe", "t"], dropna=False).test_accuracy.mean().reset_index()
        ),
        "",
        "## Verdict",
        "",
    ]
    lines += [
        f"* {key}: {value:.4f}" if isinstance(value, float) else f"* {key}: {value}"
        for key, value in verdict.items()
    ]
    return "\n".join(lines) + "\n"


def _plot_paths(probes: pd.DataFrame, path, study: NonConvexStudy):  # type: ignore[no-untyped-def]
    with figure(path, size=(7, 4.2)) as (axes,):
        for group, rows in probes[probes.probe == "path"].groupby("group", sort=False):
            mean = rows.groupby("t").test_accuracy.mean()
            axes.plot(
                mean.index,
                mean.values,
                marker="o",
                markersize=3,
                label=f"{group} initialisation ({rows.pair.iloc[0]})",
            )
        axes.set_xlabel("t in (1 − t)·θ_a + t·θ_b (θ_a the least noisy candidate)")
        axes.set_ylabel("test accuracy")
        axes.set_title(f"{study.dataset} {study.model}: accuracy along the weight path")
    return path
