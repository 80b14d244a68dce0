"""Reading validated documents: one-line errors that name the offending field or file."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dpmerge.errors import InputError, RecordError
from dpmerge.formatting import cut

MAX_SHOWN = 60
"""Echoed input is cut to this many characters: an error line stays one short line."""


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, MAX_SHOWN, MAX_SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
"""Bounded ``repr``: a YAML alias bomb (a list of lists of … sharing one node) is not expanded,
so echoing it costs microseconds and a few characters, not gigabytes."""


def shorten(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` (bounded, see :data:`_REPR`), cut to ``limit`` characters, escaped."""
    return cut(_REPR.repr(value), limit)


class _StrictYamlLoader(yaml.SafeLoader):
    """YAML with two traps removed: a key given twice is an error (PyYAML keeps the last value
    silently), and ``1e-5`` is a number as in YAML 1.2 (PyYAML's YAML 1.1 reads it as a
    string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {shorten(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML strictly (see :class:`_StrictYamlLoader`)."""
    return yaml.load(text, Loader=_StrictYamlLoader)


def describe_validation_error(where: str, error: ValidationError) -> str:
    """``"<where>: missing field 'x'; field 'y': must be > 0 (got -1)"``."""
    problems = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "value"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems.append(f"missing field {shorten(field)}")
        elif item["type"] == "extra_forbidden":
            problems.append(f"unknown field {shorten(field)}")
        else:
            got = item.get("input")
            shown = "" if isinstance(got, dict) or not item["loc"] else f" (got {shorten(got)})"
            problems.append(f"field {shorten(field)}: {message}{shown}")
    if len(problems) > 5:
        problems = [*problems[:5], f"and {len(problems) - 5} more"]
    return f"{where}: " + "; ".join(problems)


def _parse_problem(problem: Exception) -> str:
    """A parser's complaint in one short line: ``line L, column C: what`` where YAML marks it."""
    if isinstance(problem, yaml.MarkedYAMLError) and problem.problem_mark is not None:
        mark = problem.problem_mark
        what = " ".join(p for p in (problem.context, problem.problem) if p)
        return cut(f"line {mark.line + 1}, column {mark.column + 1}: {what}", 200)
    return cut(str(problem), 200)


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
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise error(f"{what} file {path} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{what} file {path} cannot be read: {cut(str(problem), 200)}") from None
    try:
        document = parse(text)
    except RecursionError:
        raise error(f"{what} file {path} is nested too deeply") from None
    except (ValueError, yaml.YAMLError) as problem:  # JSONDecodeError is a ValueError
        raise error(f"{what} file {path} is not valid: {_parse_problem(problem)}") from None
    if not isinstance(document, dict) or not isinstance(document.get(key), list):
        raise error(f"{path}: expected a mapping with a {key!r} list")
    if not document[key]:
        raise error(f"{path}: the {key} list is empty")
    return document[key]
