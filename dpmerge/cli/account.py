"""``dpmerge account``: evaluate given weights, or calibrate to a target (SPEC §4–§6)."""

from __future__ import annotations

import argparse
import sys

from dpmerge.accounting.account import account
from dpmerge.accounting.bounds import PrivacyReport
from dpmerge.accounting.calibration import Calibration, calibrate, infeasible_document
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.accounting.records import load_candidates
from dpmerge.cli.common import float_list, fmt, positive_float, print_json
from dpmerge.errors import InfeasibleTargetError, RecordError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "account",
        help="privacy of a merge (given weights) or the best merge for a target ε",
        description=(
            "Evaluate RS/LC weights, or calibrate a merge to --target-epsilon. Every ε is "
            "derived from the candidates' mechanism records (or labels) by PLD and RDP "
            "accountants, add-or-remove-one adjacency."
        ),
    )
    parser.add_argument("--candidates", required=True, help="candidates JSON file")
    parser.add_argument("--method", required=True, choices=("rs", "lc"))
    goal = parser.add_mutually_exclusive_group(required=True)
    goal.add_argument("--weights", type=float_list, help="RS probabilities or LC weights")
    goal.add_argument("--target-epsilon", type=positive_float, help="calibrate to this ε")
    parser.add_argument("--delta", type=positive_float, required=True)
    parser.add_argument(
        "--bound",
        choices=("generic", "structured"),
        default="generic",
        help="LC bound that gates (default generic: SPEC §5.1; structured is the paper's, opt-in)",
    )
    parser.add_argument(
        "--utilities", type=float_list, help="RS: per-candidate validation accuracies"
    )
    parser.add_argument(
        "--segments",
        action="store_true",
        help="structured LC calibration: also map every feasible segment of the chosen path",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    candidates = load_candidates(args.candidates)
    if args.method == "rs" and args.bound == "structured":
        raise RecordError("--bound applies to LC only (RS is gated by the selection bound)")
    if args.utilities is not None and args.method != "rs":
        raise RecordError("--utilities applies to RS only")
    if args.weights is not None:
        report = account(candidates, args.method, args.weights, args.delta, gating_bound=args.bound)
        epsilons = [candidate_bound(c, args.delta).epsilon for c in candidates]
        document = report.to_dict()
        document.update(feasible=True, reachable_epsilon_range=[min(epsilons), max(epsilons)])
        _emit(args, document, report, None)
        return 0
    try:
        result = calibrate(
            candidates,
            args.method,
            args.target_epsilon,
            args.delta,
            gating_bound=args.bound,
            utilities=args.utilities,
            map_segments=args.segments,
        )
    except InfeasibleTargetError as error:
        if args.json:
            print_json(infeasible_document(error, args.method, args.bound))
        print(f"dpmerge: infeasible: {error}", file=sys.stderr)
        return 3
    _emit(args, result.to_dict(), result.report, result)
    return 0


def _emit(
    args: argparse.Namespace,
    document: dict,
    report: PrivacyReport,
    result: Calibration | None,
) -> None:
    if args.json:
        print_json(document)
        return
    names = ", ".join(f"{n}={w:.4f}" for n, w in zip(report.names, report.weights, strict=True))
    gating = report.gating
    print(f"method {report.method}, weights: {names}")
    print(
        f"{gating.kind} bound: ε = {fmt(gating.epsilon)} ({gating.accountant}) at δ = "
        f"{report.delta:g}; PLD {fmt(gating.epsilon_pld)}, RDP {fmt(gating.epsilon_rdp)}"
    )
    if report.method == "lc":
        generic, structured = report.generic, report.structured
        print(
            f"generic bound (composition): PLD {fmt(generic.epsilon_pld)}, "
            f"RDP {fmt(generic.epsilon_rdp)}"
        )
        if structured is not None and structured.available:
            print(
                f"structured bound (the paper's analysis): PLD {fmt(structured.epsilon_pld)}, "
                f"RDP {fmt(structured.epsilon_rdp)}"
            )
        elif structured is not None:
            print(f"structured bound: not applicable ({structured.reason})")
    for assumption in gating.assumptions:
        print(f"  assumes: {assumption}")
    if result is not None:
        low, high = result.reachable_epsilon_range
        print(
            f"target ε = {result.target_epsilon:g}: met with ε = {fmt(result.epsilon)}; "
            f"utility {fmt(result.utility)} ({result.utility_kind}); "
            f"reachable range [{low:.4f}, {high:.4f}]"
        )
