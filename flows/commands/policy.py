"""``dpmerge policy set|apply``: validate a policy, then emit ``dpmerge.policy.updated`` to the
configured Prefect server (``PREFECT_API_URL``) or, with none, run ``merge-on-policy`` in this
process (embedded: Prefect's temporary API, MLflow on ``.dpmerge/mlflow.db``).

Exit codes: 0 applied (promoted, unchanged or superseded) or event sent; 2 bad input or a
registered version that failed a gate (not promoted); 3 infeasible target (alias revoked or
kept per ``on_infeasible``); 1 a waited-for server run that did not complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dpmerge.cli.common import positive_float
from dpmerge.policies import Policy, load_policies, policy_from_dict

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def default_dataset() -> str:
    """Fashion-MNIST where its Debian package is installed, else scikit-learn's digits."""
    return "fashion-mnist" if FASHION_MNIST_DIR.is_dir() else "digits"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "policy",
        help="set or apply privacy policies (event to Prefect, or an in-process merge)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="policy_command", required=True)
    set_ = actions.add_parser(
        "set",
        help="set one policy from flags",
        description="Validate one policy and apply it (event or in-process merge).",
    )
    set_.add_argument("--name", required=True, help="policy name (alias policy-<name>)")
    set_.add_argument("--target-epsilon", required=True, type=float, help="ε*")
    set_.add_argument("--delta", "--target-delta", dest="target_delta", required=True, type=float)
    set_.add_argument(
        "--dataset",
        default=None,
        help="dataset name or fingerprint (default: fashion-mnist if installed, else digits)",
    )
    set_.add_argument("--model", default="logreg")
    set_.add_argument("--method", default="auto", help="auto (default), rs or lc")
    set_.add_argument("--gating-bound", default="generic", help="generic (default) or structured")
    set_.add_argument("--min-accuracy", type=float, default=0.0, help="accuracy floor (test)")
    set_.add_argument("--alias", default=None, help="registry alias (default policy-<name>)")
    set_.add_argument("--on-infeasible", default="revoke", help="revoke (default) or keep")
    set_.add_argument(
        "--cumulative-epsilon-cap", type=float, default=None, help="release-ledger cap (SPEC §7)"
    )
    apply = actions.add_parser(
        "apply",
        help="apply every policy of a YAML file (all validated first)",
        description=(
            "Validate every policy in the file first (one bad policy rejects the whole file and "
            "changes nothing), then apply them in order."
        ),
    )
    apply.add_argument("file", type=Path, help="YAML file with a 'policies' list")
    for sub in (set_, apply):
        sub.add_argument(
            "--wait",
            type=positive_float,
            default=None,
            metavar="SECONDS",
            help="server mode: wait up to SECONDS for each triggered run to finish",
        )
        sub.add_argument(
            "--home",
            default=None,
            help="embedded mode: state directory (default $DPMERGE_HOME or ./.dpmerge)",
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=handle)


def _policies(args: argparse.Namespace) -> tuple[Policy, ...]:
    if args.policy_command == "apply":
        return load_policies(args.file)
    return (
        policy_from_dict(
            {
                "name": args.name,
                "target_epsilon": args.target_epsilon,
                "target_delta": args.target_delta,
                "dataset": args.dataset or default_dataset(),
                "model": args.model,
                "method": args.method,
                "gating_bound": args.gating_bound,
                "min_accuracy": args.min_accuracy,
                "alias": args.alias,
                "on_infeasible": args.on_infeasible,
                "cumulative_epsilon_cap": args.cumulative_epsilon_cap,
            }
        ),
    )


def handle(args: argparse.Namespace) -> int:
    policies = _policies(args)  # every policy validated before anything happens
    from flows import runtime

    if runtime.server_url():
        return _emit(policies, args)
    runtime.configure_embedded(args.home)
    return _run_in_process(policies, args)


def _emit(policies: tuple[Policy, ...], args: argparse.Namespace) -> int:
    from flows import runtime

    code = 0
    for policy in policies:
        event_id = runtime.emit_policy_event(
            policy.event_payload(), policy.resource_id, policy.name
        )
        line: dict[str, Any] = {"policy": policy.name, "event": event_id, "sent": True}
        if args.wait:
            run = runtime.wait_for_policy_run(event_id, args.wait)
            state = run.state if run is not None else None
            line.update(
                flow_run=str(run.id) if run else None,
                state=state.name if state else None,
                message=state.message if state else "no run created in time",
            )
            if state is None or not state.is_completed():
                code = 1
        if args.json:
            print(json.dumps(line))
        else:
            text = f"policy {policy.name}: event {runtime.EVENT} sent ({event_id})"
            if args.wait:
                text += f"; run {line['flow_run']}: {line['state']}"
                if line["state"] != "Completed" and line["message"]:
                    text += f" — {line['message']}"
            print(text)
    return code


def _run_in_process(policies: tuple[Policy, ...], args: argparse.Namespace) -> int:
    from dpmerge import policy_merge as pm
    from flows.merge import merge_on_policy

    failures: list[Exception] = []
    for policy in policies:
        state = merge_on_policy(**policy.event_payload(), return_state=True)
        if state.is_completed():
            print_outcome(state.result(), as_json=args.json)
            continue
        error = state.result(raise_on_failure=False)
        if not isinstance(error, Exception):
            error = RuntimeError(f"policy {policy.name}: run ended {state.name}: {state.message}")
        outcome = getattr(error, "outcome", None)
        if outcome:
            print_outcome(outcome, as_json=args.json)
        failures.append(error)
    if not failures:
        return 0
    infeasible = [e for e in failures if isinstance(e, pm.PolicyInfeasibleError)]
    for error in failures[:-1]:
        print(f"dpmerge: error: {error}", file=sys.stderr)
    raise (infeasible or failures)[-1]


def print_outcome(outcome: dict[str, Any], *, as_json: bool = False, card: bool = False) -> None:
    if as_json:
        print(json.dumps(outcome, default=str))
        return
    status = outcome["status"]
    head = f"policy {outcome['policy']}: {status}"
    if outcome.get("version"):
        head += (
            f" — {outcome['merged_model']} v{outcome['version']}"
            f"{' (reused)' if outcome.get('reused') else ''} by {str(outcome['method']).upper()}, "
            f"ε = {outcome['epsilon']:.4f} ({outcome['accountant']}, {outcome['bound']} bound, "
            f"δ = {outcome['target_delta']:g}) ≤ ε* = {outcome['target_epsilon']:g}"
        )
        if outcome.get("test_accuracy") is not None:
            head += f", test accuracy {outcome['test_accuracy']:.4f}"
    print(head)
    if status in ("promoted", "unchanged"):
        print(
            f"  alias {outcome['alias']!r} -> v{outcome['version']}"
            + (
                f" (was v{outcome['previous_version']})"
                if outcome.get("previous_version") not in (None, outcome["version"])
                else ""
            )
        )
    if outcome.get("cumulative_epsilon") is not None:
        print(f"  release ledger: cumulative ε = {outcome['cumulative_epsilon']:.4f}")
    for reason in outcome.get("reasons") or []:
        print(f"  - {reason}")
