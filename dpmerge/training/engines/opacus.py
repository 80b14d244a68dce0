"""The Opacus engine: Opacus 1.6's ``PrivacyEngine`` with Poisson sampling, in any of its
grad-sample modes (``hooks``, ``functorch``, ``ew``, ``ghost``) or with per-example gradients
from ``torch.func`` (``vmap``, :mod:`~dpmerge.training.engines.vmap`), for any model, or from
one batched backward pass (``layers``, :mod:`~dpmerge.training.engines.layers`)."""

from __future__ import annotations

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader

from dpmerge.data import Split, collate_batch
from dpmerge.training.checkpoint import RunState
from dpmerge.training.config import TrainConfig
from dpmerge.training.engines.layers import LayerGradients
from dpmerge.training.engines.vmap import PerExampleGradients
from dpmerge.training.plan import MechanismPlan
from dpmerge.training.record import Ran, accountant_history
from dpmerge.training.streams import Streams
from dpmerge.vocabulary import GradSampleMode

OPACUS_GRAD_SAMPLE_MODE = {GradSampleMode.VMAP: "no_op", GradSampleMode.LAYERS: "no_op"}
"""Opacus' mode where it is not dpmerge's: ``vmap`` and ``layers`` set the per-example
gradients themselves."""
PER_EXAMPLE = {GradSampleMode.VMAP: PerExampleGradients, GradSampleMode.LAYERS: LayerGradients}
"""What computes the per-example gradients in the modes where Opacus' module does not."""


class OpacusEngine:
    """The Opacus objects of one run (implements :class:`~dpmerge.training.engines.DPEngine`)."""

    sampler_id = None

    def __init__(self, config: TrainConfig, plan: MechanismPlan, device: torch.device) -> None:
        self.config, self.plan, self.device = config, plan, device
        self.noise_generator = torch.Generator(device=device)
        self.sampler_generator = torch.Generator()

    def start(
        self, model: nn.Module, train: Split, state: RunState, streams: Streams | None
    ) -> None:
        if streams is None:
            self.noise_generator.set_state(state.noise_generator)
            self._restore = state.sampler_generator
        else:
            self.noise_generator.manual_seed(streams.noise_seed)
            self.sampler_generator.manual_seed(streams.batch_seed)
            self._restore = None
        self.model = model
        sgd = torch.optim.SGD(model.parameters(), lr=self.config.lr, momentum=0, weight_decay=0)
        if state.optimizer is not None:
            sgd.load_state_dict(state.optimizer)
        loader = DataLoader(
            train.as_dataset(),
            batch_size=self.config.batch_size,
            generator=self.sampler_generator,
            collate_fn=collate_batch,
        )
        self.engine = PrivacyEngine(accountant="rdp")
        private = self.engine.make_private(
            module=model,
            optimizer=sgd,
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=self.plan.noise_multiplier,
            max_grad_norm=self.config.clip_norm,
            poisson_sampling=True,
            noise_generator=self.noise_generator,
            grad_sample_mode=OPACUS_GRAD_SAMPLE_MODE.get(self.config.mode, self.config.mode.value),
        )
        if self.config.mode == GradSampleMode.GHOST:
            self.dp_model, self.optimizer, self.criterion, self.loader = private
        else:
            self.dp_model, self.optimizer, self.loader = private
            self.criterion = nn.CrossEntropyLoss()
        per_example = PER_EXAMPLE.get(self.config.mode)
        self.per_example = None if per_example is None else per_example(model, self.criterion)
        if self.loader.batch_sampler.sample_rate != self.plan.sample_rate:
            raise RuntimeError(
                f"Opacus samples at q = {self.loader.batch_sampler.sample_rate}, "
                f"planned {self.plan.sample_rate}"
            )
        self.accountant = self.engine.accountant
        self.accountant.history = list(state.accountant_history)
        self.dp_model.train()
        self._at, self._left, self._pass_length = state.step, 0, len(self.loader)

    def step(self) -> torch.Tensor:
        if self._left == 0:
            self._new_pass()
        x, y = next(self._batches)
        self._left -= 1
        self._at += 1
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        if self.per_example is not None:
            loss = self.per_example.compute(x, y)
        else:
            loss = self.criterion(self.dp_model(x), y)
            loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _new_pass(self) -> None:
        """Start a pass over the loader. Each pass first draws a worker seed from the sampler
        generator, so passes start at multiples of the loader's length whatever step a run
        resumed at, and a restored sampler state is set after that draw unless the resume step
        starts a pass."""
        into_pass = self._at % self._pass_length
        if self._restore is not None and into_pass == 0:
            self.sampler_generator.set_state(self._restore)
            self._restore = None
        self._batches = iter(self.loader)
        if self._restore is not None:
            self.sampler_generator.set_state(self._restore)
            self._restore = None
        self._left = self._pass_length - into_pass

    def snapshot(self, state: RunState) -> RunState:
        state.model = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        state.optimizer = self.optimizer.original_optimizer.state_dict()
        state.noise_generator = self.noise_generator.get_state()
        state.sampler_generator = self.sampler_generator.get_state()
        state.accountant_history = list(self.accountant.history)
        return state

    def ran(self) -> Ran:
        """What Opacus ran. q is the Poisson sampler's own rate: Opacus' accountant logs
        1/len(Poisson loader) instead, which is larger when int(1/q) rounds down (its ε is then
        slightly pessimistic); the steps and σ come from its history."""
        optimizer = self.optimizer
        (group,) = optimizer.original_optimizer.param_groups
        if group["momentum"] != 0 or group["weight_decay"] != 0:
            raise RuntimeError("the update rule is not plain SGD")
        return Ran(
            noise_multiplier=optimizer.noise_multiplier,
            sample_rate=self.loader.batch_sampler.sample_rate,
            clip_norm=optimizer.max_grad_norm,
            learning_rate=group["lr"],
            expected_batch_size=optimizer.expected_batch_size,
            history=accountant_history(self.accountant),
        )

    def module(self) -> nn.Module:
        return self.dp_model.to_standard_module()  # Opacus' hooks and per-sample buffers removed
