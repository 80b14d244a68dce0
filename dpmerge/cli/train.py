"""``dpmerge train``: train one DP-SGD candidate and write its model directory
(docs/design.md#mechanism-record).

Every check runs before training, so bad input writes nothing (the options and the dataset's
source are checked before torch loads: docs/design.md#studies); δ is checked against the
training rows n (refused at δ ≥ 1/n, a warning above 1/(10·n): docs/design.md#mechanism-record).
The output directory holds ``weights.safetensors``, ``model.json``, ``record.json`` (the
mechanism record and its ε under PLD and RDP at ``--delta``) and ``metrics.json``. The summary
on stdout gives σ, q, T, n and the dataset identifier the record names, the ε under PLD and RDP
at δ and the held-out accuracies (``--json``: the same as one JSON line). The command touches
no registry.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from dpmerge.cli.common import fmt
from dpmerge.data.sources import check_source
from dpmerge.formatting import epsilon_text
from dpmerge.training.config import (
    Parameter,
    RunOptions,
    TrainConfig,
    TrainingConfigError,
    declared_parameters,
)

DEFAULTS = {"progress": True}
"""Where the command's defaults differ from the declaration's: a bar on the terminal."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train one DP-SGD candidate (Poisson sampling, plain SGD)",
        description=__doc__,
    )
    parser.add_argument("--out", required=True, type=Path, help="new model directory")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    for declared in (*declared_parameters(TrainConfig), *declared_parameters(RunOptions)):
        _add_option(parser, declared, DEFAULTS.get(declared.name, declared.default))
    parser.set_defaults(handler=handler)


def _add_option(parser: argparse.ArgumentParser, declared: Parameter, default: Any) -> None:
    """The option of a declared parameter: its flag, type, choices, default and help."""
    if declared.kind is bool:
        flag = f"--no-{declared.name.replace('_', '-')}" if default else declared.flag
        action = "store_false" if default else "store_true"
        text = f"no {declared.help}" if default else declared.help
        parser.add_argument(flag, dest=declared.name, action=action, help=text)
        return
    parser.add_argument(
        declared.flag,
        dest=declared.name,
        type=str if declared.choices else declared.kind,
        choices=declared.choices,
        metavar=None if declared.choices else declared.flag[2:].replace("-", "_").upper(),
        required=default is MISSING,
        default=None if default is MISSING else default,
        help=declared.help,
    )


def _declared(args: argparse.Namespace, declaration: type) -> dict[str, Any]:
    return {p.name: getattr(args, p.name) for p in declared_parameters(declaration)}


def handler(args: argparse.Namespace) -> int:
    config = TrainConfig(**_declared(args, TrainConfig))
    options = RunOptions(**_declared(args, RunOptions))
    if args.out.exists():
        raise TrainingConfigError(f"output directory already exists: {args.out}")
    check_source(config.dataset, options.data_root)  # before torch loads
    import torch

    from dpmerge.accounting.candidate import candidate_bound
    from dpmerge.accounting.delta import check_delta_against
    from dpmerge.data import load_dataset
    from dpmerge.training.run import save_candidate, train_candidate

    torch.set_num_threads(options.torch_threads)
    data = load_dataset(config.dataset, options.data_root, limit=options.limit)
    delta_check = check_delta_against(config.delta, data.dataset_size)
    result = train_candidate(config, data)
    out = save_candidate(result, args.out, config.delta)
    privacy = candidate_bound(result.record, config.delta)
    summary = {
        "out": str(out),
        "name": result.record.name,
        "noise_multiplier": result.record.noise_multiplier,
        "sample_rate": result.record.sample_rate,
        "steps": result.record.steps,
        "dataset": result.record.dataset,
        "dataset_size": result.record.dataset_size,
        "delta": config.delta,
        "epsilon_pld": privacy.epsilon_pld,
        "epsilon_rdp": privacy.epsilon_rdp,
        "validation_accuracy": result.metrics["validation_accuracy"],
        "test_accuracy": result.metrics["test_accuracy"],
    }
    if delta_check.warning:  # after the work: a refusal stays the one line printed
        print(f"dpmerge: {delta_check.warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"trained {result.record.name} → {out}\n"
        f"  σ = {summary['noise_multiplier']:.4g}, q = {summary['sample_rate']:.4g}, "
        f"T = {summary['steps']} steps over n = {summary['dataset_size']:,} rows of "
        f"{summary['dataset']}\n"
        f"  ε = {epsilon_text(privacy.epsilon_pld)} (PLD), {epsilon_text(privacy.epsilon_rdp)} "
        f"(RDP) at δ = {config.delta:g}, add-or-remove-one\n"
        f"  validation accuracy {fmt(summary['validation_accuracy'])}, "
        f"test accuracy {fmt(summary['test_accuracy'])}"
    )
    return 0
