"""Merging candidate model directories: random selection, linear combination and the
mixture of two LC merges (docs/design.md#random-selection, docs/design.md#generic-bound).

LC releases θ = Σ λ_i θ_i with λ on the simplex; RS releases θ_I for one secret draw I ~ π; the
mixture releases the LC merge of rung I for one secret draw I ~ (p, 1 − p). All read the
candidates' ``weights.safetensors`` one tensor piece at a time (every candidate's piece, then
the next piece), so memory stays near the output plus a few pieces, whatever the number of
inputs (:func:`linear_combinations`).

The arithmetic is exact where it can be tested: a weight of exactly 1 copies the candidate
bit-for-bit (so RS, run as a one-hot LC, releases θ_I unchanged), and the first contributing
candidate initialises the sum instead of being added to zero (which would turn -0.0 into +0.0).
Floats are accumulated in float32 (float64 for float64 tensors) on the chosen device and cast
back to the source dtype; λ is then used as a float32 number for float32 tensors.

RS and the mixture validate every candidate completely before drawing and read all of them
afterwards (the mixture computes both rungs), so neither an error nor the running time depends
on the drawn index. The index goes to the caller
(for an access-restricted audit record) and never into the released directory
(docs/design.md#random-selection).
The released weights file is written afresh with a random nonce in its metadata, so its bytes
(and an object store's ETag of them) never equal the drawn candidate's file
(docs/design.md#rs-secrecy).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.calibration import Calibration
from dpmerge.accounting.weights import simplex_weights
from dpmerge.artifacts import (
    WEIGHTS_FILE,
    ModelDir,
    ModelSpec,
    TensorInfo,
    file_label,
    load_model_dir,
    read_header,
    save_model_dir,
)
from dpmerge.errors import DifferentBasesError, FactoryMismatchError, RecordError
from dpmerge.models import check_weights_match
from dpmerge.vocabulary import GatingBound, Method, choose

Metrics = Callable[[ModelSpec, Mapping[str, torch.Tensor]], Mapping[str, Any]]

BATCHNORM_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
RELEASE_NONCE = "dpmerge.release_nonce"
"""Safetensors metadata key of a released file's random nonce (its bytes differ from every
candidate's, whatever the weights)."""
PIECE_BYTES = 16 * 2**20
"""About how many bytes of one candidate's tensor a merge reads at a time (whole rows)."""


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge_model_dirs` released. ``weights`` are π or λ (empty for a mixture,
    whose rungs are in ``report``). ``drawn_index`` (RS: the candidate; mixture: the rung) is
    for an internal, access-restricted audit record; it is left out of ``repr`` so it is not
    printed by accident."""

    path: Path
    method: Method
    weights: tuple[float, ...]
    report: PrivacyReport
    metrics: Mapping[str, Any]
    drawn_index: int | None = field(default=None, repr=False)


def check_same_structure(headers: Mapping[str, Mapping[str, TensorInfo]]) -> None:
    """Every file (keyed by a label) must hold the same tensor names, shapes and dtypes, with no
    BatchNorm statistics (running means/variances are computed from private data without noise
    and do not merge linearly; DP-SGD models use GroupNorm)."""
    if not headers:
        raise RecordError("no candidates to merge")
    (ref_label, ref), *others = headers.items()
    for label, header in headers.items():
        batchnorm = sorted(k for k in header if k.rsplit(".", 1)[-1] in BATCHNORM_SUFFIXES)
        if batchnorm:
            raise RecordError(
                f"{label}: tensor {batchnorm[0]!r} is a BatchNorm statistic; BatchNorm models "
                "are refused (running statistics see private data without noise and do not "
                "merge linearly) — use GroupNorm"
            )
    for label, header in others:
        missing, extra = sorted(ref.keys() - header.keys()), sorted(header.keys() - ref.keys())
        if missing or extra:
            problems = [f"missing key {missing[0]!r}"] if missing else []
            problems += [f"unexpected key {extra[0]!r}"] if extra else []
            raise RecordError(
                f"{label}: {'; '.join(problems)} (compared with {ref_label}; "
                f"{len(missing)} missing, {len(extra)} unexpected)"
            )
        for key, info in ref.items():
            other = header[key]
            if other.shape != info.shape:
                raise RecordError(
                    f"{label}: key {key!r} has shape {list(other.shape)}, "
                    f"expected {list(info.shape)} as in {ref_label}"
                )
            if other.dtype != info.dtype:
                raise RecordError(
                    f"{label}: key {key!r} has dtype {other.dtype}, "
                    f"expected {info.dtype} as in {ref_label}"
                )


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _is_finite(tensor: torch.Tensor) -> bool:
    # aminmax propagates NaN, and an inf is its own min or max: one fast read-only pass.
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def _pieces(info: TensorInfo) -> list[slice | None]:
    """The row ranges (first dimension) in which a tensor is read: about ``PIECE_BYTES`` each, at
    least one row; ``None`` reads a scalar or empty tensor whole."""
    if not info.shape or info.shape[0] == 0:
        return [None]
    row_bytes = math.prod(info.shape[1:]) * info.dtype.itemsize
    rows = max(1, PIECE_BYTES // max(row_bytes, 1))
    return [slice(start, start + rows) for start in range(0, info.shape[0], rows)]


def _read(path: Path, key: str, rows: slice | None) -> torch.Tensor:
    """Rows ``rows`` of tensor ``key``, through a handle opened for them alone. A handle maps
    the whole file, and every page read through it stays resident until it closes, so reading a
    candidate through one handle would hold all of it in memory; here only the returned piece's
    pages are read (and released with the tensor). ``get_tensor`` returns a view of the
    mapping, and slicing it reads nothing (the handle's ``get_slice`` was 10× slower)."""
    with safe_open(str(path), framework="pt") as handle:
        tensor = handle.get_tensor(key)  # a view of the mapping: nothing read yet
    return tensor if rows is None else tensor[rows]


def _non_finite_error(
    key: str, rows: slice | None, paths: Sequence[Path], weights: Sequence[float]
) -> RecordError:
    """Name the contributing candidate whose tensor ``key`` holds NaN or inf (slow path)."""
    for path, weight in zip(paths, weights, strict=True):
        if weight > 0:
            tensor = _read(path, key, rows)
            if not _is_finite(tensor.to(_accumulation_dtype(tensor.dtype))):
                return RecordError(f"{file_label(path)}: tensor {key!r} contains NaN or inf values")
    return RecordError(f"the merge overflowed in tensor {key!r} (values near the float limit)")


def linear_combination(
    files: Sequence[str | Path],
    weights: Sequence[float],
    *,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Σ λ_i θ_i over safetensors files, streamed (docs/design.md#generic-bound). Returns tensors
    on ``device``.

    ``weights`` must lie on the simplex (finite, non-negative, sum 1 within 1e-9); nothing is
    renormalised. Tensor names, shapes and dtypes must agree; NaN/inf values are refused in
    every candidate, even one with weight 0. Non-float tensors (integer, bool buffers) must be
    equal across candidates and are copied. See :func:`linear_combinations` for the streaming.
    """
    return linear_combinations(files, [weights], keep=0, device=device)


def linear_combinations(
    files: Sequence[str | Path],
    weight_sets: Sequence[Sequence[float]],
    *,
    keep: int,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """The LC merge of ``files`` for every weight vector in ``weight_sets``, of which only
    ``weight_sets[keep]``'s is returned (a mixture computes both rungs, so neither its errors
    nor its work depend on the draw; docs/design.md#rs-secrecy).

    Streamed piece by piece: for each tensor, in row ranges of about ``PIECE_BYTES``, each
    candidate's piece is read through a handle opened for it alone (:func:`_read`) and added
    into one float32 (float64 for float64 tensors) sum per weight vector, which is checked and
    cast into the output. Memory is the output plus a few pieces, whatever the number of
    candidates or weight vectors. Each element sees the same operations in the same order as
    summing whole models candidate by candidate, so the bits are those of that in-memory sum.

    Finiteness costs one pass over each sum, not one per candidate: a NaN or inf in a candidate
    with λ_i > 0 stays NaN or inf through every later addition, so the sum is checked once;
    candidates with λ_i = 0 are never summed and are checked on their own.
    """
    paths = [Path(f) for f in files]
    sets = [simplex_weights(w, len(paths), what="LC weights") for w in weight_sets]
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep < len(sets):
        raise RecordError(f"keep must be the index of one of {len(sets)} weight vectors")
    headers = {file_label(p): read_header(p) for p in paths}
    if len(headers) != len(paths):
        raise RecordError("the same candidate is given twice")
    check_same_structure(headers)
    device = torch.device(device)
    labels = list(headers)
    columns = list(zip(*sets, strict=True))  # one candidate's weights, one per vector
    scratch: dict[int, torch.Tensor] = {}  # a reused byte buffer per weight vector not kept
    merged: dict[str, torch.Tensor] = {}
    for key, info in next(iter(headers.values())).items():
        out = torch.empty(info.shape, dtype=info.dtype, device=device)
        for rows in _pieces(info):
            target = out if rows is None else out[rows]
            if not info.dtype.is_floating_point:
                _copy_equal(target, key, rows, paths, labels)
                continue
            dtype = _accumulation_dtype(info.dtype)
            sums = [
                target
                if index == keep and dtype == info.dtype
                else _scratch(scratch, index, target.shape, dtype, device)
                for index in range(len(sets))
            ]
            started: set[int] = set()
            for path, label, column in zip(paths, labels, columns, strict=True):
                value = _read(path, key, rows).to(device, dtype)
                if 0 in column and not _is_finite(value):
                    raise RecordError(f"{label}: tensor {key!r} contains NaN or inf values")
                for index, weight in enumerate(column):
                    if weight == 0:
                        continue
                    if index in started:
                        sums[index].add_(value, alpha=weight)
                    elif weight == 1:
                        sums[index].copy_(value)
                    else:
                        torch.mul(value, weight, out=sums[index])
                    started.add(index)
            for index, total in enumerate(sums):
                if not _is_finite(total):
                    raise _non_finite_error(key, rows, paths, sets[index])
            if sums[keep] is not target:
                target.copy_(sums[keep])
        merged[key] = out
    return merged


def _scratch(
    buffers: dict[int, torch.Tensor],
    index: int,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A ``shape``/``dtype`` view of buffer ``index``, grown to fit: sums reuse one buffer
    rather than allocate a tensor per piece (freed pieces fragment the heap)."""
    size = math.prod(shape) * dtype.itemsize
    if index not in buffers or buffers[index].numel() < size:
        buffers[index] = torch.empty(size, dtype=torch.uint8, device=device)
    return buffers[index][:size].view(dtype).view(shape)


def _copy_equal(
    target: torch.Tensor, key: str, rows: slice | None, paths: Sequence[Path], labels: list[str]
) -> None:
    """Copy a piece of a non-float tensor (integer, bool) into ``target``; every candidate's
    must be equal to the first's."""
    for position, (path, label) in enumerate(zip(paths, labels, strict=True)):
        tensor = _read(path, key, rows)
        if position == 0:
            target.copy_(tensor)
        elif not torch.equal(target, tensor.to(target.device)):
            raise RecordError(
                f"{label}: non-float tensor {key!r} differs from {labels[0]}; "
                "integer and bool buffers cannot be averaged and must be equal"
            )


def draw_index(probabilities: Sequence[float], *, rng: random.Random | None = None) -> int:
    """One draw I ~ π from the OS's cryptographic RNG (docs/design.md#random-selection).

    Each call is one release: drawing again and keeping a preferred outcome is a selection
    step that costs privacy. ``rng`` is a test hook (a seeded ``random.Random``).
    """
    pi = simplex_weights(probabilities, len(probabilities), what="RS probabilities")
    source = secrets.SystemRandom() if rng is None else rng
    return source.choices(range(len(pi)), weights=pi, k=1)[0]


def read_candidate_dir(path: str | Path) -> ModelDir:
    """A candidate directory (:func:`~dpmerge.artifacts.load_model_dir`, its weights left on
    disk), checked to hold a mechanism record and weights that match the architecture the
    record names (``dpmerge.models.check_weights_match``)."""
    loaded = load_model_dir(path, weights=False)
    if loaded.record is None:
        raise RecordError(
            f"{loaded.path}: a merged model, not a candidate; merge inputs must be candidate "
            "directories with a mechanism record"
        )
    meta = {
        k: torch.empty(i.shape, dtype=i.dtype, device="meta") for k, i in loaded.tensors.items()
    }
    try:
        check_weights_match(loaded.spec, meta)
    except RecordError as error:
        raise RecordError(f"{loaded.path}: weights do not match model.json ({error})") from None
    return loaded


def _check_inputs(dirs: Sequence[ModelDir]) -> None:
    if not dirs:
        raise RecordError("no candidates to merge")
    resolved = [d.path.resolve() for d in dirs]
    if len(set(resolved)) != len(resolved):
        raise RecordError("the same candidate directory is given twice")
    ref = dirs[0]
    for other in dirs[1:]:
        if other.spec.factory != ref.spec.factory:
            raise FactoryMismatchError(
                f"model factories differ: {other.path} is {_factory_text(other.spec)}, "
                f"{ref.path} is {_factory_text(ref.spec)}; candidates of one merge share one "
                "factory and source (docs/design.md#your-model)"
            )
        bases = [d.spec.fine_tune.base_digest if d.spec.fine_tune else None for d in (ref, other)]
        if bases[0] != bases[1]:
            raise DifferentBasesError(
                f"different base models: {other.path} is fine-tuned from {bases[1]}, "
                f"{ref.path} from {bases[0]} (docs/design.md#fine-tuning)"
            )
        if other.spec != ref.spec:
            raise RecordError(
                f"architectures differ: {other.path} is {other.spec.to_dict()}, "
                f"{ref.path} is {ref.spec.to_dict()}"
            )
    check_same_structure({str(d.path): d.tensors for d in dirs})


def _factory_text(spec: ModelSpec) -> str:
    factory = spec.factory
    if factory is None:
        return f"the built-in {spec.name}"
    fixed = ", fixed" if factory.fixed else ""
    return f"{factory.reference} (sha256 {factory.sha256[:12]}…{fixed})"


def _prepare_audit(audit_path: Path, out_dir: Path) -> Path:
    """Check the audit path lies outside the release and create a private (0600) temporary file
    next to it; the caller renames it into place once the release is written."""
    if audit_path.exists():
        raise RecordError(f"audit file already exists: {audit_path} (one record per release)")
    if audit_path.resolve().is_relative_to(out_dir.resolve()):
        raise RecordError(f"audit file {audit_path} must lie outside the released directory")
    if not audit_path.parent.is_dir():
        raise RecordError(f"audit directory not found: {audit_path.parent}")
    staging = audit_path.with_name(f".{audit_path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return staging


def merge_model_dirs(
    inputs: Sequence[str | Path],
    method: Method,
    weights: Sequence[float] | Calibration,
    out_dir: str | Path,
    *,
    delta: float,
    gating_bound: GatingBound = "generic",
    metrics: Metrics | None = None,
    audit_path: str | Path | None = None,
    audit_notes: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    rng: random.Random | None = None,
    draw: Callable[[Sequence[float]], int] | None = None,
) -> MergeResult:
    """Merge candidate directories by RS, LC or a mixture and write the release to ``out_dir``.

    ``weights`` are π (RS) or λ (LC), or a :class:`Calibration` for this method and δ (a
    mixture needs its calibration: two LC merges and their odds). The directory gets the merged
    weights, ``model.json``, a merge record (method, weights or the mixture's rungs, every
    candidate's record and source directory name), ``privacy.json`` (the PrivacyReport) and
    ``metrics.json`` (``metrics(spec, merged)`` if given). RS and the mixture draw once — an
    index into π, or into the rungs' odds — and ``audit_path`` receives it (mode 0600, outside
    ``out_dir``) with ``audit_notes``; ``rng`` is a test hook (see :func:`draw_index`).
    ``draw`` replaces the draw itself (given the probabilities, returns the index): a policy
    merge passes one that reuses the draw stored for its release
    (``dpmerge.policy_merge.draws``). A mixture computes both rungs' merges and keeps the drawn
    one, so neither an error nor the running time depends on the draw, and everything it
    writes but the weights is the same whichever rung was drawn
    (docs/design.md#rs-secrecy). On any error nothing is written.
    """
    method = choose(Method, method, "method")
    if method != Method.LC and gating_bound != "generic":
        raise RecordError(
            f"the gating bound applies to LC only ({method} is gated by its mixture bound)"
        )
    if audit_path is not None and method == Method.LC:
        raise RecordError("an audit file records a secret draw; LC has no secret to record")
    if method == Method.MIXTURE and not isinstance(weights, Calibration):
        raise RecordError(
            "a mixture release needs its calibration (two LC merges and their odds), not a "
            "weight vector"
        )
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise RecordError(f"output directory already exists: {out_dir}")
    dirs = [read_candidate_dir(p) for p in inputs]
    _check_inputs(dirs)
    candidates = [d.record for d in dirs if d.record is not None]  # all: read_candidate_dir
    calibrated: dict[str, Any] = {}
    if isinstance(weights, Calibration):
        report = weights.report
        if report.method != method or report.delta != delta:
            raise RecordError(
                f"the calibration is for {report.method} at δ = {report.delta}, "
                f"not {method} at δ = {delta}"
            )
        if report.names != tuple(c.name for c in candidates):
            raise RecordError("the calibration was computed for other candidates")
        calibrated = {
            "target_epsilon": weights.target_epsilon,
            "reachable_epsilon_range": list(weights.reachable_epsilon_range),
            "utility_kind": weights.utility_kind,
        }
    else:
        report = account(candidates, method, weights, delta, gating_bound=gating_bound)
    files = [d.weights_file for d in dirs]
    if method == Method.LC:
        choices = [report.weights]
    elif method == Method.RS:
        choices = [tuple(float(i == j) for j in range(len(files))) for i in range(len(files))]
    else:
        choices = [rung.weights for rung in report.rungs]
    odds = report.weights if method == Method.RS else [r.probability for r in report.rungs]
    staging = None if audit_path is None else _prepare_audit(Path(audit_path), out_dir)
    written = False
    try:
        drawn = None
        if method != Method.LC:
            drawn = draw(odds) if draw is not None else draw_index(odds, rng=rng)
        if method == Method.MIXTURE:  # both rungs, whichever was drawn
            merged = linear_combinations(files, choices, keep=drawn or 0, device=device)
        else:
            merged = linear_combination(files, choices[drawn or 0], device=device)
        spec = dirs[0].spec
        scores = dict(metrics(spec, merged)) if metrics is not None else {}
        record = {
            "method": str(method),
            "weights": None if method == Method.MIXTURE else list(report.weights),
            **({"rungs": report.to_dict()["rungs"]} if method == Method.MIXTURE else {}),
            "bound": report.gating.kind,
            "candidates": [
                {
                    "source": d.path.name,
                    "record": candidate.model_dump(mode="json", exclude_none=True),
                    **(
                        {"privacy": dict(d.candidate_privacy)}
                        if d.candidate_privacy is not None
                        else {}
                    ),
                }
                for d, candidate in zip(dirs, candidates, strict=True)
            ],
            **({"calibration": calibrated} if calibrated else {}),
        }
        save_model_dir(
            out_dir,
            merged,
            spec,
            merge=record,
            privacy=report.to_dict(),
            metrics=scores,
            weights_metadata={RELEASE_NONCE: secrets.token_hex(16)},
        )
        written = True
        if staging is not None and audit_path is not None:
            with (out_dir / WEIGHTS_FILE).open("rb") as released:
                digest = hashlib.file_digest(released, "sha256").hexdigest()
            audit = {
                "release": str(out_dir.resolve()),
                "weights_sha256": digest,
                "method": str(method),
                "candidates": [c.name for c in candidates],
                "probabilities": list(odds),
                "drawn_index": drawn,
                **_drawn(report, candidates, drawn),
                "drawn_at": datetime.now(UTC).isoformat(),
                "notes": dict(audit_notes or {}),
            }
            staging.write_text(json.dumps(audit, indent=2))
            os.link(staging, audit_path)  # fails rather than overwrite an existing record
            staging.unlink()
    except BaseException:
        if staging is not None:
            staging.unlink(missing_ok=True)
        if written:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return MergeResult(out_dir, method, report.weights, report, scores, drawn)


def _drawn(report: PrivacyReport, candidates: Sequence[Any], drawn: int | None) -> dict[str, Any]:
    """What the audit record names as drawn: a candidate (RS) or a rung's members (mixture)."""
    if drawn is None:
        return {}
    if report.method == Method.MIXTURE:
        return {"drawn_rung": list(report.rungs[drawn].members(report.names))}
    return {"drawn_candidate": candidates[drawn].name}
