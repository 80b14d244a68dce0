"""The ``policy set`` options, generated from :class:`dpmerge.policies.Policy` so that the two
never drift: one ``--field-name`` per field, its help the field's description, ``choices=``
for the closed vocabularies (the field's enum), numbers parsed as numbers (the model still
checks the ranges), required where the model requires the field and the command has no
default of its own (``--dataset``, ``--model``)."""

from __future__ import annotations

import argparse
import types
import typing
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from dpmerge.policies import Policy

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
ALIASES = {"target_delta": ("--delta",)}
"""Extra spellings of a field's option."""


def default_dataset() -> str:
    """Fashion-MNIST where its Debian package is installed, else scikit-learn's digits."""
    return "fashion-mnist" if FASHION_MNIST_DIR.is_dir() else "digits"


COMMAND_DEFAULTS = {"dataset": default_dataset, "model": lambda: "logreg"}
"""Fields the model requires but the command fills in when the option is not given."""


def _base_type(annotation: Any) -> Any:
    """``float`` for ``StrictFloat | None``, the enum for an enum field, …"""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _option(name: str, field: FieldInfo) -> tuple[list[str], dict[str, Any]]:
    flags = [f"--{name.replace('_', '-')}", *ALIASES.get(name, ())]
    kind = _base_type(field.annotation)
    options: dict[str, Any] = {"dest": name, "help": field.description or name}
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        options["choices"] = [member.value for member in kind]
    elif kind is float:
        options["type"] = float
        options["metavar"] = "X"
    if field.is_required() and name not in COMMAND_DEFAULTS:
        options["required"] = True
    else:
        default = None if field.is_required() else field.get_default()
        options["default"] = None
        if default is not None:
            shown = default.value if isinstance(default, StrEnum) else default
            options["help"] += f" (default {shown})"
        elif name in COMMAND_DEFAULTS:
            options["help"] += f" (default {COMMAND_DEFAULTS[name]()})"
    return flags, options


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """One option per field of :class:`Policy`."""
    for name, field in Policy.model_fields.items():
        flags, options = _option(name, field)
        parser.add_argument(*flags, **options)


def policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The policy the options describe: given values, the command's defaults, and the model's
    own defaults for the rest (an option not given is left out)."""
    fields: dict[str, Any] = {}
    for name in Policy.model_fields:
        value = getattr(args, name)
        if value is None and name in COMMAND_DEFAULTS:
            value = COMMAND_DEFAULTS[name]()
        if value is not None:
            fields[name] = value
    return fields
