"""The closed vocabularies of training: one enum each, declared here and nowhere else.

Each is a ``StrEnum``, so a member equals, hashes and prints as its value: ``"logreg"`` and
``ModelName.LOGREG`` are the same key, JSON holds the plain string, and the CLI offers the
values as ``choices``. The record's update rule (``Optimizer``) is declared with the mechanism
record in :mod:`dpmerge.accounting.records` (docs/design.md#mechanism-record).
"""

from __future__ import annotations

from enum import StrEnum


class DatasetName(StrEnum):
    """The datasets :func:`dpmerge.data.load_dataset` reads (docs/training.md, "Data")."""

    DIGITS = "digits"
    FASHION_MNIST = "fashion-mnist"
    MNIST = "mnist"
    CIFAR10 = "cifar10"


class ModelName(StrEnum):
    """The architectures :mod:`dpmerge.models` builds and a record's ``model.json`` names."""

    LOGREG = "logreg"
    CNN = "cnn"
    RESNET18_GN = "resnet18_gn"


class GradSampleMode(StrEnum):
    """How per-example gradients are computed: the exact linear engine, or an Opacus mode."""

    LINEAR_EXACT = "linear-exact"
    HOOKS = "hooks"
    FUNCTORCH = "functorch"
    EW = "ew"
    GHOST = "ghost"


class Engine(StrEnum):
    """The code that runs the DP-SGD mechanism (docs/training.md, "Engines")."""

    LINEAR_EXACT = "linear-exact"
    OPACUS = "opacus"


def values(vocabulary: type[StrEnum]) -> tuple[str, ...]:
    """The plain string values of ``vocabulary``, in declaration order."""
    return tuple(member.value for member in vocabulary)
