"""q, T and σ, fixed before training starts (docs/design.md#mechanism-record)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpmerge.accounting.candidate import noise_multiplier_for_epsilon
from dpmerge.training.config import TrainConfig


@dataclass(frozen=True)
class MechanismPlan:
    """q, T and σ fixed before training: q = 1/len(loader) exactly as Opacus' ``DPDataLoader``
    sets it (not B/n), T counted in steps (an Opacus pass over its loader is int(1/q) steps, one
    short for some loader lengths, so dpmerge counts steps, not passes)."""

    sample_rate: float
    steps_per_epoch: int
    total_steps: int
    noise_multiplier: float


def plan_mechanism(config: TrainConfig, dataset_size: int) -> MechanismPlan:
    """q, T and σ (calibrated to the target ε at this q and T when one is given)."""
    steps_per_epoch = math.ceil(dataset_size / config.batch_size)
    sample_rate = 1 / steps_per_epoch
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    sigma = config.noise_multiplier
    if sigma is None:
        assert config.target_epsilon is not None
        sigma = noise_multiplier_for_epsilon(
            config.target_epsilon, config.delta, sample_rate, total_steps
        )
    return MechanismPlan(sample_rate, steps_per_epoch, total_steps, sigma)
