"""The engines that run one DP-SGD candidate, behind one protocol (docs/training.md, "Engines").

* :class:`~dpmerge.training.engines.opacus.OpacusEngine`: Opacus 1.6 with Poisson sampling,
  grad-sample modes ``hooks``, ``functorch``, ``ew``, ``ghost``, or ``vmap`` (per-example
  gradients by ``torch.func``, :mod:`~dpmerge.training.engines.vmap`): any model;
* :class:`~dpmerge.training.engines.linear.LinearExactEngine`: the same mechanism for
  ``logreg`` with analytic per-example norms and O(B) Poisson sampling, the default there.

Both run plain SGD (no momentum, no weight decay) on Poisson-sampled batches with per-example
clipping and Gaussian noise, and report what they ran (:class:`~dpmerge.training.record.Ran`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from opacus.accountants import RDPAccountant
from torch import nn

from dpmerge.data import Split
from dpmerge.training.checkpoint import RunState
from dpmerge.training.config import TrainConfig
from dpmerge.training.engines.linear import LinearExactEngine
from dpmerge.training.engines.opacus import OpacusEngine
from dpmerge.training.plan import MechanismPlan
from dpmerge.training.record import Ran
from dpmerge.training.streams import Streams
from dpmerge.vocabulary import Engine


class DPEngine(Protocol):
    """One run's engine: made private once, then stepped until the planned T."""

    sampler_id: str | None
    """Names the batch sampler in lineages when it is not Opacus' (its stream differs)."""
    accountant: RDPAccountant
    """Stepped once per step: the running ε and the evidence for the record's steps."""
    model: nn.Module
    """The module being trained, updated in place (scored between epochs)."""

    def start(
        self, model: nn.Module, train: Split, state: RunState, streams: Streams | None
    ) -> None:
        """Make ``model`` private on ``train`` at ``state.step``: seed the noise and batch
        generators from ``streams`` (a new run) or restore them from ``state`` (a resumed one)."""
        ...

    def step(self) -> torch.Tensor:
        """One noisy step on the next Poisson batch; the batch's mean loss (NaN if empty)."""
        ...

    def snapshot(self, state: RunState) -> RunState:
        """``state`` with the model, optimizer, generators and accountant as they stand."""
        ...

    def ran(self) -> Ran:
        """What ran, read off the engine's own objects."""
        ...

    def module(self) -> nn.Module:
        """The trained module without the engine's wrappers."""
        ...


def make_engine(
    config: TrainConfig, plan: MechanismPlan, device: torch.device, dataset_size: int
) -> DPEngine:
    """The engine ``config`` asks for (``grad_sample_mode``)."""
    if config.engine == Engine.LINEAR_EXACT:
        return LinearExactEngine(config, plan, device, dataset_size)
    return OpacusEngine(config, plan, device)
