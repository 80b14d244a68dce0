"""The ``policy set`` options, generated from :class:`dpmerge.policies.Policy` so that the two
never drift: one ``--field-name`` per field, its help the field's description, ``choices=``
for the closed vocabularies (the field's enum), numbers parsed as numbers (the model still
checks the ranges; a number is spelt as in JSON: ``1_0``, which Python's ``float`` reads as 10,
is refused). Only ``--name`` is required: ``set`` changes the fields it is given and
keeps the stored values of the others (docs/design.md#release-state); a new policy needs its
target, and takes the command's dataset and model defaults (``--dataset``, ``--model``)."""

from __future__ import annotations

import argparse
import re
import types
import typing
from enum import StrEnum
from typing import Any

from pydantic.fields import FieldInfo

from dpmerge.data.sources import default_dataset
from dpmerge.policies import Policy

ALIASES = {"target_delta": ("--delta",)}
"""Extra spellings of a field's option."""


COMMAND_DEFAULTS = {"dataset": default_dataset, "model": lambda: "logreg"}
"""Fields the model requires but the command fills in when the option is not given."""


def _base_type(annotation: Any) -> Any:
    """``float`` for ``StrictFloat | None``, the enum for an enum field, …"""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A decimal number: no underscores, no ``inf``/``nan``, no hexadecimal."""


def strict_float(text: str) -> float:
    """A decimal number (see :data:`NUMBER`); ``1_0``, ``nan`` and ``0x1p3`` are refused."""
    if not NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a decimal number, got {text!r}")
    return float(text)


def _boolean(text: str) -> bool:
    """``true`` or ``false`` (a given option can also switch a stored ``true`` off)."""
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text == "true"


def _option(name: str, field: FieldInfo) -> tuple[list[str], dict[str, Any]]:
    flags = [f"--{name.replace('_', '-')}", *ALIASES.get(name, ())]
    kind = _base_type(field.annotation)
    options: dict[str, Any] = {"dest": name, "help": field.description or name}
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        options["choices"] = [member.value for member in kind]
    elif kind is float:
        options["type"] = strict_float
        options["metavar"] = "X"
    elif kind is bool:
        options["type"] = _boolean
        options["metavar"] = "true|false"
    options["default"] = None
    if name == "name":
        options["required"] = True
        return flags, options
    default = None if field.is_required() else field.get_default()
    if default is not None:
        shown = default.value if isinstance(default, StrEnum) else default
        shown = str(shown).lower() if isinstance(shown, bool) else shown
        options["help"] += f" (a new policy's default: {shown})"
    elif name in COMMAND_DEFAULTS:
        options["help"] += f" (a new policy's default: {COMMAND_DEFAULTS[name]()})"
    return flags, options


def add_policy_options(parser: argparse.ArgumentParser) -> None:
    """One option per field of :class:`Policy`."""
    for name, field in Policy.model_fields.items():
        flags, options = _option(name, field)
        parser.add_argument(*flags, **options)


def given_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The fields whose options were given (an option not given is left out: ``set`` keeps
    the stored value)."""
    return {
        name: getattr(args, name) for name in Policy.model_fields if getattr(args, name) is not None
    }


def new_policy_defaults() -> dict[str, Any]:
    """The command's defaults for fields a new policy needs and the model does not default."""
    return {name: make() for name, make in COMMAND_DEFAULTS.items()}
