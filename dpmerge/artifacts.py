"""The on-disk layout of a model directory: a trained candidate or a merged model.

``DIR/weights.safetensors``  tensors only (loaded without pickle)
``DIR/model.json``           architecture: {"name", "input_shape", "num_classes"}
``DIR/record.json``          candidate: {"record": <MechanismRecord>, "privacy": <candidate bound>}
                             merge: {"merge": {"method", "weights", "candidates": [...]}}
``DIR/metrics.json``         evaluation results
``DIR/privacy.json``         merges only: the PrivacyReport (both bounds, accountants, δ)

Writes are atomic: everything goes to a sibling temporary directory that is renamed into place,
so a failed write leaves nothing behind (and never half a directory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dpmerge.accounting.records import Candidate, candidate_from_dict
from dpmerge.errors import RecordError

WEIGHTS_FILE = "weights.safetensors"
MODEL_FILE = "model.json"
RECORD_FILE = "record.json"
METRICS_FILE = "metrics.json"
PRIVACY_FILE = "privacy.json"


@dataclass(frozen=True)
class ModelSpec:
    """Which architecture a set of weights belongs to (a name in ``dpmerge.models``)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        try:
            return cls(
                str(data["name"]),
                tuple(int(v) for v in data["input_shape"]),
                int(data["num_classes"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise RecordError(f"{MODEL_FILE}: malformed model spec ({error})") from None


@dataclass(frozen=True)
class ModelDir:
    """A loaded model directory."""

    path: Path
    weights: dict[str, torch.Tensor]
    spec: ModelSpec
    record: Candidate | None = None
    candidate_privacy: dict[str, Any] | None = None
    merge: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    privacy: dict[str, Any] | None = None

    @property
    def is_merge(self) -> bool:
        return self.merge is not None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecordError(f"{path} is not valid JSON: {error}") from None


def load_model_dir(path: str | Path) -> ModelDir:
    """Load a model directory written by :func:`save_model_dir`; clear errors if incomplete."""
    path = Path(path)
    if not path.is_dir():
        raise RecordError(f"model directory not found: {path}")
    for required in (WEIGHTS_FILE, MODEL_FILE, RECORD_FILE):
        if not (path / required).is_file():
            raise RecordError(f"{path}: missing {required}")
    spec = ModelSpec.from_dict(_read_json(path / MODEL_FILE))
    record_doc = _read_json(path / RECORD_FILE)
    record = candidate_from_dict(record_doc["record"]) if "record" in record_doc else None
    metrics_path, privacy_path = path / METRICS_FILE, path / PRIVACY_FILE
    return ModelDir(
        path=path,
        weights=load_file(str(path / WEIGHTS_FILE)),
        spec=spec,
        record=record,
        candidate_privacy=record_doc.get("privacy"),
        merge=record_doc.get("merge"),
        metrics=_read_json(metrics_path) if metrics_path.is_file() else {},
        privacy=_read_json(privacy_path) if privacy_path.is_file() else None,
    )


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
