"""Reading validated documents: one-line errors that name the offending field or file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dpmerge.errors import InputError, RecordError


def describe_validation_error(where: str, error: ValidationError) -> str:
    """``"<where>: missing field 'x'; field 'y': must be > 0 (got -1)"``."""
    problems = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "value"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems.append(f"missing field {field!r}")
        elif item["type"] == "extra_forbidden":
            problems.append(f"unknown field {field!r}")
        else:
            got = item.get("input")
            shown = "" if isinstance(got, dict) or not item["loc"] else f" (got {got!r})"
            problems.append(f"field {field!r}: {message}{shown}")
    return f"{where}: " + "; ".join(problems)


def read_item_list(
    path: str | Path,
    key: str,
    *,
    what: str,
    parse: Callable[[str], Any],
    error: type[InputError] = RecordError,
) -> list[Any]:
    """The non-empty list under ``key`` of a JSON/YAML document at ``path``."""
    path = Path(path)
    try:
        document = parse(path.read_text())
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except (ValueError, yaml.YAMLError) as problem:  # JSONDecodeError is a ValueError
        raise error(f"{what} file {path} is not valid: {problem}") from None
    if not isinstance(document, dict) or not isinstance(document.get(key), list):
        raise error(f"{path}: expected a mapping with a {key!r} list")
    if not document[key]:
        raise error(f"{path}: the {key} list is empty")
    return document[key]
