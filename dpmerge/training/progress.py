"""The bookkeeping of a run's step loop, whichever engine runs it: the step count, the
progress bar with the running RDP ε, the checkpoint cadence, the training clock and the
per-epoch history (:mod:`dpmerge.training.history`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
from opacus.accountants import RDPAccountant
from tqdm import tqdm

from dpmerge.training.checkpoint import RunState
from dpmerge.training.config import TrainConfig
from dpmerge.training.history import EpochMetrics
from dpmerge.training.plan import MechanismPlan

EPSILON_REFRESH_SECONDS = 1.0
"""The progress bar's running ε is refreshed at most this often: one RDP evaluation takes
~20 ms, as long as 40 linear-exact steps."""

Scores = Callable[[], dict[str, float | None]]
"""The held-out scores of the model as it stands (``history.score_held_out``)."""


class Progress:
    """Counts the steps that ran, ends epochs and saves checkpoints on their cadence."""

    def __init__(
        self,
        config: TrainConfig,
        plan: MechanismPlan,
        state: RunState,
        accountant: RDPAccountant,
        *,
        scores: Scores,
        save: Callable[[], None] | None,
    ) -> None:
        self.config, self.plan, self.state = config, plan, state
        self.accountant, self.scores, self.save = accountant, scores, save
        self.bar = tqdm(
            total=plan.total_steps,
            initial=state.step,
            disable=not config.progress,
            desc=config.name or f"{config.dataset}/{config.model} σ={plan.noise_multiplier:.3g}",
            unit="step",
        )
        self.clock: float | None = time.perf_counter()
        self.shown = self.clock
        self.losses: list[torch.Tensor] = []
        """Batch losses not yet read back (one read an epoch or a checkpoint, not a step: on a
        GPU each read waits for the device)."""

    def stepped(self, loss: torch.Tensor) -> None:
        """Count one step that ran, with the mean loss of its batch (NaN if it was empty)."""
        state, config = self.state, self.config
        state.step += 1
        self.losses.append(loss.detach())
        self.bar.update()
        if config.progress and time.perf_counter() - self.shown >= EPSILON_REFRESH_SECONDS:
            epsilon = self.accountant.get_epsilon(config.delta)
            self.bar.set_postfix(loss=f"{loss.item():.3f}", eps_rdp=f"{epsilon:.3f}")
            self.shown = time.perf_counter()
        if state.step % self.plan.steps_per_epoch == 0:
            self.end_epoch()
        if self.save is not None and state.step % config.checkpoint_every == 0:
            self.read_losses()  # waits for the device: before the clock is read
            self._tick()
            self.save()

    def read_losses(self) -> None:
        """Move the pending batch losses into the state (empty batches' NaN left out)."""
        if self.losses:
            values = torch.stack(self.losses).tolist()
            self.state.epoch_loss.extend(v for v in values if not math.isnan(v))
            self.losses = []

    def end_epoch(self) -> None:
        """Score the model and append the epoch to the history (outside the training clock)."""
        state = self.state
        self.read_losses()
        self._tick()
        losses = state.epoch_loss
        entry = EpochMetrics(
            epoch=math.ceil(state.step / self.plan.steps_per_epoch),
            step=state.step,
            train_loss=sum(losses) / len(losses) if losses else None,
            train_seconds=state.seconds,
            **self.scores(),
        )
        state.history.append(asdict(entry))
        state.epoch_loss = []
        if self.clock is not None:
            self.clock = time.perf_counter()

    def close(self) -> None:
        """Stop the training clock (a partial last epoch may still be ended)."""
        self.read_losses()
        self._tick()
        self.clock = None
        self.bar.close()

    def _tick(self) -> None:
        """Add the time since the last tick to the training clock, if it runs."""
        if self.clock is not None:
            now = time.perf_counter()
            self.state.seconds, self.clock = self.state.seconds + now - self.clock, now
