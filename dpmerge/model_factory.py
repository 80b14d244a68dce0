"""A model of the user's own: an importable factory ``module:callable``, called as
``factory(input_shape, num_classes)`` and returning a ``torch.nn.Module``
(docs/design.md#your-model).

The module is found on ``sys.path``, with the user's ``--model-path`` directory put first for
the import and the call. Its source (the module's file, or every ``.py`` file of a package) is
digested with sha256 before it is imported; the digest is recorded with the reference, so a
later rebuild (merge, evaluation, serving) refuses a factory whose source changed. Every
refusal is one :class:`~dpmerge.errors.ModelFactoryError` line, raised before any training.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from dpmerge.artifacts import FactoryRecord
from dpmerge.errors import ModelFactoryError
from dpmerge.formatting import cut
from dpmerge.model_reference import parse_reference

_LINE = 300
_imported: dict[str, str] = {}
"""The source digest each factory module was last imported at: a changed source is imported
anew, its submodules too."""

Factory = Callable[[tuple[int, ...], int], nn.Module]


@contextmanager
def _first_on_path(path: str | None) -> Iterator[None]:
    """``path`` first on ``sys.path`` while the block runs (nothing when ``None``)."""
    if path is None:
        yield
        return
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFactoryError(f"model path {path} is not a directory")
    entry = str(folder.resolve())
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)


def _source_files(module: str) -> list[tuple[str, Path]]:
    """The module's source files named relative to its folder (a package: all its ``.py``)."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as error:
        raise ModelFactoryError(
            f"model factory module {module!r} not found ({cut(str(error), 120)})"
        ) from None
    if found is None:
        raise ModelFactoryError(
            f"model factory module {module!r} not found on sys.path (give --model-path DIR)"
        )
    if found.origin is None or not Path(found.origin).is_file():
        raise ModelFactoryError(f"model factory module {module!r} has no source file to digest")
    origin = Path(found.origin)
    if found.submodule_search_locations is None:
        return [(origin.name, origin)]
    return [(str(p.relative_to(origin.parent)), p) for p in sorted(origin.parent.rglob("*.py"))]


def source_digest(module: str) -> str:
    """sha256 over the module's source files, each named by its relative path."""
    digest = hashlib.sha256()
    for name, file in _source_files(module):
        digest.update(name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _import(module: str, digest: str) -> ModuleType:
    """Import the user's module without writing bytecode beside it (a ``.pyc`` written now could
    stand for an edit made within the same second)."""
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        if _imported.get(module, digest) != digest:  # stale: the module and its submodules
            for name in [n for n in sys.modules if n == module or n.startswith(f"{module}.")]:
                del sys.modules[name]
        loaded = importlib.import_module(module)
        _imported[module] = digest
    except Exception as error:  # the user's module: whatever its import raises is refused
        raise ModelFactoryError(
            f"model factory module {module!r} failed to import: "
            f"{type(error).__name__}: {cut(str(error), _LINE)}"
        ) from None
    finally:
        sys.dont_write_bytecode = writes
    return loaded


def _factory(reference: str, digest: str) -> Factory:
    module, attribute = parse_reference(reference)
    found: object = _import(module, digest)
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ModelFactoryError(f"model factory {reference}: {module} has no {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ModelFactoryError(
            f"model factory {reference} is not callable (a {type(found).__name__})"
        )
    return found  # type: ignore[return-value]


def _call(
    reference: str, factory: Factory, input_shape: tuple[int, ...], classes: int
) -> nn.Module:
    try:
        model = factory(input_shape, classes)
    except Exception as error:  # the user's code: whatever it raises is refused in one line
        raise ModelFactoryError(
            f"model factory {reference} raised {type(error).__name__}: {cut(str(error), _LINE)}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(
            f"model factory {reference} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _opacus_problems(model: nn.Module) -> list[str]:
    from opacus.validators import ModuleValidator

    return [cut(str(error), 160) for error in ModuleValidator.validate(model, strict=False)]


def _fix(model: nn.Module) -> nn.Module:
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


def build_factory_model(
    record: FactoryRecord, input_shape: tuple[int, ...], classes: int
) -> nn.Module:
    """Rebuild a recorded factory's module (fixed as recorded); refused if the source's sha256
    is not the recorded one."""
    module, _ = parse_reference(record.reference)
    with _first_on_path(record.path):
        digest = source_digest(module)
        if digest != record.sha256:
            raise ModelFactoryError(
                f"model factory {record.reference}: its source changed since these weights were "
                f"trained (sha256 {digest[:12]}…, recorded {record.sha256[:12]}…)"
            )
        model = _call(record.reference, _factory(record.reference, digest), input_shape, classes)
    return _fix(model) if record.fixed else model


def check_factory(
    reference: str,
    input_shape: tuple[int, ...],
    classes: int,
    *,
    model_path: str | None = None,
    fix: bool = False,
) -> FactoryRecord:
    """The record of factory ``reference`` after checking, on one build, everything training
    needs: a module Opacus accepts (``ModuleValidator.validate(strict=False)``; with ``fix``,
    after ``ModuleValidator.fix``), an output of shape ``(batch, classes)`` and trainable
    parameters."""
    module, _ = parse_reference(reference)
    path = None if model_path is None else str(Path(model_path).resolve())
    with _first_on_path(path):
        digest = source_digest(module)
    record = FactoryRecord(reference, digest, fix, path)
    model = build_factory_model(record, input_shape, classes)
    problems = _opacus_problems(model)
    if problems:
        again = "" if fix else " (--fix-model applies Opacus' ModuleValidator.fix)"
        raise ModelFactoryError(
            f"model factory {reference}: Opacus refuses the module{again}: " + "; ".join(problems)
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFactoryError(
            f"model factory {reference}: the module has no trainable parameters"
        )
    _check_output(reference, model, input_shape, classes)
    return record


def _check_output(
    reference: str, model: nn.Module, input_shape: tuple[int, ...], classes: int
) -> None:
    model.eval()
    try:
        with torch.no_grad():
            output = model(torch.zeros(2, *input_shape))
    except Exception as error:  # the user's forward pass: refused in one line
        raise ModelFactoryError(
            f"model factory {reference}: the module's forward pass on input {input_shape} raised "
            f"{type(error).__name__}: {cut(str(error), _LINE)}"
        ) from None
    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
    if shape != (2, classes):
        got = f"shape {shape}" if shape is not None else f"a {type(output).__name__}"
        raise ModelFactoryError(
            f"model factory {reference}: output for a batch of 2 is {got}, "
            f"expected (2, {classes}) for {classes} classes"
        )
