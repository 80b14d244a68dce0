"""The on-disk layout of a model directory: a trained candidate or a merged model.

``DIR/weights.safetensors``  tensors only (loaded without pickle)
``DIR/model.json``           architecture: {"name", "input_shape", "num_classes"}, for a
                             user's model its "factory" record, and for a fine-tuned
                             transformer its "fine_tune" (base digest, trained subset)
``DIR/record.json``          candidate: {"record": <MechanismRecord>, "privacy": <candidate bound>}
                             merge: {"merge": {"method", "weights", "candidates": [...]}}
``DIR/metrics.json``         evaluation results
``DIR/privacy.json``         merges only: the PrivacyReport (both bounds, accountants, δ)

Writes are atomic: everything goes to a sibling temporary directory that is renamed into place,
so a failed write leaves nothing behind (and never half a directory). :func:`load_model_dir` is
the one reader of the layout; the weights' header (names, shapes, dtypes) is read with the
documents and the tensors themselves at once or, for streaming merges, on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from dpmerge.accounting.records import Candidate, candidate_from_dict
from dpmerge.errors import RecordError
from dpmerge.fine_tuning import FineTune

if TYPE_CHECKING:  # torch loads on first use: `dpmerge verify` reads the layout's names only
    import torch

WEIGHTS_FILE = "weights.safetensors"
MODEL_FILE = "model.json"
RECORD_FILE = "record.json"
METRICS_FILE = "metrics.json"
PRIVACY_FILE = "privacy.json"


@dataclass(frozen=True)
class FactoryRecord:
    """The user's model factory a spec was built by (docs/design.md#your-model): its reference
    ``module:callable``, the sha256 of its module's source, whether Opacus'
    ``ModuleValidator.fix`` was applied, and the directory put first on ``sys.path`` to import
    it (where it was found; not part of the identity)."""

    reference: str
    sha256: str
    fixed: bool
    path: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FactoryRecord:
        reference, sha256, fixed, path = (
            data["reference"],
            data["sha256"],
            data["fixed"],
            data.get("path"),
        )
        if not (isinstance(reference, str) and isinstance(sha256, str) and isinstance(fixed, bool)):
            raise TypeError("factory needs reference and sha256 as text, fixed as true or false")
        if path is not None and not isinstance(path, str):
            raise TypeError("factory path must be text")
        return cls(reference, sha256, fixed, path)


@dataclass(frozen=True)
class ModelSpec:
    """Which architecture a set of weights belongs to: a name in ``dpmerge.models``, or a user's
    factory ``module:callable`` with its :class:`FactoryRecord`; a fine-tuned transformer also
    names its base and trained subset (docs/design.md#fine-tuning)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    factory: FactoryRecord | None = None
    fine_tune: FineTune | None = None

    @property
    def label(self) -> str:
        """The model's part of registered-model names (docs/design.md#registry): the name, and
        for a factory the first 8 hex digits of its source's sha256 before its reference."""
        if self.factory is None:
            return self.name
        return f"factory-{self.factory.sha256[:8]}-{self.name}"

    def to_dict(self) -> dict[str, Any]:
        fine_tune = {} if self.fine_tune is None else {"fine_tune": self.fine_tune.to_dict()}
        data: dict[str, Any] = {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            **fine_tune,
        }
        if self.factory is not None:
            data["factory"] = self.factory.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        try:
            factory = data.get("factory")
            return cls(
                str(data["name"]),
                tuple(int(v) for v in data["input_shape"]),
                int(data["num_classes"]),
                None if factory is None else FactoryRecord.from_dict(factory),
                FineTune.from_dict(data["fine_tune"]) if "fine_tune" in data else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise RecordError(f"{MODEL_FILE}: malformed model spec ({error})") from None


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one stored tensor, read from the safetensors header."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@cache
def _dtypes() -> dict[str, torch.dtype]:
    """The safetensors dtypes a model directory may hold, as torch's."""
    import torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }


def file_label(file: Path) -> str:
    """How errors name a weights file: its model directory, or the file itself."""
    return str(file.parent) if file.name == WEIGHTS_FILE else str(file)


def read_header(file: str | Path) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of the tensors in a safetensors file (no tensor data read)."""
    file = Path(file)
    if not file.is_file():
        raise RecordError(f"weights file not found: {file}")
    tensors: dict[str, TensorInfo] = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                piece = handle.get_slice(key)
                dtype = _dtypes().get(piece.get_dtype())
                if dtype is None:
                    raise RecordError(
                        f"{file_label(file)}: tensor {key!r} has unsupported dtype "
                        f"{piece.get_dtype()} (supported: {', '.join(_dtypes())})"
                    )
                tensors[key] = TensorInfo(tuple(piece.get_shape()), dtype)
    except (OSError, SafetensorError) as error:
        raise RecordError(f"{file_label(file)}: unreadable safetensors file ({error})") from None
    return tensors


@dataclass(frozen=True)
class ModelDir:
    """A model directory as :func:`load_model_dir` read it."""

    path: Path
    spec: ModelSpec
    tensors: dict[str, TensorInfo]
    """The weights' names, shapes and dtypes (the safetensors header)."""
    record: Candidate | None = None
    candidate_privacy: dict[str, Any] | None = None
    merge: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    privacy: dict[str, Any] | None = None

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE

    @cached_property
    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors (read once, on first use unless loaded with the directory)."""
        from safetensors.torch import load_file

        return load_file(str(self.weights_file))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecordError(f"{path} is not valid JSON: {error}") from None


def load_model_dir(path: str | Path, *, weights: bool = True) -> ModelDir:
    """Read a model directory written by :func:`save_model_dir`, with clear errors if it is
    incomplete. ``weights=False`` reads only the weights' header and leaves the tensors on disk
    until :attr:`ModelDir.weights` is first used (a merge streams them instead)."""
    path = Path(path)
    if not path.is_dir():
        raise RecordError(f"model directory not found: {path}")
    for required in (WEIGHTS_FILE, MODEL_FILE, RECORD_FILE):
        if not (path / required).is_file():
            raise RecordError(f"{path}: not a model directory (missing {required})")
    spec = ModelSpec.from_dict(_read_json(path / MODEL_FILE))
    record_doc = _read_json(path / RECORD_FILE)
    record = candidate_from_dict(record_doc["record"]) if "record" in record_doc else None
    metrics_path, privacy_path = path / METRICS_FILE, path / PRIVACY_FILE
    loaded = ModelDir(
        path=path,
        spec=spec,
        tensors=read_header(path / WEIGHTS_FILE),
        record=record,
        candidate_privacy=record_doc.get("privacy"),
        merge=record_doc.get("merge"),
        metrics=_read_json(metrics_path) if metrics_path.is_file() else {},
        privacy=_read_json(privacy_path) if privacy_path.is_file() else None,
    )
    if weights:
        loaded.weights  # noqa: B018 - read the tensors now, while the directory is there
    return loaded


def save_model_dir(
    path: str | Path,
    weights: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    *,
    record: Candidate | None = None,
    candidate_privacy: Mapping[str, Any] | None = None,
    merge: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    privacy: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    weights_metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a model directory atomically. Exactly one of ``record`` and ``merge`` is given;
    ``weights_metadata`` goes into the safetensors header."""
    from safetensors.torch import save_file

    path = Path(path)
    if (record is None) == (merge is None):
        raise ValueError("a model directory holds either a candidate record or a merge")
    if path.exists() and not overwrite:
        raise RecordError(f"output directory already exists: {path} (pass overwrite to replace)")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata=dict(weights_metadata or {}))
        (staging / MODEL_FILE).write_text(json.dumps(spec.to_dict(), indent=2))
        document: dict[str, Any] = {}
        if record is not None:
            document["record"] = record.model_dump(mode="json", exclude_none=True)
            if candidate_privacy is not None:
                document["privacy"] = dict(candidate_privacy)
        else:
            document["merge"] = dict(merge or {})
        (staging / RECORD_FILE).write_text(json.dumps(document, indent=2))
        (staging / METRICS_FILE).write_text(json.dumps(dict(metrics or {}), indent=2))
        if privacy is not None:
            (staging / PRIVACY_FILE).write_text(json.dumps(dict(privacy), indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path
