"""``dpmerge merge``, ``dpmerge evaluate`` and ``dpmerge candidates``: model directories.

``merge`` releases an RS, LC or mixture merge of candidate directories, with given weights or
calibrated to a target ε (docs/design.md); ``evaluate`` scores a model directory on a dataset
split; ``candidates`` turns candidate directories into the candidates file ``dpmerge account``
reads. Calibration reads the records only; validation accuracy tunes LC weights within a subset
only with ``--tune-weights``. The drawn index (RS, mixture) is never printed: it goes only to
``--audit-file`` (mode 0600).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dpmerge.accounting.calibration import Calibration, calibrate
from dpmerge.accounting.delta import delta_check_for
from dpmerge.accounting.records import candidates_from_dicts, candidates_to_document
from dpmerge.artifacts import ModelDir, ModelSpec, load_model_dir
from dpmerge.cli.common import (
    float_list,
    fmt,
    positive_float,
    positive_int,
    print_json,
    probability,
)
from dpmerge.data import DATASET_NAMES, DatasetSplits, Split, load_dataset
from dpmerge.errors import DatasetError, InputError
from dpmerge.evaluation import MergeAccuracy, evaluate, expected_accuracy
from dpmerge.formatting import epsilon_text
from dpmerge.merging import Metrics, merge_model_dirs, read_candidate_dir
from dpmerge.vocabulary import Method, values


def _add_data_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--dataset", required=required, choices=DATASET_NAMES, help="dataset to evaluate on"
    )
    parser.add_argument("--data-root", help="folder holding the dataset files")
    parser.add_argument("--limit", type=int, help="rows kept per file (as in training)")
    parser.add_argument("--batch-size", type=int, default=1024, help="evaluation batch size")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")


def register(subparsers: argparse._SubParsersAction) -> None:
    merge = subparsers.add_parser(
        "merge",
        help="release an RS, LC or mixture merge of candidate directories",
        description="Merge candidate model directories by random selection (rs), linear "
        "combination (lc), with given weights or calibrated to --target-epsilon, or by a "
        "secret draw between two LC merges of subsets (mixture, calibrated only). RS and "
        "mixture odds and every subset come from the records' noise proxy; LC weights within "
        "a subset are inverse-variance unless --tune-weights (docs/design.md#calibration).",
    )
    merge.add_argument("--inputs", nargs="+", required=True, metavar="DIR")
    merge.add_argument("--method", choices=values(Method), required=True)
    chosen = merge.add_mutually_exclusive_group(required=True)
    chosen.add_argument(
        "--weights", type=float_list, help="π (rs) or λ (lc), comma-separated, summing to 1"
    )
    chosen.add_argument(
        "--target-epsilon", type=positive_float, help="calibrate the weights to this ε"
    )
    merge.add_argument(
        "--delta",
        type=probability,
        default=1e-5,
        help="δ of the reported ε (default 1e-5; refused at 1/n or more for the n training rows)",
    )
    merge.add_argument(
        "--dataset-size",
        type=positive_int,
        help=(
            "n, the training rows δ is checked against where no record carries dataset_size "
            "(required then: a merge is not released on an unchecked δ)"
        ),
    )
    merge.add_argument(
        "--bound",
        choices=("generic", "structured"),
        default="generic",
        help=(
            "LC bound that gates (default generic: docs/design.md#generic-bound; structured is "
            "the paper's, opt-in)"
        ),
    )
    merge.add_argument(
        "--tune-weights",
        action="store_true",
        help=(
            "lc and mixture, generic gate: tune the weights within each chosen subset on the "
            "validation split of --dataset (opt-in; every weighting of a subset has its bound)"
        ),
    )
    merge.add_argument("--out", required=True, metavar="DIR", help="new model directory")
    merge.add_argument(
        "--audit-file", metavar="PATH", help="rs, mixture: private record of the draw"
    )
    merge.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    _add_data_options(merge, required=False)
    merge.set_defaults(handler=_merge)

    score = subparsers.add_parser("evaluate", help="evaluate a model directory on a split")
    score.add_argument("model", metavar="DIR")
    score.add_argument("--split", choices=("test", "validation"), default="test")
    score.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    _add_data_options(score, required=True)
    score.set_defaults(handler=_evaluate)

    listing = subparsers.add_parser(
        "candidates", help="print the candidates file of candidate directories"
    )
    listing.add_argument("dirs", nargs="+", metavar="DIR")
    listing.set_defaults(handler=_candidates)


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


def _candidates(args: argparse.Namespace) -> int:
    candidates = [read_candidate_dir(p).record for p in args.dirs]
    document = candidates_to_document(candidates)
    candidates_from_dicts(document["candidates"])  # names must be unique, as the reader demands
    print_json(document)
    return 0
