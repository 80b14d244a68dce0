"""The machinery the model studies share (docs/design.md#studies): train candidates and
retrains as cached units, calibrate every merge method at every target as cached units, and
summarise the rows over seeds.

A *group* is one set of candidates (one seed of the convex study; the shared- or
independent-initialisation set of the non-convex one). Per target it gets the rows of
:class:`~dpmerge.studies.frontier.FrontierContext` (RS with its expected and one drawn accuracy,
LC under each gate), and optionally

* ``retrain``: DP-SGD at the target, σ calibrated for the candidates' q and T so that it spends
  the whole target (PLD, to 1e-4 in σ), every other hyper-parameter the same;
* ``retrain-matched-m<m>``: the same with m times the batch and m times the epochs (so the same
  number of steps T and q·n·T·m per-example gradients), one for every m that some merge at the
  target uses (m = the candidates its release uses: the compute it consumed); each merge is
  compared with the one of its own m (m = 1: the plain retrain).

Every ε is derived by the accountants: merges by their calibration, models by
``candidate_bound`` of their record, each under PLD and RDP.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.pld import set_disk_cache
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelDir, load_model_dir
from dpmerge.data import DatasetSplits
from dpmerge.errors import InfeasibleTargetError
from dpmerge.evaluation import MergeAccuracy
from dpmerge.formatting import epsilon_text
from dpmerge.studies.frontier import (
    AUTO,
    COLUMNS,
    LC_GENERIC,
    LC_STRUCTURED,
    MIXTURE,
    RS,
    FrontierContext,
    MergeMethod,
    bound_columns,
)
from dpmerge.studies.output import StudyFolder, mean_std
from dpmerge.studies.plots import figure, log_epsilon_axis
from dpmerge.studies.settings import CandidateStudy, StudyConfigError
from dpmerge.training import TrainConfig, save_candidate, train_candidate, train_kept
from dpmerge.training.plan import plan_mechanism

RETRAIN, RETRAIN_MATCHED = "retrain", "retrain-matched"
RETRAIN_AVERAGED = "retrain-averaged"
"""With kept checkpoints: the retrain's checkpoints averaged (iterate averaging, no extra ε)."""
CONFIDENCE = 0.95
"""Level of the paired confidence intervals (Student t over seeds)."""


def matched_kind(members: int) -> str:
    """The retrain a merge using ``members`` candidates is compared with at equal compute."""
    return RETRAIN if members <= 1 else f"{RETRAIN_MATCHED}-m{members}"


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
    checkpoints: tuple[int, ...] = ()
    """Epochs whose end-of-epoch weights each model also keeps as candidates (checkpoints of
    one run: an LC over them averages its iterates at the cost of the longest)."""

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
        checkpoints=tuple(getattr(study, "checkpoints", ()) or ()),
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
        method="retrain",
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


def retrain_config(
    setup: TrainingSetup, data: DatasetSplits, name: str, target: float, **config: Any
) -> TrainConfig:
    """A retrain at ``target``: σ calibrated for its own q and T to spend the target (the
    fine PLD search of ``noise_multiplier_for_epsilon``), given explicitly so the unit's
    identity names it."""
    planned = setup.config(name, target_epsilon=target, **config)
    sigma = plan_mechanism(planned, data.dataset_size).noise_multiplier
    return setup.config(name, noise_multiplier=sigma, **config)


def train_group(
    folder: StudyFolder, data: DatasetSplits, setup: TrainingSetup, group: Group
) -> list[ModelDir]:
    """The group's candidates: one per σ, or with ``setup.checkpoints`` every kept checkpoint
    of each run."""
    models = []
    for i, (sigma, init) in enumerate(zip(group.sigmas, group.init_seeds, strict=True)):
        config = setup.config(
            f"{group.label}-s{group.seed}-c{i}-sigma{sigma:g}",
            init_seed=init,
            stream_seed=group.stream_seed(i),
            noise_multiplier=sigma,
        )
        if setup.checkpoints:
            models += train_checkpoints(folder, data, config, setup.checkpoints)
        else:
            models.append(train_unit(folder, data, config))
    return models


def train_checkpoints(
    folder: StudyFolder, data: DatasetSplits, config: TrainConfig, epochs: Sequence[int]
) -> list[ModelDir]:
    """One run of ``config``, kept at the end of each of ``epochs`` as a candidate
    (:func:`~dpmerge.training.train_kept`: one ``run_id``, checkpoints of one run)."""
    identity = {**asdict(config), "data": data.fingerprint, "checkpoints": sorted(epochs)}

    def build(path: Path) -> None:
        staging = path.with_name(f".{path.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        kept = train_kept(config, data, epochs, staging / "training-state.pt")
        for epoch, result in zip(sorted(set(epochs)), kept, strict=True):
            save_candidate(result, staging / f"e{epoch}", config.delta)
        os.replace(staging, path)

    root = folder.cached_dir(f"run-{config.name}", identity, build)
    return [load_model_dir(root / f"e{epoch}") for epoch in sorted(epochs)]


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
        "candidates": [str(c.path.relative_to(folder.root)) for c in candidates],
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
        # a retrain per compute some merge used (none where no merge is feasible)
        scales = sorted({1, *(row["members"] for row in found)}) if retrains and found else []
        for scale in scales:
            if scale > 1 and RETRAIN_MATCHED not in retrains:
                continue
            kind = matched_kind(scale)
            config = retrain_config(
                setup,
                data,
                f"{kind}-{group.label}-s{group.seed}-t{index}",
                target,
                init_seed=group.init_seeds[0],
                stream_seed=group.stream_seed(1000 + 100 * index + scale),
                scale=scale,
            )
            if scale == 1 and setup.checkpoints:
                kept = train_checkpoints(folder, data, config, setup.checkpoints)
                rows.append(model_row(kind, group, target, kept[-1], setup))
                rows.append(averaged_row(group, target, kept, data, setup))
                continue
            model = train_unit(folder, data, config)
            rows.append({**model_row(kind, group, target, model, setup), "members": scale})
    return rows


def averaged_row(
    group: Group,
    target: float,
    kept: Sequence[ModelDir],
    data: DatasetSplits,
    setup: TrainingSetup,
) -> dict[str, Any]:
    """``retrain-averaged``: the retrain's kept checkpoints averaged with equal weights (what
    an LC over one run's checkpoints releases, at the retrain's own ε)."""
    merges = MergeAccuracy(kept[0].spec, [m.weights_file for m in kept], device=setup.device)
    equal = tuple(1 / len(kept) for _ in kept)
    row = model_row(RETRAIN_AVERAGED, group, target, kept[-1], setup)
    row.update(
        test_accuracy=merges.accuracy(equal, data.test),
        validation_accuracy=merges.accuracy(equal, data.validation),
        candidates=json.dumps([m.record.name for m in kept]),  # type: ignore[union-attr]
    )
    return row


def merge_methods(study: CandidateStudy) -> tuple[MergeMethod, ...]:
    """RS; LC under the generic gate; the mixture of two subset merges; the provable default
    ``auto`` among those three; and LC under the structured gate unless switched off."""
    return (RS, LC_GENERIC, MIXTURE, AUTO, *((LC_STRUCTURED,) if study.structured else ()))


def study_targets(study: CandidateStudy, candidates: Sequence[ModelDir]) -> list[float]:
    """The study's explicit targets, else its grid between the candidates' ε (each run's end:
    kept checkpoints do not move the grid)."""
    if study.targets:
        return list(study.targets)
    ends: dict[str, MechanismRecord] = {}  # each run's end (its longest kept checkpoint)
    for record in (c.record for c in candidates):
        key = record.run_id or record.name  # type: ignore[union-attr]
        if key not in ends or record.steps > ends[key].steps:  # type: ignore[union-attr]
            ends[key] = record  # type: ignore[assignment]
    epsilons = [candidate_bound(r, study.delta).epsilon for r in ends.values()]
    return target_grid(epsilons, study.grid)


def target_grid(epsilons: Sequence[float], count: int) -> list[float]:
    """``count`` ≥ 2 targets, geometric from the most private candidate's ε to the least
    private's (both ends included). Refuses a grid that would collapse to one target."""
    low, high = min(epsilons), max(epsilons)
    if count < 2 or not high > low:
        raise StudyConfigError(
            f"a grid of {count} target(s) between ε = {epsilon_text(low)} and "
            f"{epsilon_text(high)} is degenerate: give at least two candidates with different "
            "ε and --grid ≥ 2, or explicit --targets"
        )
    return [float(low * (high / low) ** (i / (count - 1))) for i in range(count)]


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation over seeds per (group, kind, target): test accuracy, the
    drawn RS accuracy, ε (gating, PLD, RDP); candidates are keyed by their σ and length
    instead (a kept checkpoint is a candidate of its own)."""
    table = table.copy()
    candidate = table.kind == "candidate"
    key = table.target_epsilon.where(~candidate, -table.noise_multiplier)
    table["point"] = key.fillna(0.0)
    table["length"] = table.per_example_gradients.where(candidate, 0).fillna(0)
    out = []
    groups = table.groupby(["group", "kind", "point", "length"], sort=False)
    for (group, kind, _, length), rows in groups:
        entry: dict[str, Any] = {
            "group": group,
            "kind": kind,
            "target_epsilon": rows.target_epsilon.iloc[0],
            "noise_multiplier": rows.noise_multiplier.mean(),
            "steps": round(length / rows.batch_size.mean()) if length else None,
            "seeds": len(rows),
            "delta": rows.delta.iloc[0],
        }
        for column in SUMMARY_VALUES:
            values = rows[column].dropna()
            mean, std = mean_std(values) if len(values) else (None, None)
            entry[column], entry[f"{column}_std"] = mean, std
        out.append(entry)
    return pd.DataFrame(out)


def require_feasible(table: pd.DataFrame, targets: Sequence[float], delta: float) -> None:
    """Refuse, in one line, a study where no merge meets any target (nothing to plot)."""
    candidates = table[table.kind == "candidate"]
    if len(table[table.target_epsilon.notna() & ~table.kind.str.startswith(RETRAIN)]):
        return
    low, high = float(candidates.epsilon.min()), float(candidates.epsilon.max())
    raise InfeasibleTargetError(
        f"every target ({', '.join(f'{t:g}' for t in targets)}) is below the most private "
        f"candidate's ε = {epsilon_text(low)} at δ = {delta:g}: no merge reaches any of them "
        "(the finished units are kept)",
        target_epsilon=min(targets),
        delta=delta,
        reachable_epsilon_range=(low, high),
    )


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
            "T": ["" if t is None or t != t else str(int(t)) for t in part.steps],
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
    """Per (group, target, kind): test accuracy of ``kind`` minus its reference in the same
    seed (the seed pairs the two): mean, standard deviation and a Student-t confidence interval
    (:data:`CONFIDENCE`) over seeds. ``reference`` ``retrain`` pairs every merge with the
    retrain at the target; ``retrain-matched`` with the retrain of its own compute
    (:func:`matched_kind` of the candidates its release uses)."""
    merges = table[table.kind.isin(kinds)].copy()
    if reference == RETRAIN_MATCHED:
        merges["reference_kind"] = merges.members.map(lambda m: matched_kind(int(m)))
    else:
        merges["reference_kind"] = reference
    references = table[table.kind.str.startswith(RETRAIN)][
        ["group", "seed", "target_epsilon", "kind", "test_accuracy"]
    ].rename(columns={"kind": "reference_kind", "test_accuracy": "test_accuracy_reference"})
    merged = merges.merge(references, on=["group", "seed", "target_epsilon", "reference_kind"])
    merged["gap"] = merged.test_accuracy - merged.test_accuracy_reference
    out = []
    for (group, kind, target), rows in merged.groupby(["group", "kind", "target_epsilon"]):
        mean, std = mean_std(rows.gap)
        low, high = confidence_interval(mean, std, len(rows))
        out.append(
            dict(
                group=group,
                kind=kind,
                reference=reference,
                target_epsilon=target,
                gap=mean,
                gap_std=std,
                ci_low=low,
                ci_high=high,
                seeds=len(rows),
            )
        )
    return pd.DataFrame(out)


def gap_table(gaps: pd.DataFrame, kinds: Sequence[str]) -> pd.DataFrame:
    """One row per target, one column per kind: the paired gap in pp with its confidence
    interval, ``+0.20 [−0.24, +0.65]``."""
    out = []
    for target, rows in gaps.groupby("target_epsilon", sort=True):
        entry: dict[str, Any] = {"target ε": f"{target:.3f}"}
        by_kind = {r.kind: r for r in rows.itertuples()}
        for kind in kinds:
            row = by_kind.get(kind)
            entry[kind] = "" if row is None else _gap_text(row.gap, row.ci_low, row.ci_high)
        out.append(entry)
    return pd.DataFrame(out)


def _gap_text(gap: float, low: float | None, high: float | None) -> str:
    text = f"{100 * gap:+.2f}"
    if low is None or high is None or low != low:
        return text
    return f"{text} [{100 * low:+.2f}, {100 * high:+.2f}]"


def confidence_interval(mean: float, std: float, n: int) -> tuple[float | None, float | None]:
    """The two-sided Student-t interval of a mean over ``n`` paired differences (``None``
    for a single seed)."""
    if n < 2:
        return None, None
    from scipy.stats import t

    half = float(t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * std / n**0.5
    return mean - half, mean + half


def plot_gaps(gaps: pd.DataFrame, path: Any, title: str) -> Any:
    """Accuracy gap to a reference per target (percentage points) with its paired confidence
    interval, one line per kind."""
    with figure(path, size=(7, 4.2)) as (axes,):
        for (kind, reference), rows in gaps.groupby(["kind", "reference"], sort=False):
            rows = rows.sort_values("target_epsilon")
            low = (rows.gap - rows.ci_low.fillna(rows.gap)).clip(lower=0)
            high = (rows.ci_high.fillna(rows.gap) - rows.gap).clip(lower=0)
            axes.errorbar(
                rows.target_epsilon,
                100 * rows.gap,
                yerr=[100 * low, 100 * high],
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
