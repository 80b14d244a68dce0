"""``dpmerge study NAME``: the studies of docs/design.md#studies, one command each.

Every study writes a CSV, a Markdown table and PNG plots under ``--results`` (default
``results/<study>/``), keeps each finished unit there so a rerun skips it, shows a progress bar
on stderr, and logs one run to the MLflow experiment ``dpmerge-studies`` (tracking URI:
``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the embedded
``sqlite:///.dpmerge/mlflow.db``). Bad input prints one line and exits 2, before anything is
written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpmerge.cli.common import (
    float_list,
    fmt,
    positive_float,
    positive_int,
    print_json,
    probability,
)
from dpmerge.data.sources import check_source
from dpmerge.vocabulary import DatasetName, Tuning

EXIT_INTERRUPTED = 130
"""As a shell reports a command ended by SIGINT (128 + 2)."""
DEFAULT_THREADS = 1
"""One intra-op thread: on a shared 2-core CPU two can be 10× slower (docs/training.md)."""


def float_tuple(text: str) -> tuple[float, ...]:
    return tuple(float_list(text))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("study", help="run a study (docs/design.md#studies)")
    studies = parser.add_subparsers(dest="study", required=True)
    _mean_estimation(studies)
    _frontier(studies)
    _non_convex(studies)
    _pretrained(studies)
    _diamonds_table(studies)


def _interruptible(handler: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """Ctrl-C ends a study with one line (exit 130): finished units stay in the results
    folder, and the same command resumes from them."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except KeyboardInterrupt:
            where = args.results or Path("results") / args.study
            print(
                f"dpmerge: interrupted: finished units are kept in {where}; run the same command "
                "to resume",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED

    return run


def _common(parser: argparse.ArgumentParser, handler: Callable[[argparse.Namespace], int]) -> None:
    parser.add_argument("--results", type=Path, help="results folder (default results/<study>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (see the command's help)")
    parser.add_argument("--no-mlflow", action="store_true", help="write files only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(handler=_interruptible(handler))


def _training(parser: argparse.ArgumentParser, *, epochs: int, batch: int) -> None:
    parser.add_argument("--data-root", help="folder holding the dataset files")
    parser.add_argument("--limit", type=positive_int, help="use only the first rows of each file")
    parser.add_argument("--epochs", type=positive_int, default=epochs)
    parser.add_argument("--batch-size", type=positive_int, default=batch, help="expected batch")
    parser.add_argument("--learning-rate", type=positive_float, help="default: per model")
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ in (0, 1)")
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS)


def _mean_estimation(studies: argparse._SubParsersAction) -> None:
    mean = studies.add_parser(
        "mean-estimation",
        help="best RS and LC mean-squared error per target (docs/design.md#mean-estimation)",
        description=(
            "For each target ε, the best achievable RS and LC MSE per coordinate (units of the "
            "squared sensitivity, no clipping bias) under PLD (exact Gaussian profile) and RDP, "
            "null where infeasible; with --monte-carlo N, the MSE measured over N simulated "
            "releases; and for RS the exact ε of the released Gaussian mixture beside the "
            "mixture bound, with the best RS MSE under that exact accounting."
        ),
    )
    mean.add_argument("--sigmas", type=float_list, required=True, help="noise multipliers")
    mean.add_argument("--targets", type=float_list, required=True, help="target ε values")
    mean.add_argument("--delta", type=probability, required=True, help="δ in (0, 1)")
    mean.add_argument("--monte-carlo", type=positive_int, help="releases simulated per point")
    mean.add_argument("--seed", type=int, default=0, help="seed of the simulated releases")
    mean.add_argument(
        "--dimensions",
        type=lambda text: tuple(positive_int(v) for v in text.split(",")),
        default=(2, 10, 100),
        help="release dimensions d ≥ 2 for the lower bounds on RS's exact ε (default 2,10,100)",
    )
    _common(mean, run_mean_estimation)


def _frontier(studies: argparse._SubParsersAction) -> None:
    front = studies.add_parser(
        "frontier",
        help="convex frontier: RS and LC merges against retraining, over seeds",
        description=(
            "Logistic regression DP-SGD candidates (Fashion-MNIST; --quick: digits); at a grid "
            "of targets from the most to the least private candidate, RS (expected and drawn "
            "accuracy), LC under the generic gate, the mixture of two subset merges, the "
            "provable default (auto: one of those three, chosen from the records), LC under the "
            "structured gate, a retrain at the target and retrains matched to each merge's "
            "compute; ε under PLD and RDP; merge − retrain paired by seed with 95 % confidence "
            "intervals."
        ),
    )
    front.add_argument("--quick", action="store_true", help="digits, 5 candidates, 5 targets")
    front.add_argument("--dataset", help="dataset (default fashion-mnist; --quick: digits)")
    front.add_argument("--sigmas", type=float_tuple, help="candidates' noise multipliers")
    front.add_argument("--grid", type=positive_int, help="number of targets (default 8)")
    front.add_argument("--targets", type=float_tuple, help="explicit targets instead of a grid")
    front.add_argument("--seeds", type=positive_int, default=5)
    front.add_argument(
        "--seed-base",
        type=int,
        default=0,
        help="first seed (seeds seed-base … seed-base+seeds−1; another base: a held-out set)",
    )
    front.add_argument("--no-structured", action="store_true", help="skip LC (structured)")
    front.add_argument("--no-compute-matched", action="store_true", help="skip that retrain")
    front.add_argument(
        "--tune",
        choices=[t.value for t in Tuning],
        default=Tuning.NONE.value,
        help=(
            "private: compare auto with private tuning (the exponential mechanism on validation "
            "counts, ε = 1), paired by seed, without retrains (docs/design.md#private-tuning)"
        ),
    )
    front.add_argument(
        "--checkpoints",
        type=lambda text: tuple(positive_int(v) for v in text.split(",")),
        default=(),
        help=(
            "epochs kept as candidates, the last included (checkpoints of one run: an LC over "
            "them averages its iterates at the run's own ε); the retrain keeps the same and is "
            "also reported averaged"
        ),
    )
    _training(front, epochs=10, batch=256)
    front.set_defaults(batch_size=None)
    _common(front, run_frontier)


def _models(parser: argparse.ArgumentParser) -> None:
    """Options of the model studies (non-convex, pretrained)."""
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist, cifar10, …")
    parser.add_argument("--model", default="cnn", help="cnn or resnet18-gn")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--sigmas", type=float_tuple, default=(0.8, 1.2, 2.0))
    parser.add_argument("--grid", type=positive_int, default=4, help="number of targets")
    parser.add_argument("--targets", type=float_tuple, help="explicit targets instead of a grid")
    parser.add_argument("--seeds", type=positive_int, default=1)
    parser.add_argument("--no-structured", action="store_true", help="skip LC (structured)")


def _non_convex(studies: argparse._SubParsersAction) -> None:
    parser = studies.add_parser(
        "non-convex",
        help="CNN candidates from shared and independent initialisations: where LC degrades",
        description=(
            "GroupNorm CNN DP-SGD candidates (ResNet-18-GN with --model resnet18-gn --dataset "
            "cifar10 --data-root DIR --device cuda) from one shared and from independent "
            "initialisations; RS and LC merges at a grid of targets, a retrain at each target, "
            "and the accuracy along the weight path and of the equal-weight average."
        ),
    )
    _models(parser)
    parser.add_argument("--max-steps", type=positive_int, help="stop each run after these steps")
    parser.add_argument("--path-points", type=positive_int, default=11)
    parser.add_argument("--no-retrain", action="store_true", help="skip the retrains")
    _training(parser, epochs=2, batch=256)
    _common(parser, run_non_convex)


def _pretrained(studies: argparse._SubParsersAction) -> None:
    parser = studies.add_parser(
        "pretrained",
        help="DP fine-tuning from a public initialisation: does a merge beat every candidate?",
        description=(
            "Pre-trains the model without privacy on the first --public-rows training rows "
            "(declared public, removed from the private set), fine-tunes DP-SGD candidates "
            "from it, and compares RS and LC merges at a grid of targets with every candidate "
            "and with a retrain (DP fine-tuning at the target) from the same initialisation."
        ),
    )
    _models(parser)
    parser.add_argument("--public-rows", type=positive_int, default=6000)
    parser.add_argument("--pretrain-epochs", type=positive_int, default=3)
    parser.add_argument("--pretrain-learning-rate", type=positive_float, default=0.1)
    _training(parser, epochs=1, batch=256)
    _common(parser, run_pretrained)


def _diamonds_table(studies: argparse._SubParsersAction) -> None:
    parser = studies.add_parser(
        "diamonds-table",
        help="a second real dataset: plotnine's diamonds as a table and its spec",
        description=(
            "Writes diamonds.parquet and its spec diamonds.json under --out from the diamonds "
            "CSV the PyPI package plotnine ships (or --source CSV): label cut (five grades), "
            "features fixed row-wise transforms (docs/design.md#second-dataset-diamonds). "
            "Then: dpmerge study frontier --dataset table --data-root OUT/diamonds.json."
        ),
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write into")
    parser.add_argument("--source", type=Path, help="diamonds CSV (default: plotnine's copy)")
    parser.set_defaults(handler=run_diamonds_table)


def run_diamonds_table(args: argparse.Namespace) -> int:
    from dpmerge.studies.diamonds import prepare_diamonds

    prepared = prepare_diamonds(args.out, args.source)
    print(f"diamonds: {prepared.rows} rows in {prepared.table}; spec {prepared.spec}")
    return 0


def _tracking_uri(args: argparse.Namespace) -> str:
    if args.tracking_uri:
        return str(args.tracking_uri)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from dpmerge.workspace import embedded_tracking_uri

    return embedded_tracking_uri()


def _finish(args: argparse.Namespace, result: Any) -> int:
    """Log the study's run to MLflow (unless --no-mlflow) and print what was written."""
    document = result.to_dict()
    if not args.no_mlflow:
        from dpmerge.registry.studies import log_study

        uri = _tracking_uri(args)
        document["mlflow_run_id"] = log_study(
            uri, result.study, result.params, result.metrics, result.files
        )
        document["tracking_uri"] = uri
    if args.json:
        print_json(document)
        return 0
    print(
        f"{result.study}: {result.computed} units computed, {result.reused} reused; "
        f"wrote {', '.join(p.name for p in result.files)} in {result.folder}"
    )
    for key, value in result.summary.items():
        print(f"  {key}: {fmt(value) if isinstance(value, float) else value}")
    if "mlflow_run_id" in document:
        print(f"  MLflow run {document['mlflow_run_id']} ({document['tracking_uri']})")
    return 0


def _folder(args: argparse.Namespace, study: str) -> Any:
    from dpmerge.studies.output import StudyFolder
    from dpmerge.studies.settings import StudyConfigError

    root = args.results or Path("results") / study
    if root.exists() and not root.is_dir():
        raise StudyConfigError(f"--results {root} is a file, not a folder")
    return StudyFolder(root, progress=not args.no_progress)


def _threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)


def run_mean_estimation(args: argparse.Namespace) -> int:
    from dpmerge.studies.mean_estimation_study import (
        MeanEstimationStudy,
        run_mean_estimation_study,
    )

    study = MeanEstimationStudy(
        sigmas=tuple(args.sigmas),
        targets=tuple(args.targets),
        delta=args.delta,
        monte_carlo=args.monte_carlo,
        seed=args.seed,
        dimensions=args.dimensions,
    )
    return _finish(args, run_mean_estimation_study(study, _folder(args, "mean-estimation")))


def run_frontier(args: argparse.Namespace) -> int:
    if args.dataset or args.quick:  # before torch loads; --quick is digits
        check_source(args.dataset or DatasetName.DIGITS, args.data_root)
    from dpmerge.studies.convex import QUICK, FrontierStudy, run_frontier_study

    given = {
        "dataset": args.dataset,
        "sigmas": args.sigmas,
        "grid": args.grid,
        "targets": args.targets,
        "batch_size": args.batch_size,
    }
    settings: dict[str, Any] = dict(QUICK) if args.quick else {}
    settings.update({k: v for k, v in given.items() if v is not None})
    study = FrontierStudy(
        **settings,
        data_root=args.data_root,
        limit=args.limit,
        seeds=args.seeds,
        seed_base=args.seed_base,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        delta=args.delta,
        structured=not args.no_structured,
        compute_matched=not args.no_compute_matched,
        checkpoints=args.checkpoints,
    )
    _threads(args)
    if args.tune == Tuning.PRIVATE:
        from dpmerge.studies.tuning import STUDY, run_tuning_study

        return _finish(args, run_tuning_study(study, _folder(args, STUDY)))
    return _finish(args, run_frontier_study(study, _folder(args, "frontier")))


def _model_settings(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dataset=args.dataset,
        data_root=args.data_root,
        limit=args.limit,
        model=args.model,
        device=args.device,
        sigmas=args.sigmas,
        grid=args.grid,
        targets=args.targets,
        seeds=args.seeds,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        delta=args.delta,
        structured=not args.no_structured,
    )


def run_non_convex(args: argparse.Namespace) -> int:
    check_source(args.dataset, args.data_root)  # before torch loads
    from dpmerge.studies.nonconvex import NonConvexStudy, run_nonconvex_study

    study = NonConvexStudy(
        **_model_settings(args),
        max_steps=args.max_steps,
        retrain=not args.no_retrain,
        path_points=args.path_points,
    )
    _threads(args)
    return _finish(args, run_nonconvex_study(study, _folder(args, "non-convex")))


def run_pretrained(args: argparse.Namespace) -> int:
    check_source(args.dataset, args.data_root)  # before torch loads
    from dpmerge.studies.pretrained import PretrainedStudy, run_pretrained_study

    study = PretrainedStudy(
        **_model_settings(args),
        public_rows=args.public_rows,
        pretrain_epochs=args.pretrain_epochs,
        pretrain_learning_rate=args.pretrain_learning_rate,
    )
    _threads(args)
    return _finish(args, run_pretrained_study(study, _folder(args, "pretrained")))
