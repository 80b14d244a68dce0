"""The machinery the model studies share (docs/design.md#studies): train candidates and
retrains as cached units, calibrate every merge method at every target as cached units, and
summarise the rows over seeds.

A *group* is one set of candidates (one seed of the convex study; the shared- or
independent-initialisation set of the non-convex one). Per target it gets the rows of
:class:`~dpmerge.studies.frontier.FrontierContext` (RS with its expected and one drawn accuracy,
LC under each gate), and optionally

* ``retrain``: DP-SGD at the target, σ calibrated for the candidates' q and T, every other
  hyper-parameter the same;
* ``retrain-matched``: the same with m times the batch and m times the epochs (so the same
  number of steps T and q·n·T·m per-example gradients), m being the number of candidates the
  LC merge under the generic gate uses: the compute that merge consumed.

Every ε is derived by the accountants: merges by their calibration, models by
``candidate_bound`` of their record, each under PLD and RDP.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.pld import set_disk_cache
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelDir, load_model_dir
from dpmerge.data import DatasetSplits
from dpmerge.studies.frontier import (
    COLUMNS,
    LC_GENERIC,
    LC_GENERIC_INTERPOLATED,
    LC_STRUCTURED,
    RS,
    FrontierContext,
    MergeMethod,
    bound_columns,
)
from dpmerge.studies.output import StudyFolder, mean_std
from dpmerge.studies.plots import figure, log_epsilon_axis
from dpmerge.studies.settings import CandidateStudy, StudyConfigError
from dpmerge.training import TrainConfig, save_candidate, train_candidate

RETRAIN, RETRAIN_MATCHED = "retrain", "retrain-matched"
PLD_CACHE = "pld-cache"
STUDY_COLUMNS = ["group", "seed", *COLUMNS, "noise_multiplier", "batch_size", "seconds"]
SUMMARY_VALUES = ("test_accuracy", "drawn_test_accuracy", "epsilon", "epsilon_pld", "epsilon_rdp")


@dataclass(frozen=True)
class TrainingSetup:
    """The DP-SGD hyper-parameters every model of a study shares (candidates and retrains)."""

    dataset: str
    model: str
    epochs: int
    batch_size: int
    learning_rate: float | None
    clip_norm: float
    delta: float
    device: str = "cpu"
    init_checkpoint: str | None = None
    max_steps: int | None = None

    def config(
        self,
        name: str,
        *,
        init_seed: int,
        stream_seed: int,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        scale: int = 1,
    ) -> TrainConfig:
        """One model: fixed noise and batch seeds ``stream_seed`` (reproducible; distinct per
        model, so every model is its own release unit), ``scale`` × batch and × epochs."""
        return TrainConfig(
            dataset=self.dataset,
            model=self.model,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            delta=self.delta,
            epochs=self.epochs * scale,
            batch_size=self.batch_size * scale,
            learning_rate=self.learning_rate,
            clip_norm=self.clip_norm,
            init_seed=init_seed,
            noise_seed=stream_seed,
            batch_seed=stream_seed,
            init_checkpoint=self.init_checkpoint,
            device=self.device,
            max_steps=self.max_steps,
            name=name,
        )


def training_setup(study: CandidateStudy) -> TrainingSetup:
    """The DP-SGD setup of ``study``'s models, checked (see :func:`check_setup`)."""
    setup = TrainingSetup(
        dataset=study.dataset,
        model=study.model_name,
        epochs=study.epochs,
        batch_size=study.batch_size,
        learning_rate=study.learning_rate,
        clip_norm=study.clip_norm,
        delta=study.delta,
        device=study.device,
        max_steps=study.max_steps,
    )
    check_setup(setup)
    return setup


@contextmanager
def running(folder: StudyFolder, total: int, description: str) -> Iterator[None]:
    """The study's units run: a progress bar over ``total`` units, and the models' PLDs kept
    as files beside the results (a rerun reads them back instead of recomposing them)."""
    folder.start(total, description)
    set_disk_cache(folder.root / PLD_CACHE)
    try:
        yield
    finally:
        set_disk_cache(None)
        folder.close()


def check_setup(setup: TrainingSetup) -> None:
    """Refuse a setup that could not train (model, device, hyper-parameters) before any
    unit starts: ``TrainConfig`` validates the settings, and a CUDA device must exist."""
    setup.config("check", init_seed=0, stream_seed=0, noise_multiplier=1.0)
    if setup.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise StudyConfigError(f"device {setup.device!r} requested but CUDA is not available")


@dataclass(frozen=True)
class Group:
    """One set of candidates: ``sigmas[i]`` trained from ``init_seeds[i]``."""

    label: str
    seed: int
    sigmas: tuple[float, ...]
    init_seeds: tuple[int, ...]

    def stream_seed(self, index: int) -> int:
        """Distinct per (seed, model): candidates below 1000, retrains from 1000 up."""
        return 100_000 * (self.seed + 1) + index


def train_unit(folder: StudyFolder, data: DatasetSplits, config: TrainConfig) -> ModelDir:
    """Train ``config`` on ``data`` unless an earlier run did; the model directory."""
    identity = {**asdict(config), "data": data.fingerprint}

    def build(path: Any) -> None:
        save_candidate(train_candidate(config, data), path, config.delta)

    return load_model_dir(folder.cached_dir(f"model-{config.name}", identity, build))


def model_row(
    kind: str, group: Group, target: float | None, model: ModelDir, setup: TrainingSetup
) -> dict[str, Any]:
    """The row of a trained model (a retrain): its ε under PLD and RDP, its accuracies (as
    training measured them on the same validation and test splits)."""
    record: MechanismRecord = model.record  # type: ignore[assignment]
    return dict(
        group=group.label,
        seed=group.seed,
        kind=kind,
        target_epsilon=target,
        **bound_columns(candidate_bound(record, setup.delta)),
        test_accuracy=model.metrics["test_accuracy"],
        validation_accuracy=model.metrics["validation_accuracy"],
        members=1,
        per_example_gradients=record.expected_batch_size * record.steps,
        candidates=json.dumps([record.name]),
        noise_multiplier=record.noise_multiplier,
        batch_size=record.expected_batch_size,
        seconds=model.metrics.get("train_seconds"),
    )


def train_group(
    folder: StudyFolder, data: DatasetSplits, setup: TrainingSetup, group: Group
) -> list[ModelDir]:
    return [
        train_unit(
            folder,
            data,
            setup.config(
                f"{group.label}-s{group.seed}-c{i}-sigma{sigma:g}",
                init_seed=init,
                stream_seed=group.stream_seed(i),
                noise_multiplier=sigma,
            ),
        )
        for i, (sigma, init) in enumerate(zip(group.sigmas, group.init_seeds, strict=True))
    ]


def _draw_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


def group_rows(
    folder: StudyFolder,
    data: DatasetSplits,
    setup: TrainingSetup,
    group: Group,
    candidates: Sequence[ModelDir],
    targets: Sequence[float],
    methods: Sequence[MergeMethod],
    retrains: Sequence[str] = (RETRAIN, RETRAIN_MATCHED),
) -> list[dict[str, Any]]:
    """The candidates' rows, then per target the merges' and the retrains' rows."""
    context = FrontierContext(candidates, data, setup.delta, setup.device)
    tag = {"group": group.label, "seed": group.seed}
    rows = [
        {
            **tag,
            **row,
            "noise_multiplier": c.record.noise_multiplier,  # type: ignore[union-attr]
            "batch_size": c.record.expected_batch_size,  # type: ignore[union-attr]
            "seconds": c.metrics.get("train_seconds"),
        }
        for row, c in zip(context.candidate_rows(), candidates, strict=True)
    ]
    identity = {
        "candidates": [c.path.name for c in candidates],
        "methods": [asdict(m) for m in methods],
        "delta": setup.delta,
    }
    for index, target in enumerate(targets):

        def merges(target: float = target) -> dict[str, Any]:
            start = time.perf_counter()
            draw = random.Random(_draw_seed(group.label, group.seed, target))
            found = context.rows_at(target, methods, draw=draw)
            seconds = time.perf_counter() - start
            return {"rows": [{**row, "seconds": seconds / max(len(found), 1)} for row in found]}

        found = folder.cached("merges", {**identity, "target": target}, merges)["rows"]
        rows += [{**tag, **row} for row in found]
        lc = next((r for r in found if r["kind"] == LC_GENERIC.kind), None)
        for kind in retrains:
            scale = 1 if kind == RETRAIN else (lc["members"] if lc is not None else 0)
            if scale < 1:
                continue
            # scale 1 is the plain retrain's configuration: one model serves both rows
            name = RETRAIN if scale == 1 else RETRAIN_MATCHED
            config = setup.config(
                f"{name}-{group.label}-s{group.seed}-t{index}",
                init_seed=group.init_seeds[0],
                stream_seed=group.stream_seed(1000 + 10 * index + (scale != 1)),
                target_epsilon=target,
                scale=scale,
            )
            rows.append(model_row(kind, group, target, train_unit(folder, data, config), setup))
    return rows


def merge_methods(study: CandidateStudy) -> tuple[MergeMethod, ...]:
    """RS; LC under the generic gate, alone and with RS between two subset merges; and LC
    under the structured gate unless switched off."""
    return (
        RS,
        LC_GENERIC,
        LC_GENERIC_INTERPOLATED,
        *((LC_STRUCTURED,) if study.structured else ()),
    )


def study_targets(study: CandidateStudy, candidates: Sequence[ModelDir]) -> list[float]:
    """The study's explicit targets, else its grid between the candidates' ε."""
    if study.targets:
        return list(study.targets)
    epsilons = [candidate_bound(c.record, study.delta).epsilon for c in candidates]
    return target_grid(epsilons, study.grid)


def target_grid(epsilons: Sequence[float], count: int) -> list[float]:
    """``count`` targets, geometric from the most private candidate's ε to the least
    private's (both ends included)."""
    low, high = min(epsilons), max(epsilons)
    if count < 2 or high <= low:
        return [low]
    return [float(low * (high / low) ** (i / (count - 1))) for i in range(count)]


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation over seeds per (group, kind, target): test accuracy, the
    drawn RS accuracy, ε (gating, PLD, RDP); candidates are keyed by their σ instead."""
    table = table.copy()
    key = table.target_epsilon.where(table.kind != "candidate", -table.noise_multiplier)
    table["point"] = key.fillna(0.0)
    out = []
    for (group, kind, _), rows in table.groupby(["group", "kind", "point"], sort=False):
        entry: dict[str, Any] = {
            "group": group,
            "kind": kind,
            "target_epsilon": rows.target_epsilon.iloc[0],
            "noise_multiplier": rows.noise_multiplier.mean(),
            "seeds": len(rows),
            "delta": rows.delta.iloc[0],
        }
        for column in SUMMARY_VALUES:
            values = rows[column].dropna()
            mean, std = mean_std(values) if len(values) else (None, None)
            entry[column], entry[f"{column}_std"] = mean, std
        out.append(entry)
    return pd.DataFrame(out)


def as_table(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=STUDY_COLUMNS)


def percent(mean: float | None, std: float | None) -> str:
    """``83.45 ± 0.12`` (accuracy fractions as percentages); blank when missing."""
    if mean is None or mean != mean:
        return ""
    return f"{100 * mean:.2f} ± {100 * (std or 0.0):.2f}"


def accuracy_table(summary: pd.DataFrame, group: str, kinds: Sequence[str]) -> pd.DataFrame:
    """One row per target, one column per kind: test accuracy in %, mean ± std over seeds;
    RS also as one drawn release."""
    part = summary[(summary.group == group) & (summary.kind != "candidate")]
    out = []
    for target, rows in part.groupby("target_epsilon", sort=True):
        entry: dict[str, Any] = {"target ε": f"{target:.3f}"}
        by_kind = {r.kind: r for r in rows.itertuples()}
        for kind in kinds:
            row = by_kind.get(kind)
            entry[kind] = percent(row.test_accuracy, row.test_accuracy_std) if row else ""
            if kind == "rs":
                entry["rs drawn"] = (
                    percent(row.drawn_test_accuracy, row.drawn_test_accuracy_std) if row else ""
                )
        out.append(entry)
    return pd.DataFrame(out)


def epsilon_table(summary: pd.DataFrame, group: str) -> pd.DataFrame:
    """Every point's ε (mean over seeds): gating, PLD and RDP, at δ."""
    part = summary[summary.group == group]
    return pd.DataFrame(
        {
            "kind": part.kind,
            "target ε": part.target_epsilon,
            "σ": part.noise_multiplier,
            "ε (gating)": part.epsilon,
            "ε PLD": part.epsilon_pld,
            "ε RDP": part.epsilon_rdp,
            "δ": [f"{d:g}" for d in part.delta],
            "test %": [
                percent(m, d)
                for m, d in zip(part.test_accuracy, part.test_accuracy_std, strict=True)
            ],
            "seeds": part.seeds,
        }
    )


def paired_gaps(table: pd.DataFrame, kinds: Sequence[str], reference: str) -> pd.DataFrame:
    """Per (group, target, kind): test accuracy of ``kind`` minus ``reference`` in the same
    seed, mean and std over seeds (the seed pairs the two)."""
    merged = table[table.kind.isin(kinds)].merge(
        table[table.kind == reference][["group", "seed", "target_epsilon", "test_accuracy"]],
        on=["group", "seed", "target_epsilon"],
        suffixes=("", "_reference"),
    )
    merged["gap"] = merged.test_accuracy - merged.test_accuracy_reference
    out = []
    for (group, kind, target), rows in merged.groupby(["group", "kind", "target_epsilon"]):
        mean, std = mean_std(rows.gap)
        out.append(
            dict(
                group=group,
                kind=kind,
                reference=reference,
                target_epsilon=target,
                gap=mean,
                gap_std=std,
                seeds=len(rows),
            )
        )
    return pd.DataFrame(out)


def plot_gaps(gaps: pd.DataFrame, path: Any, title: str) -> Any:
    """Accuracy gap to a reference per target (percentage points), one line per kind."""
    with figure(path, size=(7, 4.2)) as (axes,):
        for (kind, reference), rows in gaps.groupby(["kind", "reference"], sort=False):
            rows = rows.sort_values("target_epsilon")
            axes.errorbar(
                rows.target_epsilon,
                100 * rows.gap,
                yerr=100 * rows.gap_std,
                fmt="-o",
                markersize=3,
                capsize=2,
                label=f"{kind} − {reference}",
            )
        axes.axhline(0, color="black", linewidth=0.8)
        log_epsilon_axis(axes, "target ε")
        axes.set_ylabel("test accuracy difference (pp)")
        axes.set_title(title)
    return path


def series_metrics(summary: pd.DataFrame) -> list[tuple[str, float, int]]:
    """MLflow metrics: per group and kind, accuracy and ε (gating, PLD, RDP) as series whose
    step is the point's index (targets ascending; candidates by ε)."""
    metrics = []
    for (group, kind), rows in summary.groupby(["group", "kind"], sort=False):
        rows = rows.sort_values("epsilon")
        for step, row in enumerate(rows.itertuples()):
            for column in ("test_accuracy", "epsilon", "epsilon_pld", "epsilon_rdp"):
                value = getattr(row, column)
                if value is not None and value == value:
                    metrics.append((f"{group}/{kind}/{column}", float(value), step))
    return metrics
