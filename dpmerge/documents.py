"""Reading validated documents: one-line errors that name the offending field or file.

Strict on every count: only a regular file of at most :data:`MAX_DOCUMENT_BYTES` is read (a
device such as ``/dev/zero`` or a pipe would never end); a key given twice is an error in JSON
as in YAML (the last value never silently wins); a top-level key other than the document's own
is refused, and an unknown key gets the nearest known one (``did you mean …?``). Echoed input is
escaped (:func:`dpmerge.formatting.printable`) and cut short.
"""

from __future__ import annotations

import json
import re
import reprlib
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dpmerge.errors import InputError, RecordError
from dpmerge.formatting import cut, did_you_mean

MAX_SHOWN = 60
"""Echoed input is cut to this many characters: an error line stays one short line."""
MAX_DOCUMENT_BYTES = 64 * 2**20
"""Largest policies or candidates file read: far above any real one (a candidate record is
under 1 kB, a 4096-order RDP label under 200 kB), so only a runaway file is refused unread."""


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


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (Python's ``json`` keeps the last silently)."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            named = dict(pairs).get("name")
            where = f" in the object named {shorten(named)}" if isinstance(named, str) else ""
            raise ValueError(f"duplicate key {shorten(key)}{where}")
        document[key] = value
    return document


def load_json(text: str) -> Any:
    """Parse JSON strictly: a key given twice is an error (see :func:`unique_keys`)."""
    return json.loads(text, object_pairs_hook=unique_keys)


def unknown_key(key: Any, known: Iterable[str]) -> str:
    """``unknown field 'x'; did you mean 'y'?``"""
    return f"unknown field {shorten(key)}" + (
        did_you_mean(key, known) if isinstance(key, str) else ""
    )


def describe_validation_error(
    where: str, error: ValidationError, model: type[BaseModel] | None = None
) -> str:
    """``"<where>: missing field 'x'; field 'y': must be > 0 (got -1)"``; an unknown field is
    named with the nearest field of ``model``."""
    problems = []
    known = list(model.model_fields) if model is not None else []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "value"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems.append(f"missing field {shorten(field)}")
        elif item["type"] == "extra_forbidden":
            problems.append(unknown_key(field, known))
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


def _read_text(path: Path, what: str, error: type[InputError]) -> str:
    """The UTF-8 text of the regular file at ``path``, at most :data:`MAX_DOCUMENT_BYTES`."""
    try:
        status = path.stat()
        if stat.S_ISDIR(status.st_mode):
            raise error(f"{what} file {path} is a directory, not a file")
        if not stat.S_ISREG(status.st_mode):
            raise error(f"{what} file {path} is not a regular file (a device, pipe or socket)")
        if status.st_size > MAX_DOCUMENT_BYTES:
            raise error(f"{what} file {path} is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB")
        with path.open("rb") as opened:
            data = opened.read(MAX_DOCUMENT_BYTES + 1)
        if len(data) > MAX_DOCUMENT_BYTES:
            raise error(f"{what} file {path} is larger than {MAX_DOCUMENT_BYTES // 2**20} MiB")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{what} file {path} cannot be read: {cut(str(problem), 200)}") from None


def read_item_list(
    path: str | Path,
    key: str,
    *,
    what: str,
    parse: Callable[[str], Any],
    error: type[InputError] = RecordError,
) -> list[Any]:
    """The non-empty list under ``key``, the only top-level key, of a JSON/YAML document at
    ``path`` (see the module docstring)."""
    path = Path(path)
    text = _read_text(path, what, error)
    try:
        document = parse(text)
    except RecursionError:
        raise error(f"{what} file {path} is nested too deeply") from None
    except (ValueError, yaml.YAMLError) as problem:  # JSONDecodeError is a ValueError
        raise error(f"{what} file {path} is not valid: {_parse_problem(problem)}") from None
    if not isinstance(document, dict):
        raise error(f"{path}: expected a mapping with a {key!r} list")
    extra = [k for k in document if k != key]
    if extra:
        raise error(f"{path}: top level: {unknown_key(extra[0], [key])} (only {key!r} is read)")
    if not isinstance(document.get(key), list):
        raise error(f"{path}: expected a mapping with a {key!r} list")
    if not document[key]:
        raise error(f"{path}: the {key} list is empty")
    return document[key]
