"""The options of ``dpmerge merge`` and ``dpmerge evaluate``
(:mod:`dpmerge.cli.models` does the work).

The options are declared and checked here without torch: a misspelt option, a dataset whose
files are absent, or a data option that does not apply (``--data-root`` for scikit-learn's
bundled digits, or without ``--dataset``) is refused in one line before torch loads
(docs/design.md#studies).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dpmerge.cli.common import float_list, positive_float, positive_int, probability
from dpmerge.data.sources import check_source
from dpmerge.errors import InputError
from dpmerge.vocabulary import DatasetName, Method, values

DATA_OPTIONS = {"data_root": "--data-root", "limit": "--limit"}
"""Options that only say how to load ``--dataset``."""


def _add_data_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--dataset", required=required, choices=values(DatasetName), help="dataset to evaluate on"
    )
    parser.add_argument(
        "--data-root",
        help="folder holding the dataset files (a dataset of your own: its spec file)",
    )
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
    merge.set_defaults(handler=_run("_merge"))

    score = subparsers.add_parser("evaluate", help="evaluate a model directory on a split")
    score.add_argument("model", metavar="DIR")
    score.add_argument("--split", choices=("test", "validation"), default="test")
    score.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    _add_data_options(score, required=True)
    score.set_defaults(handler=_run("_evaluate"))


def _check_data(args: argparse.Namespace) -> None:
    """Refuse data options that do not apply, and a dataset whose source is absent."""
    dataset = getattr(args, "dataset", None)
    if dataset is None:
        given = [flag for name, flag in DATA_OPTIONS.items() if getattr(args, name, None)]
        if given:
            raise InputError(f"{', '.join(given)} applies only with --dataset; give --dataset")
        return
    check_source(dataset, args.data_root)


def _run(name: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``name`` of :mod:`dpmerge.cli.models`, loaded after the checks."""

    def handle(args: argparse.Namespace) -> int:
        _check_data(args)
        from dpmerge.cli import models

        return int(getattr(models, name)(args))

    return handle
