"""Training one candidate from its config, and writing its model directory
(docs/design.md#mechanism-record, docs/training.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.delta import check_delta_against
from dpmerge.accounting.records import MechanismRecord
from dpmerge.artifacts import ModelSpec, save_model_dir
from dpmerge.data import DatasetSplits
from dpmerge.fine_tuning import FineTune, declared_fine_tune
from dpmerge.models import build_model, initialisation_id, load_pretrained, model_spec
from dpmerge.training.checkpoint import (
    RunState,
    load_checkpoint,
    run_identity,
    save_checkpoint,
)
from dpmerge.training.config import TrainConfig, TrainingConfigError
from dpmerge.training.engines import make_engine
from dpmerge.training.history import EpochMetrics, score_held_out
from dpmerge.training.plan import plan_mechanism
from dpmerge.training.progress import Progress
from dpmerge.training.record import AccountantHistory, mechanism_record
from dpmerge.training.streams import new_streams


@dataclass(frozen=True, eq=False)
class TrainResult:
    """A trained candidate: the module, its spec, the record of what ran, its metrics and its
    per-epoch history.

    ``accountant_history`` is the engine's own RDP accountant ``(σ, q, steps)`` history of the
    run, the evidence the record was taken from (Opacus logs its pessimistic q, see
    :meth:`OpacusEngine.ran`; the linear engine logs its sampler's q). ``history`` has one
    entry per epoch (and a partial one when the run stopped mid-epoch); ``train_seconds`` is
    the wall time of the training itself, evaluations excluded, summed over resumed runs.
    """

    model: nn.Module
    spec: ModelSpec
    record: MechanismRecord
    metrics: dict[str, Any]
    accountant_history: AccountantHistory
    history: tuple[EpochMetrics, ...]
    train_seconds: float

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}


def train_candidate(config: TrainConfig, data: DatasetSplits) -> TrainResult:
    """Train one DP-SGD candidate on ``data.train`` and record what ran.

    With ``config.checkpoint_path`` set, an existing checkpoint of the same run is resumed and
    a checkpoint is written every ``checkpoint_every`` steps and at the end. A δ of 1/n or more
    for the n training rows is refused (:func:`~dpmerge.accounting.delta.check_delta_against`).
    """
    if config.dataset != data.name:
        raise TrainingConfigError(
            f"config is for dataset {config.dataset.value!r} but the data is {data.name!r}"
        )
    check_delta_against(config.delta, data.dataset_size)  # δ ≥ 1/n is refused before training
    device = config.torch_device()
    spec = model_spec(
        config.model,
        data,
        model_path=config.model_path,
        fix=config.fix_model,
        fine_tune=_fine_tune(config),
    )
    plan = plan_mechanism(config, data.dataset_size)
    if config.init_checkpoint is not None:
        model, init_id = load_pretrained(spec, config.init_checkpoint)
    else:
        model = build_model(spec, seed=config.init_seed)
        init_id = initialisation_id(spec, config.init_seed)
    identity = run_identity(
        config, plan, dataset=data.fingerprint, spec=spec, initialisation=init_id, device=device
    )
    checkpoint = Path(config.checkpoint_path) if config.checkpoint_path else None
    engine = make_engine(config, plan, device, data.dataset_size)
    streams = None
    if checkpoint is not None and checkpoint.exists():
        state = load_checkpoint(checkpoint, identity)
        if state.step > plan.total_steps:
            raise TrainingConfigError(
                f"checkpoint {checkpoint} is at step {state.step}, "
                f"past this run's {plan.total_steps} steps"
            )
        model.load_state_dict(state.model)
    else:
        streams = new_streams(
            config.noise_seed,
            config.batch_seed,
            dataset_size=data.dataset_size,
            sample_rate=plan.sample_rate,
            sampler_id=engine.sampler_id,
        )
        state = RunState.new(streams)
    engine.start(model.to(device), data.train, state, streams)

    def save() -> None:
        assert checkpoint is not None
        save_checkpoint(checkpoint, identity, engine.snapshot(state))

    progress = Progress(
        config,
        plan,
        state,
        engine.accountant,
        scores=lambda: score_held_out(engine.model, data, device),
        save=save if checkpoint is not None else None,
    )
    while state.step < plan.total_steps:
        progress.stepped(engine.step())
    progress.close()
    if checkpoint is not None:
        save()
    if not state.history or state.history[-1]["step"] != state.step:
        progress.end_epoch()  # the partial epoch of an early stop (not in the checkpoint)

    history = tuple(EpochMetrics(**entry) for entry in state.history)
    name = config.name or f"{data.name}-{spec.label}-{state.run_id[:8]}"
    ran = engine.ran()
    record = mechanism_record(name, ran, plan, state, data, init_id)
    final = history[-1]
    metrics: dict[str, Any] = {
        "steps": record.steps,
        "train_seconds": state.seconds,
        "grad_sample_mode": config.mode.value,
        "validation_accuracy": final.validation_accuracy,
        "validation_loss": final.validation_loss,
        "test_accuracy": final.test_accuracy,
        "test_loss": final.test_loss,
    }
    return TrainResult(engine.module(), spec, record, metrics, ran.history, history, state.seconds)


def _fine_tune(config: TrainConfig) -> FineTune | None:
    """The declared fine-tune of a transformer, its base's digest read now."""
    if config.model_dir is None:
        return None
    return declared_fine_tune(
        config.model_dir,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_targets=config.lora_targets,
        train_layers=config.train_layers,
    )


def train_candidates(configs: Sequence[TrainConfig], data: DatasetSplits) -> list[TrainResult]:
    """Train several candidates of one loaded dataset, one after the other."""
    return [train_candidate(config, data) for config in configs]


def kept_name(name: str, epoch: int) -> str:
    """The name of run ``name``'s candidate kept at the end of ``epoch``."""
    return f"{name}-e{epoch}"


def train_kept(
    config: TrainConfig, data: DatasetSplits, epochs: Sequence[int], resume: Path
) -> Iterator[TrainResult]:
    """One run of ``config``, kept at the end of each of ``epochs`` as a candidate named
    :func:`kept_name`: checkpoints of one run (one ``run_id``), which merges count as one
    release unit at its longest kept checkpoint (docs/design.md#release-units).

    σ is fixed once for the whole run (a target ε is spent by its last epoch); between kept
    epochs the run resumes from its training checkpoint ``resume``, so it is the run an
    uninterrupted one would be. ``resume`` holds the noise's generator states: it is deleted
    when the last epoch is kept."""
    kept = sorted(set(epochs))
    if not kept or kept[0] < 1 or kept[-1] > config.epochs:
        raise TrainingConfigError(
            f"epochs to keep must lie in 1..{config.epochs} (the run's epochs), got {list(epochs)}"
        )
    if config.max_steps is not None or config.checkpoint_path is not None:
        raise TrainingConfigError(
            "keeping checkpoints sets the run's stops and its training checkpoint itself: "
            "give neither max_steps nor checkpoint_path"
        )
    plan = plan_mechanism(config, data.dataset_size)
    run = replace(
        config,
        noise_multiplier=plan.noise_multiplier,
        target_epsilon=None,
        checkpoint_path=str(resume),
    )
    name = config.name or f"{data.name}-{config.model_label}"
    for epoch in kept:
        stage = replace(run, max_steps=epoch * plan.steps_per_epoch, name=kept_name(name, epoch))
        yield train_candidate(stage, data)
    resume.unlink(missing_ok=True)


def save_candidate(result: TrainResult, out_dir: str | Path, delta: float) -> Path:
    """Write the candidate's model directory: weights, spec, record with its ε (PLD and RDP at
    ``delta``, docs/design.md#mechanism-record) and metrics with the per-epoch history of
    held-out scores (``dpmerge.artifacts`` layout; no training-set statistic)."""
    return save_model_dir(
        out_dir,
        result.weights,
        result.spec,
        record=result.record,
        candidate_privacy=candidate_bound(result.record, delta).to_dict(),
        metrics={**result.metrics, "history": [entry.public() for entry in result.history]},
    )
