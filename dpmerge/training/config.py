"""The training parameters, declared once (docs/training.md, "Parameters").

:class:`TrainConfig` (one DP-SGD candidate) and :class:`RunOptions` (its data and CPU threads)
are the only declaration of a training parameter: each field carries its type, default, help
text and CLI flag. ``dpmerge train`` builds its options from them, the training task carries
them, and the training flows take them as parameters (:func:`declared_parameters`), so the
surfaces cannot drift apart. Types are checked strictly (a boolean is not a number) and the
closed vocabularies (:mod:`dpmerge.vocabulary`) are turned into their enums.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from dpmerge.errors import InputError
from dpmerge.formatting import did_you_mean
from dpmerge.model_reference import misplaced_factory_options, parse_reference
from dpmerge.vocabulary import DatasetName, Engine, GradSampleMode, ModelName, values

if TYPE_CHECKING:  # torch loads on first use: `dpmerge train --help` builds on this module
    import torch

LINEAR_EXACT = GradSampleMode.LINEAR_EXACT
LINEAR_EXACT_MODELS = frozenset({ModelName.LOGREG})
"""Models the linear-exact engine runs: one linear layer on the flattened input."""
OPACUS_MODES = tuple(mode for mode in GradSampleMode if mode != LINEAR_EXACT)
GRAD_SAMPLE_MODES = tuple(GradSampleMode)
DEFAULT_GRAD_SAMPLE_MODE = {
    ModelName.LOGREG: LINEAR_EXACT,
    ModelName.CNN: GradSampleMode.LAYERS,
    ModelName.RESNET18_GN: GradSampleMode.HOOKS,
    ModelName.TRANSFORMERS: GradSampleMode.HOOKS,
}
"""Fastest exact mode per model, measured with every mode in one run (``bench_training.py``;
docs/training.md, "Throughput"; docs/results.md §6). ``cnn``: ``layers`` (one batched backward
pass to the layers' outputs, then each layer's per-example gradients as one batched operation;
0.78 of non-private against 0.63 for ``vmap`` on a quiet machine, docs/results.md §6.2).
``resnet18_gn``: ``hooks`` (docs/training.md, "Throughput"). ``transformers``: ``hooks``, which
supports LoRA's linear layers (docs/design.md#fine-tuning; not benchmarked)."""
DEFAULT_LEARNING_RATE = {
    ModelName.LOGREG: 2.0,
    ModelName.CNN: 1.0,
    ModelName.RESNET18_GN: 0.5,
    ModelName.TRANSFORMERS: 0.5,
}
"""Plain-SGD step sizes at C = 1, B = 256, chosen in docs/training.md ("Logreg learning rate",
"CNN learning rate"); resnet18_gn and transformers are not tuned here."""
FACTORY_LEARNING_RATE = 1.0
"""The step size of a user's model (docs/design.md#your-model), untuned: give ``--lr``."""
FACTORY_GRAD_SAMPLE_MODE = GradSampleMode.HOOKS
"""Opacus' per-layer hooks: the mode whose supported layers ``ModuleValidator`` checks."""
FINE_TUNE_OPTIONS = ("model_dir", "lora_rank", "lora_alpha", "lora_targets", "train_layers")
"""The options of a fine-tuned transformer (docs/design.md#fine-tuning)."""
DEVICE_KINDS = ("cpu", "cuda", "auto")


class TrainingConfigError(InputError):
    """A training request that cannot run as asked (conflicting or out-of-range settings)."""


def parameter(help: str, default: Any = MISSING, *, flag: str | None = None) -> Any:
    """A declared field: its default, its help text and its CLI flag (default ``--<name>``)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class Parameter:
    """One declared parameter as a surface (CLI, task, flow) exposes it."""

    name: str
    kind: type
    """``bool``, ``int``, ``float``, ``str`` or a vocabulary enum."""
    optional: bool
    """``None`` is a valid value."""
    default: Any
    """``dataclasses.MISSING`` when the parameter is required."""
    help: str
    flag: str

    @property
    def annotation(self) -> Any:
        return self.kind | None if self.optional else self.kind

    @property
    def choices(self) -> tuple[str, ...] | None:
        return values(self.kind) if issubclass(self.kind, StrEnum) else None

    def check(self, value: Any) -> Any:
        """``value`` as this parameter holds it (an enum member, a float), or a one-line
        :class:`TrainingConfigError`."""
        kind = self.kind
        if value is None and self.optional:
            return None
        if self.choices is not None:
            if isinstance(value, str) and value in self.choices:
                return kind(value)
            raise TrainingConfigError(
                f"unknown {self.name} {value!r}; known: {', '.join(self.choices)}"
            )
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if kind is float and number:
            return float(value)
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        wanted = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}
        raise TrainingConfigError(f"{self.name} must be {wanted[kind]}, got {value!r}")


def declared_parameters(declaration: type) -> tuple[Parameter, ...]:
    """The parameters a declaration (:class:`TrainConfig`, :class:`RunOptions`) declares."""
    hints = typing.get_type_hints(declaration)
    declared = []
    for item in fields(declaration):
        kinds = typing.get_args(hints[item.name]) or (hints[item.name],)
        (kind,) = (k for k in kinds if k is not type(None))
        flag = item.metadata["flag"] or "--" + item.name.replace("_", "-")
        declared.append(
            Parameter(
                item.name, kind, type(None) in kinds, item.default, item.metadata["help"], flag
            )
        )
    return tuple(declared)


def _check_declared(instance: Any) -> None:
    """Check every declared field's type and store its checked value (frozen dataclass)."""
    for declared in declared_parameters(type(instance)):
        value = declared.check(getattr(instance, declared.name))
        object.__setattr__(instance, declared.name, value)


def _require_positive(instance: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(instance, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise TrainingConfigError(f"{name} must be a positive number, got {value}")


@dataclass(frozen=True)
class TrainConfig:
    """One DP-SGD candidate. Exactly one of ``noise_multiplier`` and ``target_epsilon``.

    ``learning_rate`` and ``grad_sample_mode`` default per model; ``grad_sample_mode`` picks
    the engine: ``linear-exact`` (``logreg`` only) or an Opacus mode. ``delta`` is the δ of a
    target ε and of the running ε in the progress bar. ``max_steps`` stops early; the record
    counts the steps that ran.
    """

    dataset: DatasetName = parameter("dataset to train on")
    model: str = parameter(
        f"architecture: {', '.join(values(ModelName))}, or module:callable, your factory "
        "(input_shape, classes) -> torch.nn.Module"
    )
    noise_multiplier: float | None = parameter("noise multiplier σ (or give a target ε)", None)
    target_epsilon: float | None = parameter(
        "calibrate σ to this PLD ε at delta, for the q and steps that run", None
    )
    delta: float = parameter("δ of the target ε and of the reported ε", 1e-5)
    epochs: int = parameter("passes over the data: epochs·⌈n/B⌉ steps", 1)
    batch_size: int = parameter("expected batch size B (q = 1/⌈n/B⌉)", 256)
    learning_rate: float | None = parameter(
        "plain-SGD step size (default: per model)", None, flag="--lr"
    )
    clip_norm: float = parameter("per-example clipping norm C", 1.0)
    init_seed: int = parameter("initialisation seed", 0, flag="--seed")
    noise_seed: int | None = parameter(
        "fixed noise seed (default: a secret one, as releases need)", None
    )
    batch_seed: int | None = parameter("shared Poisson batch stream (default: independent)", None)
    init_checkpoint: str | None = parameter("public safetensors weights to start from", None)
    model_dir: str | None = parameter("transformers: the base model's local directory", None)
    lora_rank: int | None = parameter("transformers: train LoRA adapters of this rank", None)
    lora_alpha: float | None = parameter("transformers: LoRA scaling α (default: the rank)", None)
    lora_targets: str | None = parameter(
        "transformers: comma-separated module names the LoRA adapters adapt", None
    )
    train_layers: str | None = parameter(
        "transformers: comma-separated module names trained instead of LoRA adapters", None
    )
    device: str = parameter("cpu, cuda[:N], or auto (CUDA when present)", "cpu")
    grad_sample_mode: GradSampleMode | None = parameter(
        "linear-exact (logreg only) or an Opacus mode (default: per model)", None
    )
    checkpoint_path: str | None = parameter(
        "resumable training checkpoint file", None, flag="--checkpoint"
    )
    checkpoint_every: int = parameter("steps between checkpoints", 500)
    max_steps: int | None = parameter("stop after this many steps", None)
    progress: bool = parameter("progress bar on stderr", False)
    name: str | None = parameter("candidate name in the record", None)
    model_path: str | None = parameter(
        "directory of your model's code, put first on sys.path to import module:callable", None
    )
    fix_model: bool = parameter(
        "apply Opacus' ModuleValidator.fix to your model (recorded in model.json)", False
    )

    def __post_init__(self) -> None:
        _check_declared(self)
        object.__setattr__(self, "model", self._model_choice())
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise TrainingConfigError("give exactly one of noise_multiplier and target_epsilon")
        _require_positive(
            self,
            (
                "noise_multiplier",
                "target_epsilon",
                "epochs",
                "batch_size",
                "learning_rate",
                "clip_norm",
                "checkpoint_every",
                "max_steps",
                "lora_rank",
                "lora_alpha",
            ),
        )
        self._check_fine_tune()
        if not 0 < self.delta < 1:
            raise TrainingConfigError(f"delta must be in (0, 1), got {self.delta}")
        if self.mode == LINEAR_EXACT and self.model not in LINEAR_EXACT_MODELS:
            raise TrainingConfigError(
                f"grad_sample_mode {LINEAR_EXACT.value!r} runs only "
                f"{', '.join(LINEAR_EXACT_MODELS)}, not {str(self.model)!r}; "
                f"use an Opacus mode ({', '.join(OPACUS_MODES)})"
            )
        if self.device.split(":")[0] not in DEVICE_KINDS:
            raise TrainingConfigError(
                f"device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}"
            )

    def _model_choice(self) -> ModelName | str:
        """A built-in :class:`ModelName`, or a factory reference (docs/design.md#your-model);
        the factory's options are refused with a built-in model."""
        if self.model in values(ModelName):
            misplaced = misplaced_factory_options(self.model, self.model_path, self.fix_model)
            if misplaced:
                raise TrainingConfigError(misplaced)
            return ModelName(self.model)
        if ":" not in self.model:
            raise TrainingConfigError(
                f"unknown model {self.model!r}; known: {', '.join(values(ModelName))}, "
                f"or module:callable (your factory){did_you_mean(self.model, values(ModelName))}"
            )
        parse_reference(self.model)
        return self.model

    @property
    def factory(self) -> bool:
        """Whether the model is the user's factory rather than a built-in."""
        return not isinstance(self.model, ModelName)

    @property
    def model_label(self) -> str:
        """The model as a part of a candidate's name (a factory's ``:`` made a ``-``)."""
        return str(self.model).replace(":", "-")

    def _check_fine_tune(self) -> None:
        """A transformer names its base and exactly one trained subset; no other model takes
        these options (docs/design.md#fine-tuning)."""
        given = [name for name in FINE_TUNE_OPTIONS if getattr(self, name) is not None]
        if self.model != ModelName.TRANSFORMERS:
            if given:
                raise TrainingConfigError(
                    f"{given[0]} applies only to model {ModelName.TRANSFORMERS.value!r}"
                )
            return
        if self.model_dir is None:
            raise TrainingConfigError("model 'transformers' needs model_dir, its base's directory")
        if self.init_checkpoint is not None:
            raise TrainingConfigError(
                "model 'transformers' starts from its base (model_dir), not an init_checkpoint"
            )
        lora = [name for name in given if name.startswith("lora_")]
        if lora and self.train_layers is not None:
            raise TrainingConfigError("give LoRA options or train_layers, not both")
        if self.train_layers is None and (self.lora_rank is None or self.lora_targets is None):
            raise TrainingConfigError(
                "model 'transformers' trains LoRA adapters (lora_rank and lora_targets) or "
                "named layers (train_layers)"
            )

    @property
    def lr(self) -> float:
        if self.learning_rate:
            return self.learning_rate
        return FACTORY_LEARNING_RATE if self.factory else DEFAULT_LEARNING_RATE[self.model]

    @property
    def mode(self) -> GradSampleMode:
        if self.grad_sample_mode:
            return self.grad_sample_mode
        return FACTORY_GRAD_SAMPLE_MODE if self.factory else DEFAULT_GRAD_SAMPLE_MODE[self.model]

    @property
    def engine(self) -> Engine:
        """Which code runs the mechanism."""
        return Engine.LINEAR_EXACT if self.mode == LINEAR_EXACT else Engine.OPACUS

    def torch_device(self) -> torch.device:
        """The device to train on (``auto``: CUDA when present)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise TrainingConfigError(f"invalid device {self.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise TrainingConfigError(f"device {self.device!r} requested but CUDA is not available")
        return device


@dataclass(frozen=True)
class RunOptions:
    """How a run is hosted: where its data comes from and the CPU threads torch may use."""

    data_root: str | None = parameter(
        "folder holding the dataset files (a dataset of your own: its spec file)", None
    )
    limit: int | None = parameter("use only the first rows of each file", None)
    torch_threads: int = parameter(
        "torch CPU threads (one: two can be 10× slower on a shared CPU)", 1, flag="--threads"
    )

    def __post_init__(self) -> None:
        _check_declared(self)
        _require_positive(self, ("limit", "torch_threads"))
