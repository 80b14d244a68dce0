"""The pretrained-initialisation study (docs/design.md#studies): candidates fine-tuned with
DP-SGD from one initialisation pre-trained without privacy on data declared public; does a
merge beat every candidate and retraining at the target?

Public data: the first ``public_rows`` rows of the training split are *declared* public for
this study. They are removed from the private training set (the candidates' records fingerprint
only the remaining rows, so no ε covers them) and used only by the non-private pre-training.
Being drawn from the same distribution, they make this the favourable case of public
pre-training. The pre-trained weights are a safetensors file; every candidate's record names it
as its initialisation (``checkpoint:<sha256>``, docs/design.md#mechanism-record).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import pandas as pd
import torch
from safetensors.torch import save_file
from torch import nn

from dpmerge.accounting.account import account
from dpmerge.artifacts import ModelDir, ModelSpec
from dpmerge.data import DatasetSplits, Split, fingerprint, load_dataset
from dpmerge.evaluation import evaluate
from dpmerge.models import build_model, model_spec
from dpmerge.studies import engine
from dpmerge.studies.engine import RETRAIN, Group
from dpmerge.studies.frontier import plot_frontier
from dpmerge.studies.output import StudyFolder, StudyResult, markdown_table
from dpmerge.studies.settings import CandidateStudy, StudyConfigError

STUDY = "pretrained"
PUBLIC_INIT = "public-init"
PRETRAINING = (
    "dataset",
    "data_root",
    "limit",
    "model",
    "device",
    "public_rows",
    "pretrain_epochs",
    "pretrain_learning_rate",
    "pretrain_batch_size",
)
"""The settings the pre-trained initialisation depends on (its cache key, with the seed)."""


@dataclass(frozen=True)
class PretrainedStudy(CandidateStudy):
    public_rows: int = 6000
    pretrain_epochs: int = 3
    pretrain_learning_rate: float = 0.1
    pretrain_batch_size: int = 64

    COUNTS = (*CandidateStudy.COUNTS, "public_rows", "pretrain_epochs", "pretrain_batch_size")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pretrain_learning_rate > 0:
            raise StudyConfigError("pretrain_learning_rate must be positive")


def split_public(data: DatasetSplits, rows: int) -> tuple[Split, DatasetSplits]:
    """(public rows, the data set whose training split is the remaining private rows)."""
    if rows >= len(data.train):
        raise StudyConfigError(
            f"public_rows = {rows} leaves no private training rows (of {len(data.train)})"
        )
    public = Split(data.train.features[:rows], data.train.labels[:rows])
    private = Split(data.train.features[rows:], data.train.labels[rows:])
    return public, replace(data, train=private, fingerprint=fingerprint(data.name, private))


def pretrain(spec: ModelSpec, public: Split, study: PretrainedStudy, seed: int) -> nn.Module:
    """Non-private plain SGD on the public rows (shuffled mini-batches, cross-entropy)."""
    model = build_model(spec, seed=seed).to(study.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=study.pretrain_learning_rate)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(study.pretrain_epochs):
        order = torch.randperm(len(public), generator=generator)
        for start in range(0, len(public), study.pretrain_batch_size):
            rows = order[start : start + study.pretrain_batch_size]
            x, y = public.features[rows].to(study.device), public.labels[rows].to(study.device)
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model.to("cpu")


def run_pretrained_study(study: PretrainedStudy, folder: StudyFolder) -> StudyResult:
    data = load_dataset(study.dataset, study.data_root, limit=study.limit)
    public, private = split_public(data, study.public_rows)
    base = engine.training_setup(study)
    spec = model_spec(study.model_name, private)
    methods = engine.merge_methods(study)
    k, points = len(study.sigmas), study.points + (0 if study.targets else 1)
    rows, targets = [], []
    with engine.running(folder, study.seeds * (1 + k + 2 * points), STUDY):
        for seed in range(study.seeds):
            identity = {key: getattr(study, key) for key in PRETRAINING}
            identity.update(seed=seed, public=fingerprint(data.name, public))

            def build(path, seed=seed) -> None:  # type: ignore[no-untyped-def]
                model = pretrain(spec, public, study, seed)
                path.mkdir(parents=True)
                state = {k: v.contiguous() for k, v in model.state_dict().items()}
                save_file(state, str(path / "pretrained.safetensors"))

            checkpoint = folder.cached_dir("pretrain", identity, build) / "pretrained.safetensors"
            setup = replace(base, init_checkpoint=str(checkpoint))
            group = Group("pretrained", seed, study.sigmas, (seed,) * k)
            candidates = engine.train_group(folder, private, setup, group)
            targets = targets or _targets(study, candidates)
            rows += engine.group_rows(
                folder, private, setup, group, candidates, targets, methods, (RETRAIN,)
            )
            rows.append(_public_row(spec, checkpoint, private, group, study.delta))
    table = engine.as_table(rows)
    engine.require_feasible(table, targets, study.delta)
    summary = engine.summarise(table)
    verdict = _verdict(table, [m.kind for m in methods])
    title = f"{study.dataset} {study.model} from a public initialisation (δ = {study.delta:g})"
    files = [
        folder.write_table("pretrained", table),
        folder.write_table("summary", summary),
        plot_frontier(summary[summary.kind != PUBLIC_INIT], folder.root / "frontier.png", title),
    ]
    files.append(folder.write_text("pretrained.md", _markdown(study, summary, methods, verdict)))
    return folder.result(
        STUDY, files, {**asdict(study), "targets": targets}, engine.series_metrics(summary), verdict
    )


def _targets(study: PretrainedStudy, candidates: list[ModelDir]) -> list[float]:
    """The study's targets; by default the grid between the candidates' ε and the top rung of
    the generic ladder (every candidate composed), where one merge may use all of them."""
    targets = engine.study_targets(study, candidates)
    if study.targets:
        return targets
    records = [c.record for c in candidates]
    uniform = [1.0 / len(records)] * len(records)
    top = account(records, "lc", uniform, study.delta, gating_bound="generic")  # type: ignore[arg-type]
    return [*targets, top.epsilon]


def _public_row(spec, checkpoint, data, group, delta) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The pre-trained model itself: it saw no private row (ε = 0 for the private data)."""
    from safetensors.torch import load_file

    state = load_file(str(checkpoint))
    return dict(
        group=group.label,
        seed=group.seed,
        kind=PUBLIC_INIT,
        target_epsilon=None,
        epsilon=0.0,
        accountant=None,
        epsilon_pld=0.0,
        epsilon_rdp=0.0,
        delta=delta,
        test_accuracy=evaluate((spec, state), data.test)["accuracy"],
        validation_accuracy=evaluate((spec, state), data.validation)["accuracy"],
        members=0,
        noise_multiplier=0.0,
    )


def _verdict(table: pd.DataFrame, kinds: list[str]) -> dict[str, object]:
    """Per target (and seed): whether the best merge beats every candidate, and the retrain."""
    merges = table[table.kind.isin(kinds)]
    best_candidate = table[table.kind == "candidate"].groupby("seed").test_accuracy.max()
    retrain = table[table.kind == RETRAIN].set_index(["seed", "target_epsilon"]).test_accuracy
    best = merges.groupby(["seed", "target_epsilon"]).test_accuracy.max()
    beats_all = sum(best[key] > best_candidate[key[0]] for key in best.index)
    beats_retrain = sum(best[key] > retrain.get(key, float("inf")) for key in best.index)
    return {
        "points (seed × target)": len(best),
        "best merge > every candidate": int(beats_all),
        "best merge > retrain": int(beats_retrain),
    }


def _markdown(study, summary, methods, verdict) -> str:  # type: ignore[no-untyped-def]
    kinds = [m.kind for m in methods] + [RETRAIN]
    public = summary[summary.kind == PUBLIC_INIT]
    lines = [
        f"# Pretrained initialisation: {study.dataset}, {study.model}",
        "",
        f"Pre-training: {study.pretrain_epochs} epochs of non-private SGD (lr "
        f"{study.pretrain_learning_rate:g}, batch {study.pretrain_batch_size}) on the first "
        f"{study.public_rows} training rows, declared public and removed from the private set. "
        f"Fine-tuning: DP-SGD, {study.epochs} epoch(s), expected batch {study.batch_size}, "
        f"σ = {', '.join(f'{s:g}' for s in study.sigmas)}; {study.seeds} seed(s); "
        f"δ = {study.delta:g}. Test accuracy in %.",
        "",
        f"Public initialisation alone (ε = 0 on the private rows): "
        f"{engine.percent(public.test_accuracy.mean(), public.test_accuracy_std.mean())}",
        "",
        markdown_table(engine.accuracy_table(summary, "pretrained", kinds)),
        "",
        markdown_table(engine.epsilon_table(summary[summary.kind != PUBLIC_INIT], "pretrained")),
        "",
        "## Verdict",
        "",
    ]
    lines += [f"* {key}: {value}" for key, value in verdict.items()]
    return "\n".join(lines) + "\n"
