"""Importing DP models trained elsewhere as candidates (docs/design.md#imported-candidates).

An import is weights for a built-in architecture (:class:`~dpmerge.vocabulary.ModelName`) on a
dataset dpmerge loads, plus a privacy profile (:class:`~dpmerge.vocabulary.ProfileKind`):

* ``record``: a DP-SGD mechanism record (σ, q, steps, clip, learning rate, batch, optimizer,
  sampling, neighbouring relation, optionally the noise and batch lineages);
* ``opacus``: the same, with σ, q and steps read from the history of the ``PrivacyEngine``
  accountant saved in an Opacus checkpoint (one phase only; several are refused);
* ``rdp`` or ``epsilon_delta``: a curve, for other mechanisms
  (:mod:`dpmerge.accounting.profile_curve`).

The importer is the workflow identity (:attr:`~dpmerge.vocabulary.StackRole.WORKFLOW`): it holds
the workflow key, signs the attestation (record, weights digest and attester, HMAC under
:attr:`~dpmerge.vocabulary.KeyPurpose.IMPORT_ATTESTATION`) into the weights' header, and names
the person or system that vouches for the profile in the record's ``attested_by``. A batch
lineage the profile does not give is ``unknown:<dataset>``: every such DP-SGD import of one
dataset shares it and so forms one shared-batch release unit (docs/design.md#release-units).
An initialisation the profile does not state is the import's own: LC never averages its weights
with another candidate's (:func:`~dpmerge.accounting.weights.initialisation_conflict`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.profile_curve import epsilon_delta_label, rdp_label
from dpmerge.accounting.records import UNKNOWN_BATCH_LINEAGE, Candidate, MechanismRecord
from dpmerge.artifacts import ModelSpec, read_header, save_model_dir
from dpmerge.data import DatasetSplits
from dpmerge.documents import describe_validation_error, load_json
from dpmerge.errors import AccessError, RecordError
from dpmerge.keys import WorkflowKey
from dpmerge.models import check_weights_match
from dpmerge.vocabulary import KeyPurpose, ProfileKind, WeightsFormat
from dpmerge.workspace import Workspace

OPACUS_PREFIX = "_module."
"""Opacus' ``GradSampleModule`` prefixes the wrapped module's parameter names with this."""
ATTESTED_BY, ATTESTATION, KEY_ID, WEIGHTS_DIGEST = (
    "dpmerge.attested_by",
    "dpmerge.attestation",
    "dpmerge.attestation_key_id",
    "dpmerge.imported_weights_sha256",
)
_PROFILE_FIELDS = {
    ProfileKind.RECORD: frozenset(
        {"noise_multiplier", "sample_rate", "steps", "clip_norm", "learning_rate"}
        | {"expected_batch_size", "optimizer", "sampling", "neighbouring"}
        | {"noise_lineage", "batch_lineage", "initialisation"}
    ),
    ProfileKind.RDP: frozenset({"orders", "epsilons", "initialisation"}),
    ProfileKind.EPSILON_DELTA: frozenset({"epsilons", "deltas", "initialisation"}),
}
_PROFILE_FIELDS[ProfileKind.OPACUS] = _PROFILE_FIELDS[ProfileKind.RECORD] - {
    "noise_multiplier",
    "sample_rate",
    "steps",
}


@dataclass(frozen=True)
class ImportedWeights:
    """Tensors read from an import's weight file, and which format it was."""

    tensors: dict[str, torch.Tensor]
    format: WeightsFormat
    checkpoint: Mapping[str, Any] | None
    """The whole Opacus checkpoint (its accountant history is a profile), else ``None``."""


@dataclass(frozen=True)
class ImportResult:
    """An imported candidate directory and what was attested
    (docs/design.md#imported-candidates)."""

    path: Path
    record: Candidate
    weights_format: WeightsFormat
    profile: ProfileKind
    weights_sha256: str
    key_id: str


def read_weights(path: str | Path) -> ImportedWeights:
    """The tensors of a ``.safetensors`` file, a torch state dict or an Opacus checkpoint
    (``torch.load`` with ``weights_only=True``: no pickled code runs)."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        try:
            read_header(path)
            return ImportedWeights(load_file(str(path)), WeightsFormat.SAFETENSORS, None)
        except (SafetensorError, RecordError) as error:
            raise RecordError(f"{path}: not a readable safetensors file ({error})") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file it cannot unpickle safely
        raise RecordError(
            f"{path}: not a torch state dict or Opacus checkpoint ({type(error).__name__})"
        ) from None
    if not isinstance(loaded, Mapping):
        raise RecordError(f"{path}: holds a {type(loaded).__name__}, not a state dict")
    if "module_state_dict" in loaded:
        state = {k.removeprefix(OPACUS_PREFIX): v for k, v in loaded["module_state_dict"].items()}
        return ImportedWeights(_tensors(state, path), WeightsFormat.OPACUS, loaded)
    return ImportedWeights(_tensors(loaded, path), WeightsFormat.STATE_DICT, None)


def _tensors(state: Mapping[Any, Any], path: Path) -> dict[str, torch.Tensor]:
    bad = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise RecordError(f"{path}: entry {bad!r} is not a tensor")
    return {str(k): v for k, v in state.items()}


def check_weights(tensors: Mapping[str, torch.Tensor], spec: ModelSpec, path: Path) -> None:
    """Names and shapes of ``spec``'s architecture, float32 and finite, else one line."""
    try:
        check_weights_match(spec, tensors)
    except RecordError as error:
        raise RecordError(f"{path}: {error}") from None
    for key, tensor in sorted(tensors.items()):
        if tensor.dtype != torch.float32:
            raise RecordError(f"{path}: tensor {key!r} is {tensor.dtype}, expected torch.float32")
        if not bool(torch.isfinite(tensor).all()):
            raise RecordError(f"{path}: tensor {key!r} holds NaN or infinite values")


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, shapes and bytes of the tensors, in name order."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].detach().to("cpu").contiguous()
        digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def opacus_phase(checkpoint: Mapping[str, Any], where: str) -> tuple[float, float, int]:
    """(σ, q, steps) of the accountant history in an Opacus checkpoint: one phase, or refused."""
    state = checkpoint.get("privacy_accountant_state_dict")
    history = state.get("history") if isinstance(state, Mapping) else None
    if not history:
        raise RecordError(f"{where}: the checkpoint holds no privacy accountant history")
    phases: dict[tuple[float, float], int] = {}
    for entry in history:
        if not (isinstance(entry, list | tuple) and len(entry) == 3):
            raise RecordError(f"{where}: an accountant history entry is not (σ, q, steps)")
        sigma, rate, steps = entry
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise RecordError(f"{where}: an accountant history step count is not an integer")
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in (sigma, rate)):
            raise RecordError(f"{where}: an accountant history σ or q is not a number")
        key = (float(sigma), float(rate))
        phases[key] = phases.get(key, 0) + steps
    if len(phases) > 1:
        shown = ", ".join(f"σ = {s:g}, q = {q:g} × {t}" for (s, q), t in phases.items())
        raise RecordError(
            f"{where}: the accountant history has {len(phases)} phases ({shown}); a mechanism "
            "record holds one (σ, q), so several phases are not imported"
        )
    (((sigma, rate), steps),) = phases.items()
    return sigma, rate, steps


def _profile_document(path: Path) -> tuple[ProfileKind, dict[str, Any]]:
    try:
        document = load_json(path.read_text())
    except OSError as error:
        raise RecordError(f"cannot read the profile {path}: {error.strerror}") from None
    except (ValueError, RecursionError):  # JSONDecodeError and a repeated key are ValueErrors
        raise RecordError(f"{path}: not a valid JSON profile") from None
    if not isinstance(document, Mapping):
        raise RecordError(f"{path}: a profile must be a JSON object")
    kind_text = document.get("profile")
    try:
        kind = ProfileKind(kind_text)
    except ValueError:
        known = ", ".join(k.value for k in ProfileKind)
        raise RecordError(f"{path}: 'profile' must be one of {known}, got {kind_text!r}") from None
    fields = {k: v for k, v in document.items() if k != "profile"}
    unknown = sorted(fields.keys() - _PROFILE_FIELDS[kind])
    if unknown:
        raise RecordError(f"{path}: unknown field {unknown[0]!r} in a {kind.value!r} profile")
    return kind, fields


def profile_candidate(
    profile_path: str | Path,
    weights: ImportedWeights,
    *,
    name: str,
    data: DatasetSplits,
    attested_by: str,
    digest: str,
) -> tuple[ProfileKind, Candidate]:
    """The candidate the profile describes, named ``name``, on ``data``'s training rows."""
    path = Path(profile_path)
    kind, fields = _profile_document(path)
    common = {
        "name": name,
        "dataset": data.fingerprint,
        "attested_by": attested_by,
        "initialisation": fields.get("initialisation"),
    }
    if kind == ProfileKind.RDP:
        return kind, rdp_label(fields, **common)
    if kind == ProfileKind.EPSILON_DELTA:
        return kind, epsilon_delta_label(fields, **common)
    if kind == ProfileKind.OPACUS:
        if weights.checkpoint is None:
            raise RecordError(f"{path}: an 'opacus' profile needs an Opacus checkpoint's weights")
        sigma, rate, steps = opacus_phase(weights.checkpoint, str(path))
        fields = {**fields, "noise_multiplier": sigma, "sample_rate": rate, "steps": steps}
    record = {
        "noise_lineage": f"import:{digest}/noise",
        "batch_lineage": f"{UNKNOWN_BATCH_LINEAGE}{data.fingerprint}",
        **fields,
        **common,
        "dataset_size": data.dataset_size,
    }
    try:
        return kind, MechanismRecord.model_validate(record)
    except ValidationError as error:
        where = f"{kind.value} profile {path}"
        raise RecordError(describe_validation_error(where, error, MechanismRecord)) from None


def attestation_message(record: Candidate, digest: str) -> str:
    """What the attestation signs: the record (canonical JSON) and the weights' digest."""
    body = {"record": record.model_dump(mode="json", exclude_none=True), "weights": digest}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def importer_key(workspace: Workspace) -> WorkflowKey:
    """The workflow key, which only the workflow identity holds: an import is refused in an
    environment without it (an operator's or a consumer's shell)."""
    key = workspace.workflow_key()
    if key is None:
        raise AccessError(
            "only the workflow identity imports candidates: this environment has no workflow "
            "key (set $DPMERGE_SECRET_KEY_FILE as the workflow's environment does)"
        )
    return key


def import_candidate(
    weights_path: str | Path,
    profile_path: str | Path,
    *,
    spec: ModelSpec,
    data: DatasetSplits,
    name: str,
    attested_by: str,
    key: WorkflowKey,
    out_dir: str | Path,
    delta: float,
) -> ImportResult:
    """Check an import and write it as a candidate directory, attested and signed."""
    weights = read_weights(weights_path)
    check_weights(weights.tensors, spec, Path(weights_path))
    digest = weights_digest(weights.tensors)
    kind, record = profile_candidate(
        profile_path, weights, name=name, data=data, attested_by=attested_by, digest=digest
    )
    metadata = {
        ATTESTED_BY: attested_by,
        ATTESTATION: key.mac(KeyPurpose.IMPORT_ATTESTATION, attestation_message(record, digest)),
        KEY_ID: key.key_id,
        WEIGHTS_DIGEST: digest,
    }
    path = save_model_dir(
        out_dir,
        weights.tensors,
        spec,
        record=record,
        candidate_privacy=candidate_bound(record, delta).to_dict(),
        metrics={"imported": {"weights_format": weights.format.value, "profile": kind.value}},
        weights_metadata=metadata,
    )
    return ImportResult(path, record, weights.format, kind, digest, key.key_id)
