"""Checkpoints: a resumed run continues the same noise and batch streams and its record counts
every step, so it ends bit-identical to an uninterrupted run on the CPU (docs/training.md,
"Checkpoints and resuming").

A checkpoint holds the model, the optimizer, both generator states, the accountant history, the
step, the training clock and the epoch history so far, under the run's identity: a checkpoint
of another run is refused, naming the field that differs. The generator states are the
mechanism's secret randomness: keep a checkpoint as private as the data.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpmerge.artifacts import ModelSpec
from dpmerge.training.config import TrainConfig, TrainingConfigError
from dpmerge.training.plan import MechanismPlan
from dpmerge.training.streams import Streams

CHECKPOINT_FORMAT = 1


@dataclass
class RunState:
    """What a checkpoint restores (the identity is checked, everything else resumed)."""

    run_id: str
    noise_lineage: str
    batch_lineage: str
    step: int = 0
    seconds: float = 0.0
    model: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None
    noise_generator: torch.Tensor | None = None
    sampler_generator: torch.Tensor | dict[str, Any] | None = None
    accountant_history: list[tuple[float, float, int]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One :class:`~dpmerge.training.history.EpochMetrics` (as a dict) per finished epoch."""
    epoch_loss: list[float] = field(default_factory=list)
    """The losses of the current epoch's non-empty batches so far."""

    @classmethod
    def new(cls, streams: Streams) -> RunState:
        return cls(streams.run_id, streams.noise_lineage, streams.batch_lineage)


def run_identity(
    config: TrainConfig,
    plan: MechanismPlan,
    *,
    dataset: str,
    spec: ModelSpec,
    initialisation: str,
    device: torch.device,
) -> dict[str, Any]:
    """What a checkpoint must agree on to be resumed by this run (plain values only: the
    checkpoint is read back with ``weights_only=True``)."""
    return {
        "dataset": dataset,
        "model": spec.to_dict(),
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "learning_rate": config.lr,
        "clip_norm": config.clip_norm,
        "initialisation": initialisation,
        "noise_seed": config.noise_seed,
        "batch_seed": config.batch_seed,
        "device_type": device.type,
        "engine": config.engine.value,
    }


def save_checkpoint(path: Path, identity: dict[str, Any], state: RunState) -> None:
    """Write ``state`` atomically (a staged file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "identity": identity, **asdict(state)}, staging)
    os.replace(staging, path)


def load_checkpoint(path: Path, identity: dict[str, Any]) -> RunState:
    """The state saved at ``path``, if it belongs to the run of ``identity``."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise TrainingConfigError(f"checkpoint {path} is unreadable ({error})") from None
    if not isinstance(saved, dict) or saved.get("format") != CHECKPOINT_FORMAT:
        raise TrainingConfigError(f"{path} is not a dpmerge training checkpoint")
    differing = sorted(k for k in identity if saved["identity"].get(k) != identity[k])
    if differing:
        raise TrainingConfigError(
            f"checkpoint {path} belongs to a different run (differs in {', '.join(differing)})"
        )
    state = RunState(**{k: v for k, v in saved.items() if k not in ("format", "identity")})
    state.accountant_history = [tuple(entry) for entry in state.accountant_history]
    return state
