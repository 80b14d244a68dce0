"""``dpmerge merge`` and ``dpmerge evaluate``: model directories.

``merge`` releases an RS, LC or mixture merge of candidate directories, with given weights or
calibrated to a target ε (docs/design.md); ``evaluate`` scores a model directory on a dataset
split (``dpmerge candidates list`` writes the candidates file ``dpmerge account`` reads).
Calibration reads the records only; validation accuracy tunes LC weights within a subset
only with ``--tune-weights``. The drawn index (RS, mixture) is never printed: it goes only to
``--audit-file`` (mode 0600).

This module does the work and imports torch; the options are declared in
:mod:`dpmerge.cli.model_options`, which checks them (and the dataset's source) first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.delta import delta_check_for
from dpmerge.artifacts import ModelDir, ModelSpec, load_model_dir
from dpmerge.cli.common import fmt, print_json
from dpmerge.data import DatasetSplits, Split, load_dataset
from dpmerge.errors import DatasetError, InputError
from dpmerge.evaluation import MergeAccuracy, evaluate, expected_accuracy
from dpmerge.formatting import epsilon_text
from dpmerge.merging import Metrics, merge_model_dirs, read_candidate_dir
from dpmerge.vocabulary import Method


def _load_data(args: argparse.Namespace) -> DatasetSplits:
    return load_dataset(args.dataset, args.data_root, limit=args.limit)


def _require_trained_on(datasets: set[str], data: DatasetSplits) -> None:
    """The validation split is disjoint from the training rows only if the data is loaded the
    way training loaded it: the record's dataset fingerprint must match
    (docs/design.md#mechanism-record, docs/design.md#random-selection)."""
    if datasets != {data.fingerprint}:
        raise DatasetError(
            f"the models were trained on {', '.join(sorted(datasets))}, but the loaded training "
            f"rows are {data.fingerprint}; load the data as training did (same files and "
            "--limit) so that the validation split is disjoint from the training rows"
        )


def _trained_on(model: ModelDir) -> set[str]:
    if model.record is not None:
        return {model.record.dataset}
    return {c["record"]["dataset"] for c in (model.merge or {}).get("candidates", [])}


def _scorer(args: argparse.Namespace, split: Split) -> Metrics:
    """Evaluation of a (spec, weights) pair on ``split`` with the CLI's batch size and device."""

    def score(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return evaluate((spec, weights), split, batch_size=args.batch_size, device=args.device)

    return score


def _test_metrics(dataset: str, score: Metrics) -> Metrics:
    """The released model's public metrics: its own test-split evaluation."""

    def metrics(spec: ModelSpec, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return {"dataset": dataset, "test": dict(score(spec, weights))}

    return metrics


def _accuracies(dirs: Sequence[ModelDir], score: Metrics) -> list[float]:
    """Each candidate's accuracy, loading one candidate at a time."""
    return [score(d.spec, load_model_dir(d.path).weights)["accuracy"] for d in dirs]


def _calibrate(
    args: argparse.Namespace, dirs: Sequence[ModelDir], data: DatasetSplits | None
) -> Calibration:
    """Calibrate to ``--target-epsilon`` on the records alone; with ``--tune-weights``, the
    weights within each chosen subset are tuned on validation accuracy."""
    candidates = [d.record for d in dirs if d.record is not None]  # all: read_candidate_dir
    merge_utility = None
    if args.tune_weights:
        if data is None:
            raise InputError("--tune-weights needs --dataset (its validation split)")
        _require_trained_on({c.dataset for c in candidates}, data)
        merges = MergeAccuracy(
            dirs[0].spec,
            [d.weights_file for d in dirs],
            batch_size=args.batch_size,
            device=args.device,
        )

        def merge_utility(weights: tuple[float, ...]) -> float:
            return merges.accuracy(weights, data.validation)

    return calibrate(
        candidates,
        args.method,
        args.target_epsilon,
        args.delta,
        gating_bound=args.bound,
        merge_utility=merge_utility,
    )


def _merge(args: argparse.Namespace) -> int:
    if args.tune_weights and (args.method == Method.RS or args.target_epsilon is None):
        raise InputError(
            "--tune-weights tunes the LC weights of a calibration: give --method lc or mixture "
            "and --target-epsilon"
        )
    if args.method == Method.MIXTURE and args.target_epsilon is None:
        raise InputError("--method mixture is calibrated: give --target-epsilon, not --weights")
    dirs = [read_candidate_dir(p) for p in args.inputs]
    delta_check = delta_check_for(
        [d.record for d in dirs], args.delta, args.dataset_size, required=True
    )
    data = _load_data(args) if args.dataset else None
    calibration = _calibrate(args, dirs, data) if args.target_epsilon is not None else None
    metrics: Metrics | None = None
    audit_notes: dict[str, Any] | None = None
    if data is not None:
        score = _scorer(args, data.test)
        metrics = _test_metrics(data.name, score)
        if args.method == Method.RS and args.audit_file:
            # Statistics of every candidate, released or not: audit record only
            # (docs/design.md#random-selection).
            accuracies = _accuracies(dirs, score)
            weights = calibration.weights if calibration else args.weights
            audit_notes = {
                "candidate_test_accuracies": accuracies,
                "expected_test_accuracy": expected_accuracy(accuracies, weights),
            }
    result = merge_model_dirs(
        args.inputs,
        args.method,
        calibration or args.weights,
        args.out,
        delta=args.delta,
        gating_bound=args.bound,
        metrics=metrics,
        audit_path=args.audit_file,
        audit_notes=audit_notes,
        device=args.device,
    )
    if delta_check.warning:  # after the work: a refusal stays the one line printed
        print(f"dpmerge: {delta_check.warning}", file=sys.stderr)
    if args.json:
        document = {
            "path": str(result.path),
            "method": result.method,
            "weights": None if result.method == Method.MIXTURE else list(result.weights),
            "privacy": result.report.to_dict(),
            "metrics": dict(result.metrics),
            "calibration": calibration.to_dict() if calibration else None,
        }
        print_json(document)
        return 0
    report = result.report
    print(
        f"released {result.method.upper()} merge of {len(report.names)} candidates: {result.path}"
    )
    if result.method == Method.MIXTURE:
        for rung in report.rungs:
            names = ", ".join(
                f"{n}={w:g}" for n, w in zip(report.names, rung.weights, strict=True) if w > 0
            )
            print(f"  with probability {rung.probability:.4f}: λ: {names}")
    else:
        names = ", ".join(f"{n}={w:g}" for n, w in zip(report.names, result.weights, strict=True))
        print(f"  {'π' if result.method == Method.RS else 'λ'}: {names}")
    print(
        f"  ε = {epsilon_text(report.epsilon)} ({report.gating.accountant}, "
        f"{report.gating.kind} bound) "
        f"at δ = {report.delta:g}"
    )
    if calibration is not None:
        print(
            f"  calibrated to target ε = {calibration.target_epsilon:g} "
            f"(utility: {calibration.utility_kind})"
        )
    for note in report.notes:  # what the card says beside ε: a warning is not left in a file
        print(f"  {note}")
    if result.method != Method.LC:
        where = f"recorded in {args.audit_file}" if args.audit_file else "not recorded"
        drawn = "candidate" if result.method == Method.RS else "merge"
        print(f"  drawn {drawn}: secret ({where})")
    if "test" in result.metrics:
        test = result.metrics["test"]
        print(
            f"  test accuracy {fmt(test['accuracy'])}, loss {fmt(test['loss'])} (n = {test['n']})"
        )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    model = load_model_dir(args.model)
    data = _load_data(args)
    if args.split == "validation":
        _require_trained_on(_trained_on(model), data)
    split = getattr(data, args.split)
    scores = evaluate(
        (model.spec, model.weights), split, batch_size=args.batch_size, device=args.device
    )
    if args.json:
        document = {"model": str(model.path), "dataset": data.name, "split": args.split}
        print_json({**document, **scores})
    else:
        print(
            f"{model.path}: accuracy {fmt(scores['accuracy'])}, loss {fmt(scores['loss'])} "
            f"on {data.name}/{args.split} (n = {scores['n']})"
        )
    return 0
