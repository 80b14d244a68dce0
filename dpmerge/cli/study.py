"""``dpmerge study``: reproduce the experiments of SPEC §8."""

from __future__ import annotations

import argparse

from dpmerge.cli.common import float_list, fmt, print_json, probability
from dpmerge.studies.mean_estimation import mean_estimation_study, rows_to_document


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("study", help="reproduce an experiment of SPEC §8")
    studies = parser.add_subparsers(dest="study", required=True)
    mean = studies.add_parser(
        "mean-estimation",
        help="best RS and LC mean-squared error per target (SPEC §5.3)",
        description=(
            "For each target ε, the best achievable RS and LC MSE per coordinate (units of the "
            "squared sensitivity, no clipping bias) under PLD (exact Gaussian profile) and RDP; "
            "null where infeasible."
        ),
    )
    mean.add_argument("--sigmas", type=float_list, required=True, help="noise multipliers")
    mean.add_argument("--targets", type=float_list, required=True, help="target ε values")
    mean.add_argument("--delta", type=probability, required=True, help="δ in (0, 1)")
    mean.add_argument("--json", action="store_true")
    mean.set_defaults(handler=run_mean_estimation)


def run_mean_estimation(args: argparse.Namespace) -> int:
    rows = mean_estimation_study(args.sigmas, args.targets, args.delta)
    if args.json:
        print_json(rows_to_document(rows, args.sigmas, args.delta))
        return 0
    print(f"mean estimation, σ = {args.sigmas}, δ = {args.delta:g} (MSE per coordinate / Δ²)")
    print(f"{'target ε':>9} {'LC (PLD)':>10} {'RS (PLD)':>10} {'LC (RDP)':>10} {'RS (RDP)':>10}")
    for r in rows:
        print(
            f"{r.target_epsilon:>9g} {fmt(r.lc_mse_pld):>10} {fmt(r.rs_mse_pld):>10} "
            f"{fmt(r.lc_mse_rdp):>10} {fmt(r.rs_mse_rdp):>10}"
        )
    return 0
