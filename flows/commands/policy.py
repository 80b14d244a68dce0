"""``dpmerge policy set|apply``: validate policies, check them against the registry they
target, then emit ``dpmerge.policy.updated`` to the Prefect server or, with none, run
``merge-on-policy`` in this process; ``--dry-run`` reports the release a policy would get and
changes nothing.

Where: ``--home`` chooses the embedded state; else ``$PREFECT_API_URL`` (a server; the registry
from ``$MLFLOW_TRACKING_URI``); else ``$MLFLOW_TRACKING_URI`` (in-process against it); else a
running local stack (its ``stack.json``: events go to its Prefect); else the embedded state
(``$DPMERGE_HOME`` or ./.dpmerge).

Every policy is checked before anything is sent or run: its fields (types, ranges, choices),
and its dataset and model family against the ready candidates of the registry (one line naming
the field and the choices, exit 2).

Exit codes, the same in-process and with a server (``--wait``): 0 promoted or unchanged (or
event sent, without ``--wait``; a dry run that would promote); 2 bad input or a rejected event;
3 infeasible target; 4 not promoted (a gate failed); 5 superseded by a later event of the same
policy; 1 anything else (a failed run, no run in time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from dpmerge.cli.common import positive_float
from dpmerge.locate import Located, command, locate_registry
from dpmerge.policies import Policy, PolicyError, check_registered, load_policies, policy_from_dict
from flows.commands.policy_options import add_policy_options, policy_fields

EXIT_CODES = {
    "promoted": 0,
    "unchanged": 0,
    "would_promote": 0,
    "would_be_unchanged": 0,
    "rejected": 2,
    "infeasible": 3,
    "not_promoted": 4,
    "would_not_promote": 4,
    "superseded": 5,
}
"""Exit code per outcome (``status``, or a dry run's ``verdict``); anything else is 1."""


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
    add_policy_options(set_)
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
            "--dry-run",
            action="store_true",
            help="calibrate and report the release it would get; change nothing",
        )
        sub.add_argument(
            "--wait",
            type=positive_float,
            default=None,
            metavar="SECONDS",
            help="server mode: wait up to SECONDS for each triggered run and report its outcome",
        )
        sub.add_argument(
            "--home",
            default=None,
            help="embedded state directory (default $DPMERGE_HOME or ./.dpmerge)",
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=handle)


def _policies(args: argparse.Namespace) -> tuple[Policy, ...]:
    if args.policy_command == "apply":
        return load_policies(args.file)
    return (policy_from_dict(policy_fields(args)),)


def handle(args: argparse.Namespace) -> int:
    policies = _policies(args)  # every policy validated before anything happens
    from flows import runtime

    if args.home is None and runtime.adopt_running_stack() is not None:
        print(
            "dpmerge: using the running local stack; "
            f'eval "$({command("stack", "env")})" points this shell at it',
            file=sys.stderr,
        )
    server = None if args.home is not None else runtime.server_url()
    located = locate_registry(home=args.home)  # before the embedded defaults enter the env
    if server is None:
        if args.home is None:  # an in-process run uses the registry that was checked
            os.environ.setdefault("MLFLOW_TRACKING_URI", located.tracking_uri)
        runtime.configure_embedded(args.home, force=args.home is not None)
    _check(policies, located, server is not None)
    if args.dry_run:
        return _dry_runs(policies, args)
    if server is not None:
        return _emit(policies, args)
    return _run_in_process(policies, args)


def _check(policies: tuple[Policy, ...], located: Located, server: bool) -> None:
    """Each policy's dataset and model against the ready candidates at ``located``."""
    from dpmerge.registry.catalog import open_catalog

    inventory = open_catalog(located.tracking_uri).inventory()
    if not inventory.counts:
        deployment = "train-candidates/train-candidates"
        train = (
            command("deployment", "run", deployment, "--watch", tool="prefect")
            if server
            else command("demo")
        )
        raise PolicyError(
            f"no ready candidates at {located.tracking_uri} ({located.source}); train some "
            f"first: {train}"
        )
    check_registered(policies, inventory)


def _exit_code(key: str | None) -> int:
    return EXIT_CODES.get(str(key), 1)


def _print(document: dict[str, Any], line: str, as_json: bool) -> None:
    print(json.dumps(document, default=str) if as_json else line)


def _dry_runs(policies: tuple[Policy, ...], args: argparse.Namespace) -> int:
    from dpmerge import policy_merge as pm

    workspace = pm.Workspace.from_env(args.home)
    workspace.use_caches()
    codes = []
    for policy in policies:
        result = pm.dry_run(policy, workspace)
        _print(result.to_dict(), result.summary(), args.json)
        codes.append(_exit_code(result.verdict.value))
    return max(codes)


def _emit(policies: tuple[Policy, ...], args: argparse.Namespace) -> int:
    from flows import runtime
    from flows.merge import STATUS_OF_STATE

    codes = []
    for policy in policies:
        event_id = runtime.emit_policy_event(
            policy.event_payload(), policy.resource_id, policy.name
        )
        if not args.wait:
            document = {"policy": policy.name, "event": event_id, "sent": True}
            line = f"policy {policy.name}: event {runtime.EVENT} sent ({event_id})"
            _print(document, line, args.json)
            codes.append(0)
            continue
        run = runtime.wait_for_policy_run(event_id, args.wait)
        outcome = run.outcome or {}
        document = {**outcome, "event": event_id, "flow_run": run.id, "state": run.state}
        line = (
            outcome_line(outcome)
            if outcome
            else (
                f"policy {policy.name}: run {run.id or '-'} {run.state or 'not created'}"
                f"{f' — {run.message}' if run.message else ''}"
            )
        )
        _print(document, line, args.json)
        codes.append(_exit_code(outcome.get("status") or STATUS_OF_STATE.get(str(run.state))))
    return max(codes)


def outcome_line(outcome: dict[str, Any]) -> str:
    if outcome.get("status") == "rejected":
        return f"policy {outcome.get('policy')}: rejected — {'; '.join(outcome['reasons'])}"
    from dpmerge.policy_merge import PolicyOutcome

    return PolicyOutcome.from_dict(outcome).summary()


def _run_in_process(policies: tuple[Policy, ...], args: argparse.Namespace) -> int:
    codes = []
    for policy in policies:
        document = run_policy(policy)
        _print(document, outcome_line(document), args.json)
        codes.append(_exit_code(document.get("status")))
    return max(codes)


def run_policy(policy: Policy) -> dict[str, Any]:
    """Apply ``policy`` in this process and return its outcome document (an expected outcome,
    or ``rejected``); a run that failed for another reason raises its error (a bug's traceback
    is the news)."""
    from flows.merge import merge_on_policy

    state = merge_on_policy(policy.event_payload(), return_state=True)
    document = state.result(raise_on_failure=False)
    if isinstance(document, dict):
        return document
    if isinstance(document, BaseException):
        raise document
    raise RuntimeError(f"policy {policy.name}: run ended {state.name}: {state.message}")
