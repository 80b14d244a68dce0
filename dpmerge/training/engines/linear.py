"""Exact DP-SGD for softmax regression without Opacus: the ``linear-exact`` engine
(docs/design.md#mechanism-record).

For one linear layer on flattened inputs under cross-entropy, the per-example gradient is an
outer product, so its norm and the clipped sum need no per-example gradients and no autograd.
With logits z_b = W·x_b + b and G_b = softmax(z_b) − onehot(y_b):

    g_b = (G_b ⊗ x_b, G_b),      ‖g_b‖² = ‖G_b‖² · (‖x_b‖² + 1),
    Σ_b clip(g_b) = (G̃ᵀX, Σ_b G̃_b)  with  G̃_b = min(1, C / (‖g_b‖ + 1e-6)) · G_b.

One step is the mechanism the record describes, with Opacus' DPOptimizer arithmetic (its clip
factor, its noise draws and their order, its divisor), so a run is recorded exactly like an
Opacus run of the same configuration:

* a Poisson batch at rate q (:class:`PoissonSubsetSampler`, O(B) per step instead of Opacus'
  Bernoulli draw over all n rows);
* per-example clipping at C of the whole gradient (weight and bias together);
* Gaussian noise N(0, σ²C²) per coordinate on each clipped sum, drawn from the run's noise
  generator as ``torch.normal`` over the weight, then the bias (none at σ = 0, as in Opacus);
  an empty batch is still a noisy step;
* plain SGD: θ ← θ − η·(Σ clip + noise) / B, B = int(n·q), Opacus' ``expected_batch_size``;
* an RDP accountant stepped once per step, its history the evidence for the record's steps.

:class:`LinearExactEngine` runs it for a ``logreg`` candidate behind the engine protocol
(:class:`~dpmerge.training.engines.DPEngine`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from opacus.accountants import RDPAccountant
from torch import nn

from dpmerge.data import Split
from dpmerge.training.checkpoint import RunState
from dpmerge.training.config import TrainConfig
from dpmerge.training.plan import MechanismPlan
from dpmerge.training.record import Ran, accountant_history
from dpmerge.training.streams import Streams

SAMPLER_ID = "binomial-subset"
"""Names this sampler's stream in batch lineages: a batch seed drives a different stream here
than in Opacus' sampler, so the two must never share a lineage
(docs/design.md#mechanism-record, "batch lineage")."""


class PoissonSubsetSampler:
    """Poisson sampling of n rows at rate q in O(B) per batch (docs/design.md#mechanism-record
    "sampling scheme").

    Poisson sampling includes each row independently with probability q, so a subset S of the
    n rows is the batch with probability q^|S| (1 − q)^(n − |S|), which depends on S only
    through k = |S|. Summing over the C(n, k) subsets of size k, P(|S| = k) = C(n, k) q^k
    (1 − q)^(n − k): the size is Binomial(n, q). Given |S| = k, each k-subset has probability
    q^k (1 − q)^(n − k) / P(|S| = k) = 1 / C(n, k): uniform. Drawing k ~ Binomial(n, q) and then
    a uniform k-subset therefore gives every S the probability P(k = |S|) / C(n, |S|) =
    q^|S| (1 − q)^(n − |S|), the same law as n Bernoulli(q) draws; the amplification analysis
    depends on that law only. Rows come back sorted (a batch is a set). k = 0 happens and
    yields an empty batch.

    The generator is numpy's PCG64 with ``torch.Generator``'s seeding and state interface, so a
    run seeds, checkpoints and restores it like its other streams.
    """

    def __init__(self, dataset_size: int, sample_rate: float) -> None:
        if dataset_size < 1 or not 0 < sample_rate <= 1:
            raise ValueError(
                f"need n ≥ 1 and q in (0, 1], got n = {dataset_size}, q = {sample_rate}"
            )
        self.dataset_size, self.sample_rate = dataset_size, sample_rate
        self.rng = np.random.Generator(np.random.PCG64())

    def manual_seed(self, seed: int) -> PoissonSubsetSampler:
        self.rng = np.random.Generator(np.random.PCG64(seed))
        return self

    def get_state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state

    def sample(self) -> np.ndarray:
        """The row indices (int64, sorted) of the next batch."""
        size = self.rng.binomial(self.dataset_size, self.sample_rate)
        rows = self.rng.choice(self.dataset_size, size=size, replace=False, shuffle=False)
        rows.sort()
        return rows


def clipped_gradient_sum(
    weight: torch.Tensor,
    bias: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    x_square_norms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_b of the per-example cross-entropy gradients of (weight, bias), each clipped to norm
    ``clip_norm`` with Opacus' factor min(1, C / (‖g_b‖ + 1e-6)), and the per-example losses.

    ``x`` is (B, d) and ``y`` (B,); ``x_square_norms`` (B,) may hold precomputed ‖x_b‖².
    """
    if x_square_norms is None:
        x_square_norms = x.square().sum(1)
    # class-major (classes, B): the CPU's log_softmax over a last dimension of 10 is ~10× slower
    log_probs = torch.log_softmax(torch.addmm(bias[:, None], weight, x.T), dim=0)
    true_class = y[None]
    picked = log_probs.gather(0, true_class)
    residual = log_probs.exp().scatter_(0, true_class, picked.exp() - 1)  # softmax − onehot
    norms = (residual.square().sum(0) * (x_square_norms + 1)).sqrt()
    residual *= (clip_norm / (norms + 1e-6)).clamp(max=1.0)
    return residual @ x, residual.sum(1), -picked[0]


class LinearDPSGD:
    """DP-SGD steps on ``linear`` (updated in place) over the rows ``features``, ``labels``.

    ``features`` are flattened and moved to the layer's device once; the sampler runs on the
    host. ``expected_batch_size`` is int(n·q), the divisor Opacus uses and records.
    """

    def __init__(
        self,
        linear: nn.Linear,
        features: torch.Tensor,
        labels: torch.Tensor,
        *,
        noise_multiplier: float,
        clip_norm: float,
        learning_rate: float,
        noise_generator: torch.Generator,
        sampler: PoissonSubsetSampler,
    ) -> None:
        if linear.bias is None:
            raise ValueError("the linear-exact engine needs a layer with a bias")
        if sampler.dataset_size != len(labels):
            raise ValueError(f"sampler is over {sampler.dataset_size} rows, data has {len(labels)}")
        if noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}")
        device = linear.weight.device
        self.linear = linear
        self.features = features.flatten(1).to(device)
        self.labels = labels.to(device)
        self.square_norms = self.features.square().sum(1)
        self.noise_multiplier, self.clip_norm = noise_multiplier, clip_norm
        self.learning_rate = learning_rate
        self.sample_rate = sampler.sample_rate
        self.expected_batch_size = int(len(labels) * sampler.sample_rate)
        self.noise_generator, self.sampler = noise_generator, sampler
        self.accountant = RDPAccountant()

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One noisy step on the next Poisson batch; returns the batch's mean loss (NaN if
        the batch is empty)."""
        rows = torch.from_numpy(self.sampler.sample()).to(self.features.device)
        weight, bias = self.linear.weight, self.linear.bias
        weight_sum, bias_sum, losses = clipped_gradient_sum(
            weight,
            bias,
            self.features.index_select(0, rows),
            self.labels.index_select(0, rows),
            self.clip_norm,
            self.square_norms.index_select(0, rows),
        )
        std = self.noise_multiplier * self.clip_norm
        for param, summed in ((weight, weight_sum), (bias, bias_sum)):
            if std > 0:
                summed += torch.normal(
                    mean=0,
                    std=std,
                    size=summed.shape,
                    device=summed.device,
                    generator=self.noise_generator,
                    dtype=summed.dtype,
                )
            summed /= self.expected_batch_size
            param.add_(summed, alpha=-self.learning_rate)
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)
        return losses.mean()


class LinearExactEngine:
    """:class:`LinearDPSGD` on one logreg run (implements
    :class:`~dpmerge.training.engines.DPEngine`)."""

    sampler_id = SAMPLER_ID

    def __init__(
        self, config: TrainConfig, plan: MechanismPlan, device: torch.device, dataset_size: int
    ) -> None:
        self.config, self.plan = config, plan
        self.noise_generator = torch.Generator(device=device)
        self.sampler = PoissonSubsetSampler(dataset_size, plan.sample_rate)

    def start(
        self, model: nn.Module, train: Split, state: RunState, streams: Streams | None
    ) -> None:
        if streams is None:
            self.noise_generator.set_state(state.noise_generator)
        else:
            self.noise_generator.manual_seed(streams.noise_seed)
            self.sampler.manual_seed(streams.batch_seed)
        self.model = model
        self.engine = LinearDPSGD(
            model.linear,
            train.features,
            train.labels,
            noise_multiplier=self.plan.noise_multiplier,
            clip_norm=self.config.clip_norm,
            learning_rate=self.config.lr,
            noise_generator=self.noise_generator,
            sampler=self.sampler,
        )
        self.accountant = self.engine.accountant
        self.accountant.history = list(state.accountant_history)
        if streams is None:
            self.sampler.set_state(state.sampler_generator)

    def step(self) -> torch.Tensor:
        return self.engine.step()

    def snapshot(self, state: RunState) -> RunState:
        state.model = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        state.noise_generator = self.noise_generator.get_state()
        state.sampler_generator = self.sampler.get_state()
        state.accountant_history = list(self.accountant.history)
        return state

    def ran(self) -> Ran:
        engine = self.engine
        return Ran(
            noise_multiplier=engine.noise_multiplier,
            sample_rate=engine.sample_rate,
            clip_norm=engine.clip_norm,
            learning_rate=engine.learning_rate,
            expected_batch_size=engine.expected_batch_size,
            history=accountant_history(engine.accountant),
        )

    def module(self) -> nn.Module:
        return self.model
