"""DP-SGD training of candidates, recorded from what actually ran (SPEC §2, §3).

One candidate is plain SGD (no momentum, no weight decay) on Poisson-sampled batches with
per-example clipping and Gaussian noise. Two engines run it:

* Opacus 1.6 (``poisson_sampling=True``), grad-sample modes ``hooks``, ``functorch``, ``ew``,
  ``ghost``: any model;
* ``linear-exact`` (:mod:`dpmerge.linear_engine`): the same mechanism for ``logreg`` with
  analytic per-example norms and O(B) Poisson sampling, the default there.

Its :class:`~dpmerge.accounting.records.MechanismRecord` is filled from the objects that ran,
never from the request: q = 1/len(loader) as Opacus sets it (not batch_size/n), the divisor
``int(n·q)``; the steps are the accountant's history. Both engines record the same values for
the same configuration. With a target ε, σ is calibrated for that q and the number of steps
that will run, so training and merging agree on ε.

Randomness has three streams, each its own generator (``torch.Generator``; numpy's PCG64 for
the linear engine's batches) seeded through a domain-separated hash, so equal user seeds for
noise and batches never give correlated streams:

* noise (``noise_seed``): lineage ``noise-seed-<seed>``; every run given the same seed shares
  the lineage, since it reuses the noise stream (SPEC §2, §5.2). ``None`` draws a secret seed
  from the OS (a fresh lineage ``run-<id>/noise-fresh``). A fixed seed makes the noise
  reproducible by whoever knows it: use ``None`` for releases.
* batches (``batch_seed``): lineage ``poisson-seed-<seed>/n-<n>/q-<q>`` (Opacus' sampler) or
  ``…/q-<q>/binomial-subset`` (the linear engine's); candidates with the same batch seed,
  engine, data and q draw identical Poisson batches (shared sampling, §5.2). ``None`` draws a
  secret seed (independent sampling, lineage ``run-<id>/batches-fresh``).
* initialisation (``init_seed`` or a public checkpoint, §8.4).

Long runs checkpoint model, optimizer, both generators, the accountant history and the step,
so a resumed run continues the same noise and batch streams and its record counts every step.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from dpmerge.accounting.candidate import candidate_bound, noise_multiplier_for_epsilon
from dpmerge.accounting.records import (
    NEIGHBOURING_ADD_OR_REMOVE,
    SAMPLING_POISSON,
    MechanismRecord,
    Optimizer,
)
from dpmerge.artifacts import ModelSpec, save_model_dir
from dpmerge.data import DatasetSplits, Split, collate_batch
from dpmerge.errors import DPMergeError
from dpmerge.linear_engine import SAMPLER_ID, LinearDPSGD, PoissonSubsetSampler
from dpmerge.models import MODEL_NAMES, build_model, initialisation_id, load_pretrained, model_spec

LINEAR_EXACT = "linear-exact"
LINEAR_EXACT_MODELS = frozenset({"logreg"})
"""Models the linear-exact engine runs: one linear layer on the flattened input."""
OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")
GRAD_SAMPLE_MODES = (LINEAR_EXACT, *OPACUS_MODES)
DEFAULT_GRAD_SAMPLE_MODE = {"logreg": LINEAR_EXACT, "cnn": "hooks", "resnet18_gn": "hooks"}
"""Fastest valid mode per model on the 2-core CPU (docs/training.md, bench_training.py)."""
DEFAULT_LEARNING_RATE = {"logreg": 2.0, "cnn": 1.0, "resnet18_gn": 0.5}
"""Plain-SGD step sizes at C = 1, B = 256: logreg from notes/utility-experiment.md §1, cnn from
docs/training.md; resnet18_gn is not tuned here."""
CHECKPOINT_FORMAT = 1
_EVAL_BATCH = 1024
_EPSILON_REFRESH_SECONDS = 1.0
"""The progress bar's running ε is refreshed at most this often: one RDP evaluation takes
~20 ms, as long as 40 linear-exact steps."""


class TrainingConfigError(DPMergeError, ValueError):
    """A training request that cannot run as asked (conflicting or out-of-range settings)."""


@dataclass(frozen=True)
class TrainConfig:
    """One DP-SGD candidate. Exactly one of ``noise_multiplier`` and ``target_epsilon``.

    ``learning_rate`` and ``grad_sample_mode`` default per model; ``grad_sample_mode`` picks
    the engine: ``linear-exact`` (``logreg`` only) or an Opacus mode. ``delta`` is the δ of a
    target ε and of the running ε in the progress bar. ``max_steps`` stops early; the record
    counts the steps that ran.
    """

    dataset: str
    model: str
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    epochs: int = 1
    batch_size: int = 256
    learning_rate: float | None = None
    clip_norm: float = 1.0
    init_seed: int = 0
    noise_seed: int | None = None
    batch_seed: int | None = None
    init_checkpoint: str | None = None
    device: str = "cpu"
    grad_sample_mode: str | None = None
    checkpoint_path: str | None = None
    checkpoint_every: int = 500
    max_steps: int | None = None
    progress: bool = False
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise TrainingConfigError("give exactly one of noise_multiplier and target_epsilon")
        positive = {
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "clip_norm": self.clip_norm,
            "checkpoint_every": self.checkpoint_every,
            "max_steps": self.max_steps,
        }
        for key, value in positive.items():
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TrainingConfigError(f"{key} must be a positive number, got {value}")
        if not 0 < self.delta < 1:
            raise TrainingConfigError(f"delta must be in (0, 1), got {self.delta}")
        if self.model not in MODEL_NAMES:
            raise TrainingConfigError(
                f"unknown model {self.model!r}; known: {', '.join(MODEL_NAMES)}"
            )
        if self.grad_sample_mode is not None and self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise TrainingConfigError(
                f"unknown grad_sample_mode {self.grad_sample_mode!r}; "
                f"known: {', '.join(GRAD_SAMPLE_MODES)}"
            )
        if self.mode == LINEAR_EXACT and self.model not in LINEAR_EXACT_MODELS:
            raise TrainingConfigError(
                f"grad_sample_mode {LINEAR_EXACT!r} runs only {', '.join(LINEAR_EXACT_MODELS)}, "
                f"not {self.model!r}; use an Opacus mode ({', '.join(OPACUS_MODES)})"
            )
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise TrainingConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def lr(self) -> float:
        return self.learning_rate or DEFAULT_LEARNING_RATE[self.model]

    @property
    def mode(self) -> str:
        return self.grad_sample_mode or DEFAULT_GRAD_SAMPLE_MODE[self.model]

    @property
    def engine(self) -> str:
        """``linear-exact`` or ``opacus``: which code runs the mechanism."""
        return LINEAR_EXACT if self.mode == LINEAR_EXACT else "opacus"


@dataclass(frozen=True, eq=False)
class TrainResult:
    """A trained candidate: the module, its spec, the record of what ran, and its metrics.

    ``accountant_history`` is the engine's own RDP accountant ``(σ, q, steps)`` history of the
    run, the evidence the record was taken from (Opacus logs its pessimistic q, see
    :meth:`_OpacusRun.ran`; the linear engine logs its sampler's q).
    """

    model: nn.Module
    spec: ModelSpec
    record: MechanismRecord
    metrics: dict[str, Any]
    accountant_history: tuple[tuple[float, float, int], ...]

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu") for k, v in self.model.state_dict().items()}


@dataclass(frozen=True)
class MechanismPlan:
    """q, T and σ fixed before training: q = 1/len(loader) exactly as Opacus sets it, T counted
    in steps (an Opacus pass over its loader is int(1/q) steps, one short for some loader
    lengths, so dpmerge counts steps, not passes)."""

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


def _stream_seed(label: str) -> int:
    """A 63-bit generator seed from a label (domain separation between random streams)."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big") >> 1


@dataclass
class _RunState:
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


def _fresh_state(config: TrainConfig, plan: MechanismPlan, n: int) -> tuple[_RunState, int, int]:
    """A new run: its id, lineages and the seeds of its noise and batch generators."""
    run_id = uuid.uuid4().hex
    if config.noise_seed is None:
        noise_lineage, noise_seed = f"run-{run_id}/noise-fresh", secrets.randbits(63)
    else:
        noise_lineage = f"noise-seed-{config.noise_seed}"
        noise_seed = _stream_seed(f"dpmerge/noise/{config.noise_seed}")
    if config.batch_seed is None:
        batch_lineage, batch_seed = f"run-{run_id}/batches-fresh", secrets.randbits(63)
    else:
        batch_lineage = f"poisson-seed-{config.batch_seed}/n-{n}/q-{plan.sample_rate!r}"
        if config.engine == LINEAR_EXACT:
            batch_lineage += f"/{SAMPLER_ID}"
        batch_seed = _stream_seed(f"dpmerge/batches/{batch_lineage}")
    return _RunState(run_id, noise_lineage, batch_lineage), noise_seed, batch_seed


def _save_checkpoint(path: Path, identity: dict[str, Any], state: _RunState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "identity": identity, **asdict(state)}, staging)
    os.replace(staging, path)


def _load_checkpoint(path: Path, identity: dict[str, Any]) -> _RunState:
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
    state = _RunState(**{k: v for k, v in saved.items() if k not in ("format", "identity")})
    state.accountant_history = [tuple(entry) for entry in state.accountant_history]
    return state


def _resolve_device(config: TrainConfig) -> torch.device:
    try:
        device = torch.device(config.device)
    except RuntimeError:
        raise TrainingConfigError(f"invalid device {config.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingConfigError(f"device {config.device!r} requested but CUDA is not available")
    return device


@torch.no_grad()
def _evaluate(model: nn.Module, split: Split, device: torch.device) -> dict[str, float | None]:
    """Accuracy and mean cross-entropy of ``model`` on ``split`` (None for an empty split)."""
    if len(split) == 0:
        return {"accuracy": None, "loss": None}
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, len(split), _EVAL_BATCH):
        x = split.features[start : start + _EVAL_BATCH].to(device)
        y = split.labels[start : start + _EVAL_BATCH].to(device)
        logits = model(x)
        loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
    model.train(was_training)
    return {"accuracy": correct / len(split), "loss": loss / len(split)}


def train_candidate(config: TrainConfig, data: DatasetSplits) -> TrainResult:
    """Train one DP-SGD candidate on ``data.train`` and record what ran (SPEC §2).

    With ``config.checkpoint_path`` set, an existing checkpoint of the same run is resumed and
    a checkpoint is written every ``checkpoint_every`` steps and at the end.
    """
    if config.dataset != data.name:
        raise TrainingConfigError(
            f"config is for dataset {config.dataset!r} but the data is {data.name!r}"
        )
    device = _resolve_device(config)
    spec = model_spec(config.model, data)
    plan = plan_mechanism(config, data.dataset_size)
    if config.init_checkpoint is not None:
        model, init_id = load_pretrained(spec, config.init_checkpoint)
    else:
        model = build_model(spec, seed=config.init_seed)
        init_id = initialisation_id(spec, config.init_seed)
    identity = {
        "dataset": data.fingerprint,
        "model": spec.to_dict(),
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "learning_rate": config.lr,
        "clip_norm": config.clip_norm,
        "initialisation": init_id,
        "noise_seed": config.noise_seed,
        "batch_seed": config.batch_seed,
        "device_type": device.type,
        "engine": config.engine,
    }
    checkpoint = Path(config.checkpoint_path) if config.checkpoint_path else None
    run: _OpacusRun | _LinearRun = (
        _LinearRun(config, plan, device, data.dataset_size)
        if config.engine == LINEAR_EXACT
        else _OpacusRun(config, plan, device)
    )
    if checkpoint is not None and checkpoint.exists():
        state = _load_checkpoint(checkpoint, identity)
        if state.step > plan.total_steps:
            raise TrainingConfigError(
                f"checkpoint {checkpoint} is at step {state.step}, "
                f"past this run's {plan.total_steps} steps"
            )
        model.load_state_dict(state.model)
        run.noise_generator.set_state(state.noise_generator)
    else:
        state, noise_seed, batch_seed = _fresh_state(config, plan, data.dataset_size)
        run.noise_generator.manual_seed(noise_seed)
        run.sampler_generator.manual_seed(batch_seed)

    run.make_private(model.to(device), data.train, state)

    def save() -> None:
        assert checkpoint is not None
        _save_checkpoint(checkpoint, identity, run.snapshot(state))

    run.steps(state, save if checkpoint is not None else None)
    if checkpoint is not None:
        save()

    ran = run.ran()
    record = _record(config, data, state, ran, init_id)
    model = run.module()
    metrics: dict[str, Any] = {
        "steps": record.steps,
        "train_seconds": state.seconds,
        "grad_sample_mode": config.mode,
    }
    for split_name, split in (("validation", data.validation), ("test", data.test)):
        for key, value in _evaluate(model, split, device).items():
            metrics[f"{split_name}_{key}"] = value
    return TrainResult(model, spec, record, metrics, ran.history)


@dataclass(frozen=True)
class _Ran:
    """What an engine ran, read off its own optimizer, sampler and accountant (SPEC §2)."""

    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    learning_rate: float
    expected_batch_size: float
    history: tuple[tuple[float, float, int], ...]


def _history(accountant: RDPAccountant) -> tuple[tuple[float, float, int], ...]:
    return tuple((float(s), float(q), int(t)) for s, q, t in accountant.history)


class _Progress:
    """The bookkeeping of a step loop, either engine: progress bar with the running RDP ε,
    checkpoint cadence and the training clock."""

    def __init__(
        self,
        config: TrainConfig,
        plan: MechanismPlan,
        state: _RunState,
        accountant: RDPAccountant,
        save: Callable[[], None] | None,
    ) -> None:
        self.config, self.state, self.accountant, self.save = config, state, accountant, save
        self.bar = tqdm(
            total=plan.total_steps,
            initial=state.step,
            disable=not config.progress,
            desc=config.name or f"{config.dataset}/{config.model} σ={plan.noise_multiplier:.3g}",
            unit="step",
        )
        self.clock = self.shown = time.perf_counter()

    def stepped(self, loss: torch.Tensor) -> None:
        """Count one step that ran, with the loss of its batch."""
        state, config = self.state, self.config
        state.step += 1
        self.bar.update()
        if config.progress and time.perf_counter() - self.shown >= _EPSILON_REFRESH_SECONDS:
            epsilon = self.accountant.get_epsilon(config.delta)
            self.bar.set_postfix(loss=f"{loss.item():.3f}", eps_rdp=f"{epsilon:.3f}")
            self.shown = time.perf_counter()
        if self.save is not None and state.step % config.checkpoint_every == 0:
            now = time.perf_counter()
            state.seconds, self.clock = state.seconds + now - self.clock, now
            self.save()

    def close(self) -> None:
        self.state.seconds += time.perf_counter() - self.clock
        self.bar.close()


class _LinearRun:
    """The linear-exact engine (:mod:`dpmerge.linear_engine`) of one logreg run, its loop."""

    def __init__(
        self, config: TrainConfig, plan: MechanismPlan, device: torch.device, dataset_size: int
    ) -> None:
        self.config, self.plan = config, plan
        self.noise_generator = torch.Generator(device=device)
        self.sampler_generator = PoissonSubsetSampler(dataset_size, plan.sample_rate)

    def make_private(self, model: nn.Module, train: Split, state: _RunState) -> None:
        self.model = model
        self.engine = LinearDPSGD(
            model.linear,
            train.features,
            train.labels,
            noise_multiplier=self.plan.noise_multiplier,
            clip_norm=self.config.clip_norm,
            learning_rate=self.config.lr,
            noise_generator=self.noise_generator,
            sampler=self.sampler_generator,
        )
        self.engine.accountant.history = list(state.accountant_history)
        if state.sampler_generator is not None:
            self.sampler_generator.set_state(state.sampler_generator)

    def snapshot(self, state: _RunState) -> _RunState:
        state.model = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        state.noise_generator = self.noise_generator.get_state()
        state.sampler_generator = self.sampler_generator.get_state()
        state.accountant_history = list(self.engine.accountant.history)
        return state

    def steps(self, state: _RunState, save: Callable[[], None] | None) -> None:
        """Run from ``state.step`` to the planned T, one Poisson batch per step."""
        progress = _Progress(self.config, self.plan, state, self.engine.accountant, save)
        while state.step < self.plan.total_steps:
            progress.stepped(self.engine.step())
        progress.close()

    def ran(self) -> _Ran:
        engine = self.engine
        return _Ran(
            noise_multiplier=engine.noise_multiplier,
            sample_rate=engine.sample_rate,
            clip_norm=engine.clip_norm,
            learning_rate=engine.learning_rate,
            expected_batch_size=engine.expected_batch_size,
            history=_history(engine.accountant),
        )

    def module(self) -> nn.Module:
        return self.model


class _OpacusRun:
    """The Opacus objects of one run and its step loop."""

    def __init__(self, config: TrainConfig, plan: MechanismPlan, device: torch.device) -> None:
        self.config, self.plan, self.device = config, plan, device
        self.noise_generator = torch.Generator(device=device)
        self.sampler_generator = torch.Generator()

    def make_private(self, model: nn.Module, train: Split, state: _RunState) -> None:
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
            grad_sample_mode=self.config.mode,
        )
        if self.config.mode == "ghost":
            self.dp_model, self.optimizer, self.criterion, self.loader = private
        else:
            self.dp_model, self.optimizer, self.loader = private
            self.criterion = nn.CrossEntropyLoss()
        if self.loader.batch_sampler.sample_rate != self.plan.sample_rate:
            raise RuntimeError(
                f"Opacus samples at q = {self.loader.batch_sampler.sample_rate}, "
                f"planned {self.plan.sample_rate}"
            )
        self.engine.accountant.history = list(state.accountant_history)

    def snapshot(self, state: _RunState) -> _RunState:
        state.model = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        state.optimizer = self.optimizer.original_optimizer.state_dict()
        state.noise_generator = self.noise_generator.get_state()
        state.sampler_generator = self.sampler_generator.get_state()
        state.accountant_history = list(self.engine.accountant.history)
        return state

    def steps(self, state: _RunState, save: Callable[[], None] | None) -> None:
        """Run from ``state.step`` to the planned T, one Poisson batch per step.

        Each pass over the loader first draws a worker seed from the sampler generator, so
        passes start at multiples of the loader's length whatever step a run resumed at, and
        the restored sampler state is set after that draw unless the resume step starts a pass.
        """
        config, total = self.config, self.plan.total_steps
        pass_length = len(self.loader)
        restore = state.sampler_generator
        progress = _Progress(config, self.plan, state, self.engine.accountant, save)
        self.dp_model.train()
        while state.step < total:
            if restore is not None and state.step % pass_length == 0:
                self.sampler_generator.set_state(restore)
                restore = None
            batches = iter(self.loader)
            if restore is not None:
                self.sampler_generator.set_state(restore)
                restore = None
            for _ in range(min(pass_length - state.step % pass_length, total - state.step)):
                x, y = next(batches)
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.criterion(self.dp_model(x.to(self.device)), y.to(self.device))
                loss.backward()
                self.optimizer.step()
                progress.stepped(loss)
        progress.close()

    def ran(self) -> _Ran:
        """What Opacus ran. q is the Poisson sampler's own rate: Opacus' accountant logs
        1/len(Poisson loader) instead, which is larger when int(1/q) rounds down (its ε is then
        slightly pessimistic); the steps and σ come from its history."""
        optimizer = self.optimizer
        (group,) = optimizer.original_optimizer.param_groups
        if group["momentum"] != 0 or group["weight_decay"] != 0:
            raise RuntimeError("the update rule is not plain SGD")
        return _Ran(
            noise_multiplier=optimizer.noise_multiplier,
            sample_rate=self.loader.batch_sampler.sample_rate,
            clip_norm=optimizer.max_grad_norm,
            learning_rate=group["lr"],
            expected_batch_size=optimizer.expected_batch_size,
            history=_history(self.engine.accountant),
        )

    def module(self) -> nn.Module:
        return self.dp_model.to_standard_module()  # Opacus' hooks and per-sample buffers removed


def _record(
    config: TrainConfig, data: DatasetSplits, state: _RunState, ran: _Ran, init_id: str
) -> MechanismRecord:
    """The mechanism record, read off what the engine ran (:meth:`_OpacusRun.ran`,
    :meth:`_LinearRun.ran`); the steps and σ are checked against its accountant's history."""
    history = ran.history
    steps = sum(t for _, _, t in history)
    if steps != state.step or any(s != ran.noise_multiplier for s, _, _ in history):
        raise RuntimeError(f"accountant history {history} disagrees with {state.step} steps run")
    return MechanismRecord(
        name=config.name or f"{data.name}-{config.model}-{state.run_id[:8]}",
        noise_multiplier=ran.noise_multiplier,
        sample_rate=ran.sample_rate,
        steps=steps,
        clip_norm=ran.clip_norm,
        learning_rate=ran.learning_rate,
        expected_batch_size=ran.expected_batch_size,
        optimizer=Optimizer.SGD,
        noise_lineage=state.noise_lineage,
        batch_lineage=state.batch_lineage,
        dataset=data.fingerprint,
        neighbouring=NEIGHBOURING_ADD_OR_REMOVE,
        sampling=SAMPLING_POISSON,
        dataset_size=data.dataset_size,
        initialisation=init_id,
    )


def train_candidates(configs: Sequence[TrainConfig], data: DatasetSplits) -> list[TrainResult]:
    """Train several candidates of one loaded dataset, one after the other."""
    return [train_candidate(config, data) for config in configs]


def save_candidate(result: TrainResult, out_dir: str | Path, delta: float) -> Path:
    """Write the candidate's model directory: weights, spec, record with its ε (PLD and RDP at
    ``delta``, SPEC §2) and metrics (``dpmerge.artifacts`` layout)."""
    return save_model_dir(
        out_dir,
        result.weights,
        result.spec,
        record=result.record,
        candidate_privacy=candidate_bound(result.record, delta).to_dict(),
        metrics=result.metrics,
    )
