"""``dpmerge account``: evaluate given weights, or calibrate to a target
(docs/design.md#random-selection, docs/design.md#generic-bound, docs/design.md#calibration).
The accountants load after the options parsed: a misspelt option is refused at once."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from dpmerge.cli.common import float_list, positive_float, positive_int, print_json, probability
from dpmerge.errors import InfeasibleTargetError, InputError
from dpmerge.formatting import epsilon_text, number_text
from dpmerge.vocabulary import BoundKind, GatingBound, Method

if TYPE_CHECKING:  # the accountants (dp_accounting, scipy) load once the options have parsed
    from dpmerge.accounting.bounds import PrivacyReport
    from dpmerge.accounting.calibrated import Calibration
    from dpmerge.accounting.delta import DeltaCheck


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "account",
        help="privacy of a merge (given weights) or the best merge for a target ε",
        description=(
            "Evaluate RS/LC weights, or calibrate an RS, LC or mixture merge to "
            "--target-epsilon. Every ε is "
            "derived from the candidates' mechanism records (or labels) by PLD and RDP "
            "accountants, add-or-remove-one adjacency (docs/design.md)."
        ),
    )
    parser.add_argument("--candidates", required=True, help="candidates JSON file")
    parser.add_argument(
        "--method",
        required=True,
        choices=[m.value for m in Method],
        help=(
            "rs, lc, or mixture (a secret draw between two LC merges of subsets; calibrated to "
            "--target-epsilon only). RS and mixture odds come from the records' noise proxy, "
            "never from accuracies (docs/design.md#calibration)"
        ),
    )
    goal = parser.add_mutually_exclusive_group(required=True)
    goal.add_argument("--weights", type=float_list, help="RS probabilities or LC weights")
    goal.add_argument("--target-epsilon", type=positive_float, help="calibrate to this ε")
    parser.add_argument(
        "--delta",
        type=probability,
        required=True,
        help="δ in (0, 1); refused at 1/n or more for the n training rows",
    )
    parser.add_argument(
        "--dataset-size",
        type=positive_int,
        help=(
            "n, the number of training rows δ is checked against where no record carries "
            "dataset_size (with records that do, δ must pass both)"
        ),
    )
    parser.add_argument(
        "--bound",
        choices=[b.value for b in GatingBound],
        default=GatingBound.GENERIC.value,
        help=(
            "LC bound that gates (default generic: docs/design.md#generic-bound; structured "
            "is the DP model merging paper's analysis, opt-in)"
        ),
    )
    parser.add_argument(
        "--segments",
        action="store_true",
        help="structured LC calibration: also map every feasible segment of the chosen path",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from dpmerge.accounting.account import account, check_candidates
    from dpmerge.accounting.bounds import finite_or_none
    from dpmerge.accounting.calibrated import infeasible_document
    from dpmerge.accounting.calibration import calibrate
    from dpmerge.accounting.candidate import candidate_bound
    from dpmerge.accounting.delta import delta_check_for
    from dpmerge.accounting.generic_search import reachable_range
    from dpmerge.accounting.records import load_candidates

    candidates = load_candidates(args.candidates)
    check_candidates(candidates)
    delta_check = delta_check_for(candidates, args.delta, args.dataset_size)  # δ ≥ 1/n: refused
    if args.method != Method.LC and args.bound == GatingBound.STRUCTURED:
        raise InputError(
            f"--bound applies to LC only ({args.method} is gated by its mixture bound)"
        )
    structured_calibration = (
        args.method == Method.LC
        and args.bound == GatingBound.STRUCTURED
        and args.target_epsilon is not None
    )
    if args.segments and not structured_calibration:
        raise InputError(
            "--segments maps the chosen path of a structured LC calibration: give --method lc "
            "--bound structured --target-epsilon"
        )
    if args.method == Method.MIXTURE and args.weights is not None:
        raise InputError(
            "--method mixture is calibrated to --target-epsilon: its two LC merges and their "
            "odds are not one weight vector"
        )
    if args.weights is not None:
        report = account(candidates, args.method, args.weights, args.delta, gating_bound=args.bound)
        epsilons = [candidate_bound(c, args.delta).epsilon for c in candidates]
        low, high = reachable_range(candidates, args.method, args.delta, epsilons)
        document = report.to_dict()
        document.update(
            feasible=report.gating.available,
            reachable_epsilon_range=[finite_or_none(low), finite_or_none(high)],
        )
        _emit(args, document, report, None, delta_check)
        return 0
    try:
        result = calibrate(
            candidates,
            args.method,
            args.target_epsilon,
            args.delta,
            gating_bound=args.bound,
            map_segments=args.segments,
        )
    except InfeasibleTargetError as error:
        if args.json:
            print_json(infeasible_document(error, args.method, args.bound))
        print(f"dpmerge: infeasible: {error}", file=sys.stderr)
        return 3
    _emit(args, result.to_dict(), result.report, result, delta_check)
    return 0


def _bound_line(title: str, pld: float | None, rdp: float | None) -> str:
    return f"{title}: PLD {epsilon_text(pld)}, RDP {epsilon_text(rdp)}"


def _emit(
    args: argparse.Namespace,
    document: dict[str, Any],
    report: PrivacyReport,
    result: Calibration | None,
    delta_check: DeltaCheck,
) -> None:
    if delta_check.warning:
        print(f"dpmerge: {delta_check.warning}", file=sys.stderr)
    if args.json:
        print_json({**document, "delta_check": delta_check.to_dict()})
        return
    gating = report.gating
    if report.method == Method.MIXTURE:
        print(f"method mixture: a secret draw between {len(report.rungs)} LC merge(s)")
        for rung in report.rungs:
            names = ", ".join(
                f"{n}={w:.4f}" for n, w in zip(report.names, rung.weights, strict=True) if w > 0
            )
            print(
                f"  with probability {rung.probability:.4f}: {names} (generic bound: "
                + _bound_line("", rung.bound.epsilon_pld, rung.bound.epsilon_rdp).removeprefix(": ")
                + ")"
            )
    else:
        names = ", ".join(f"{n}={w:.4f}" for n, w in zip(report.names, report.weights, strict=True))
        print(f"method {report.method}, weights: {names}")
    if gating.available:
        print(
            f"{gating.kind} bound (gates): ε = {epsilon_text(gating.epsilon)} "
            f"({gating.accountant}) at δ = {report.delta:g}; "
            + _bound_line("", gating.epsilon_pld, gating.epsilon_rdp).removeprefix(": ")
        )
    else:
        print(f"{gating.kind} bound (gates): unavailable at δ = {report.delta:g} ({gating.reason})")
    generic, structured = report.generic, report.structured
    if generic is not None and gating.kind != BoundKind.GENERIC:
        print(
            _bound_line("generic bound (release units)", generic.epsilon_pld, generic.epsilon_rdp)
        )
    if structured is not None and gating.kind != BoundKind.STRUCTURED:
        if structured.available:
            print(
                _bound_line(
                    "structured bound (the paper's analysis)",
                    structured.epsilon_pld,
                    structured.epsilon_rdp,
                )
            )
        else:
            print(f"structured bound: not applicable ({structured.reason})")
    for assumption in gating.assumptions:
        print(f"  assumes: {assumption}")
    for note in report.notes:
        print(f"  note: {note}")
    if delta_check.note:
        print(f"  note: {delta_check.note}")
    if result is not None:
        low, high = result.reachable_epsilon_range
        print(
            f"target ε = {result.target_epsilon:g}: met with ε = {epsilon_text(result.epsilon)}; "
            f"utility {number_text(result.utility)} ({result.utility_kind}); "
            f"reachable range [{epsilon_text(low)}, {epsilon_text(high)}]"
        )
