"""Architectures a mechanism record can name (docs/design.md#mechanism-record "initialisation",
§8.2–8.4).

Every architecture is valid for Opacus (``ModuleValidator.validate(strict=True)``): GroupNorm
instead of BatchNorm, no in-place activations. The name goes into ``model.json`` so any tool can
rebuild the module a set of weights belongs to.

* ``logreg``: one linear layer on the flattened input, initialised to zero (every logreg
  candidate starts from the same point, as in the utility experiment).
* ``cnn``: two 3×3 conv + GroupNorm + ReLU + max-pool blocks and a linear head (CPU scale).
* ``resnet18_gn``: ResNet-18 with GroupNorm, CIFAR stem (3×3 conv, no max-pool) (GPU scale).

* ``transformers``: a transformers sequence classifier from a local directory, its base frozen
  and named by digest, DP-SGD training LoRA adapters or named layers
  (:mod:`dpmerge.transformer`, docs/design.md#fine-tuning); its weights are the trained
  parameters only.

A spec may instead name the user's own factory ``module:callable`` with its record
(:mod:`dpmerge.model_factory`, docs/design.md#your-model): it is rebuilt through that factory,
and refused if the factory's source changed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dpmerge.artifacts import ModelSpec
from dpmerge.data import DatasetSplits
from dpmerge.errors import RecordError
from dpmerge.fine_tuning import FineTune
from dpmerge.model_factory import build_factory_model, check_factory
from dpmerge.vocabulary import ModelName, values


class LogisticRegression(nn.Module):
    """Multinomial logistic regression on the flattened input."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


def _conv_block(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, kernel_size=3, padding=1),
        nn.GroupNorm(4, channels_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    """conv(16) → conv(32), each 3×3 + GroupNorm + ReLU + 2×2 max-pool, then a linear head.

    Stride-2 convolutions without pooling train 2.3× faster on the CPU but reached 2 pp less
    test accuracy at the same ε on Fashion-MNIST (docs/training.md), so the pooled design stays.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(_conv_block(channels, 16), _conv_block(16, 32))
        self.head = nn.Linear(32 * (height // 4) * (width // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    """ResNet basic block with GroupNorm (32 groups) and a projection shortcut when needed."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(32, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(32, channels_out)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.GroupNorm(32, channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 (2-2-2-2 basic blocks, widths 64-512) with GroupNorm and a CIFAR stem."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.GroupNorm(32, 64), nn.ReLU()
        )
        widths, layers, channels = (64, 128, 256, 512), [], 64
        for index, width in enumerate(widths):
            stride = 1 if index == 0 else 2
            layers.append(
                nn.Sequential(BasicBlock(channels, width, stride), BasicBlock(width, width, 1))
            )
            channels = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.layers(self.stem(x))).flatten(1))


_ARCHITECTURES: dict[ModelName, Callable[[tuple[int, ...], int], nn.Module]] = {
    ModelName.LOGREG: LogisticRegression,
    ModelName.CNN: SmallCNN,
    ModelName.RESNET18_GN: ResNet18GN,
}
MODEL_NAMES = values(ModelName)
ZERO_INITIALISED = frozenset({ModelName.LOGREG})


def _fine_tuned(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a fine-tuned transformer, checked: it names its base, its input rows
    are (2, L) token ids over an attention mask."""
    if spec.name != ModelName.TRANSFORMERS:
        if spec.fine_tune is not None:
            raise RecordError(f"model {spec.name!r} is not fine-tuned, but names a fine_tune")
        return False
    if spec.fine_tune is None:
        raise RecordError(f"model {spec.name!r} needs its base model (--model-dir)")
    if len(spec.input_shape) != 2 or spec.input_shape[0] != 2:
        raise RecordError(
            f"model {spec.name!r} needs token inputs (2, length), got shape {spec.input_shape}"
        )
    return True


def _architecture(spec: ModelSpec) -> Callable[[tuple[int, ...], int], nn.Module]:
    factory = spec.factory
    if factory is not None:
        return lambda shape, classes: build_factory_model(factory, shape, classes)
    if spec.name not in _ARCHITECTURES:
        raise RecordError(f"unknown model {spec.name!r}; known: {', '.join(MODEL_NAMES)}")
    if spec.name != ModelName.LOGREG and len(spec.input_shape) != 3:
        raise RecordError(
            f"model {spec.name!r} needs image inputs (C, H, W), got shape {spec.input_shape}"
        )
    return _ARCHITECTURES[spec.name]


def model_spec(
    name: str,
    data: DatasetSplits,
    *,
    model_path: str | None = None,
    fix: bool = False,
    fine_tune: FineTune | None = None,
) -> ModelSpec:
    """The spec of architecture ``name`` for ``data``'s input shape and classes; for a factory
    ``module:callable``, its record once the factory passed every check
    (:func:`~dpmerge.model_factory.check_factory`); a transformer, fine-tuned as ``fine_tune``
    declares (docs/design.md#fine-tuning)."""
    shape = tuple(data.input_shape)
    if ":" not in name:  # a built-in name, or an unknown one refused by _architecture
        spec = ModelSpec(str(name), shape, data.num_classes, fine_tune=fine_tune)
        if not _fine_tuned(spec):
            _architecture(spec)
        return spec
    record = check_factory(name, shape, data.num_classes, model_path=model_path, fix=fix)
    return ModelSpec(str(name), shape, data.num_classes, record)


def build_model(spec: ModelSpec, *, seed: int = 0) -> nn.Module:
    """Build ``spec``'s module with a deterministic initialisation from ``seed``.

    The global RNG is left untouched. ``logreg`` is zero-initialised whatever the seed; a
    transformer is its base reloaded by digest, the seed initialising its LoRA adapters.
    """
    fine_tuned = _fine_tuned(spec)
    architecture = None if fine_tuned else _architecture(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if architecture is None:
            from dpmerge.transformer import build_fine_tuned

            return build_fine_tuned(spec)
        model = architecture(spec.input_shape, spec.num_classes)
    if spec.name in ZERO_INITIALISED:
        model.reset_parameters()
    return model


def initialisation_id(spec: ModelSpec, seed: int) -> str:
    """The record's ``initialisation`` for a seeded build (``"zeros"`` when the seed is unused;
    a transformer: its base's digest, and the seed of its LoRA adapters)."""
    if _fine_tuned(spec):
        assert spec.fine_tune is not None  # checked by _fine_tuned
        seeded = f"/seed-{seed}" if spec.fine_tune.lora else ""
        return f"base-{spec.fine_tune.base_digest}{seeded}"
    return "zeros" if spec.name in ZERO_INITIALISED else f"seed-{seed}"


def check_weights_match(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`RecordError` unless ``state_dict`` has exactly ``spec``'s keys and shapes."""
    if _fine_tuned(spec):  # the trained parameters of the base reloaded by digest
        expected = {k: tuple(v.shape) for k, v in build_model(spec).state_dict().items()}
    else:
        with torch.device("meta"):
            module = _architecture(spec)(spec.input_shape, spec.num_classes)
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state_dict.items()}
    problems = []
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    if missing:
        problems.append(f"missing {_listing(missing)}")
    if extra:
        problems.append(f"unexpected {_listing(extra)}")
    wrong = [
        f"{k} {got[k]} (expected {expected[k]})"
        for k in expected.keys() & got.keys()
        if got[k] != expected[k]
    ]
    if wrong:
        problems.append(f"wrong shape {_listing(sorted(wrong))}")
    if problems:
        raise RecordError(
            f"weights do not belong to {spec.name} for input {spec.input_shape} "
            f"and {spec.num_classes} classes: " + "; ".join(problems)
        )


def _listing(items: list[str], shown: int = 4) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def load_pretrained(spec: ModelSpec, path: str | Path) -> tuple[nn.Module, str]:
    """Build ``spec``'s module initialised from a public safetensors checkpoint
    (docs/design.md#studies).

    Returns the module and the record's initialisation id ``checkpoint:<sha256 of the file>``.
    """
    path = Path(path)
    try:
        content = path.read_bytes()
        weights = load_file(str(path))
    except FileNotFoundError:
        raise RecordError(f"initial checkpoint not found: {path}") from None
    except (OSError, SafetensorError) as error:
        raise RecordError(
            f"initial checkpoint {path} is not a safetensors file ({error})"
        ) from None
    check_weights_match(spec, weights)
    model = build_model(spec)
    model.load_state_dict(weights)
    return model, f"checkpoint:{hashlib.sha256(content).hexdigest()}"
