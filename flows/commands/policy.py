"""``dpmerge policy set|apply|ls|show|history``: policies as stored, versioned data
(docs/design.md#release-state).

``set`` changes only the fields it is given (the others keep their stored values; a new policy
needs its target). ``apply -f FILE`` is declarative: each policy of the file is the desired
state, and only the policies that differ from their stored version get a new version
(``--dry-run`` shows the differences and the release each would get). Either way every policy
is checked first — its fields, and its dataset and model against the ready candidates of the
registry it targets — and nothing is stored unless all pass (one line naming the field, exit 2).

Where a new version goes: on a stack (the release-state store in S3) the command writes a
request (``inbox/``; operators write requests, never state), the workflow's dispatcher records
it as the next version (or rejects it, naming the field) and turns it into a ``merge-on-policy``
run; the command waits until the run exists (and with ``--wait S`` until it ends). Embedded
(``$DPMERGE_HOME`` or ./.dpmerge), the run happens in this process. Every answer names the
registry and the state store it used.

Exit codes (``--wait``, or in-process): 0 promoted or unchanged (or stored and dispatched, or a
dry run that would promote); 2 bad input or a rejected/refused run; 3 infeasible; 4 not promoted;
5 superseded; 1 anything else (an outage, no run in time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dpmerge.cli.common import positive_float
from dpmerge.errors import OutageError, is_transient
from dpmerge.locate import Located, command, locate_registry
from dpmerge.policies import (
    Policy,
    PolicyError,
    check_delta_known,
    check_fields,
    check_registered,
    load_policies,
)
from dpmerge.state import StateStore, inbox
from dpmerge.state import policies as stored_policies
from dpmerge.state.policies import PolicyVersion
from dpmerge.vocabulary import ExitCode
from flows.commands.policy_options import add_policy_options, given_fields, new_policy_defaults

EXIT_CODES = {
    "promoted": ExitCode.OK,
    "unchanged": ExitCode.OK,
    "stored": ExitCode.OK,
    "would_promote": ExitCode.OK,
    "would_be_unchanged": ExitCode.OK,
    "rejected": ExitCode.REFUSED,
    "refused": ExitCode.REFUSED,
    "infeasible": ExitCode.INFEASIBLE,
    "not_promoted": ExitCode.NOT_PROMOTED,
    "would_not_promote": ExitCode.NOT_PROMOTED,
    "superseded": ExitCode.SUPERSEDED,
}
"""Exit code per outcome (``status``, or a dry run's ``verdict``); anything else is a failure
(the same table as every command's: :mod:`dpmerge.exits`)."""
DISPATCH_WAIT_S = 60.0
POLL_S = 0.5
T = TypeVar("T")


class DispatchError(OutageError):
    """The workflow did not turn a stored policy version into a run in time."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "policy",
        help="set, apply and inspect privacy policies (stored, versioned)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="policy_command", required=True)
    set_ = actions.add_parser(
        "set",
        help="change one policy: the fields given (others keep their stored values)",
        description="Store a new version of one policy with the fields given changed, then "
        "apply it (a run on the stack, or in this process).",
    )
    add_policy_options(set_)
    set_.add_argument(
        "--rerun",
        action="store_true",
        help="store a new version even if nothing changed (the workflow applies it again)",
    )
    apply = actions.add_parser(
        "apply",
        help="make the stored policies match a YAML file (only what changed is applied)",
        description="Declarative: each policy of the file is the desired state; every policy "
        "is checked first (one bad policy changes nothing), then each one that differs from "
        "its stored version gets a new version and is applied.",
    )
    apply.add_argument("-f", "--file", dest="file", type=Path, required=True, help="YAML file")
    for sub in (set_, apply):
        sub.add_argument(
            "--dry-run",
            action="store_true",
            help="show the change and the release it would get; store and change nothing",
        )
        sub.add_argument(
            "--wait",
            type=positive_float,
            default=None,
            metavar="SECONDS",
            help="on a stack: wait up to SECONDS for each run to end and report its outcome",
        )
    ls = actions.add_parser("ls", help="every stored policy: its version, target and alias")
    show = actions.add_parser("show", help="one policy: its current version and what it serves")
    show.add_argument("name", help="policy name")
    history = actions.add_parser(
        "history", help="every version of a policy: who, when, what changed, how it ended"
    )
    history.add_argument("name", help="policy name")
    for sub in (set_, apply, ls, show, history):
        sub.add_argument(
            "--home",
            default=None,
            help="embedded state directory (default $DPMERGE_HOME or ./.dpmerge)",
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(handler=handle)


# --- where ------------------------------------------------------------------------------


class Place:
    """The registry and state store a command works on (named in every answer)."""

    def __init__(self, args: argparse.Namespace, *, write: bool) -> None:
        from dpmerge.workspace import Workspace
        from flows import runtime

        if args.home is None and runtime.adopt_running_stack() is not None:
            print(
                "dpmerge: using the running local stack; "
                f'eval "$({command("stack", "env", "--role", "operator")})" points this shell '
                "at it",
                file=sys.stderr,
            )
        self.located: Located = locate_registry(home=args.home, create=write)
        self.workspace = Workspace.from_env(args.home)
        if self.workspace.s3 is None:  # embedded: the run happens here, on this registry
            runtime.configure_embedded(args.home, force=args.home is not None)
            self.workspace = Workspace(self.located.tracking_uri, self.workspace.home, None)
        self.store: StateStore = self.workspace.state()

    @property
    def stack(self) -> bool:
        """Runs happen on the stack's workers (else in this process)."""
        return self.workspace.s3 is not None

    def describe(self) -> dict[str, Any]:
        """What every JSON answer carries: the registry and the state store it used."""
        return {"registry": self.located.to_dict(), "state": self.store.where}

    def line(self) -> str:
        return f"{self.located.describe()}; state {self.store.where}"


def _print(document: dict[str, Any], line: str, as_json: bool) -> None:
    print(json.dumps(document, default=str, ensure_ascii=False) if as_json else line)


def _exit_code(key: Any) -> int:
    return EXIT_CODES.get(str(key), ExitCode.FAILURE)


def handle(args: argparse.Namespace) -> int:
    command_name = args.policy_command
    if command_name in ("ls", "show", "history"):
        from flows.commands import policy_views

        place = Place(args, write=False)
        return policy_views.show(command_name, args, place.store, place.describe())
    desired = _desired(args)  # every policy validated before anything happens
    place = Place(args, write=not args.dry_run)
    _check(desired, place)
    if args.dry_run:
        return _dry_runs(desired, place, args)
    rerun = getattr(args, "rerun", False)
    changes = [_store(place, change, rerun) for change in desired]
    codes = [_applied(change, place, args) for change in changes]
    return max(codes) if codes else 0


@dataclass(frozen=True)
class Desired:
    """A change of one policy: its name, the fields given, and where it came from."""

    name: str
    fields: dict[str, Any]
    source: str


def _desired(args: argparse.Namespace) -> list[Desired]:
    """What each policy should become; a file is validated as a whole before anything else."""
    if args.policy_command == "set":
        fields = given_fields(args)
        check_fields(fields)
        return [Desired(fields["name"], fields, "dpmerge policy set")]
    source = f"dpmerge policy apply -f {args.file}"
    return [Desired(p.name, p.event_payload(), source) for p in load_policies(args.file)]


def _store(place: Place, change: Desired, rerun: bool) -> stored_policies.Change:
    """Store the new version: embedded, here; on a stack, as a request the workflow's
    dispatcher records (operators write requests, never state: dpmerge.state.inbox)."""
    fields = _target(place, change)[1].event_payload()
    if not place.stack:
        return stored_policies.set_policy(
            place.store, change.name, fields, source=change.source, rerun=rerun
        )
    key = inbox.submit_policy(place.store, change.name, fields, source=change.source, rerun=rerun)
    handled = inbox.wait(place.store, key)
    if handled.get("status") not in ("applied", "unchanged"):
        rejected = handled.get("rejected") or {}
        raise PolicyError(
            f"policy {change.name}: the workflow rejected request {key}: field "
            f"{rejected.get('field')!r}: {rejected.get('reason')}",
            rejected.get("field"),
        )
    version = stored_policies.read_version(place.store, change.name, handled["version"])
    if version is None:
        raise PolicyError(f"policy {change.name}: version {handled['version']} is not stored")
    return stored_policies.Change(version, written=handled["status"] == "applied")


def _target(place: Place, change: Desired) -> tuple[PolicyVersion | None, Policy]:
    """The stored version of the policy and what ``change`` makes of it (validated: a new
    policy needs its target, the command's dataset and model defaults fill the rest)."""
    current = stored_policies.latest(place.store, change.name)
    if current is None and not {"target_epsilon", "target_delta"} <= set(change.fields):
        raise PolicyError(
            f"policy {change.name!r} is new: give --target-epsilon and --delta (a new policy "
            "has no stored values to keep)"
        )
    given = change.fields if current is not None else {**new_policy_defaults(), **change.fields}
    return current, stored_policies.merged(current, given)


def _check(desired: list[Desired], place: Place) -> None:
    """Each policy, merged with its stored version, against the ready candidates of the
    registry (nothing is stored if one fails)."""
    from dpmerge.registry.catalog import open_catalog

    merged = [_target(place, change)[1] for change in desired]
    inventory = open_catalog(place.located.tracking_uri).inventory()
    if not inventory.counts:
        train = (
            command("deployment", "run", "train-candidates/train-candidates", tool="prefect")
            if place.stack
            else command("demo")
        )
        raise PolicyError(
            f"no ready candidates at {place.located.tracking_uri} ({place.located.source}); "
            f"train some first: {train}"
        )
    check_registered(merged, inventory)
    check_delta_known(merged, inventory)


# --- dry runs -----------------------------------------------------------------------------


def _dry_runs(desired: list[Desired], place: Place, args: argparse.Namespace) -> int:
    from dpmerge import policy_merge as pm

    place.workspace.use_caches()
    codes = []
    for change in desired:
        current, target = _target(place, change)
        changes = stored_policies.changed_fields(current.policy if current else None, target)
        number = (current.version if current else 0) + 1
        version = PolicyVersion(target, number, "", stored_policies.actor(), change.source, changes)
        if current is not None and not changes and not getattr(args, "rerun", False):
            document = {"policy": change.name, "verdict": "unchanged", "version": current.version}
            line = f"policy {change.name} (dry run): no change to v{current.version}"
            _print({**document, **place.describe()}, line, args.json)
            codes.append(0)
            continue
        result = pm.dry_run(version, place.workspace)
        document = {**result.to_dict(), "changes": changes, **place.describe()}
        line = f"{_diff_line(change.name, current, changes)}\n{result.summary()}"
        _print(document, line, args.json)
        codes.append(_exit_code(result.verdict.value))
    print(place.line(), file=sys.stderr)
    return max(codes)


def _diff_line(name: str, current: PolicyVersion | None, changes: dict[str, list[Any]]) -> str:
    if current is None:
        return f"policy {name}: new"
    shown = ", ".join(f"{k}: {old!r} → {new!r}" for k, (old, new) in sorted(changes.items()))
    return f"policy {name} v{current.version}: {shown or 'no change'}"


# --- applying -----------------------------------------------------------------------------


def _applied(change: stored_policies.Change, place: Place, args: argparse.Namespace) -> int:
    version = change.version
    if not change.written:
        document = {"policy": version.name, "version": version.version, "status": "unchanged"}
        line = (
            f"policy {version.name}: no change (v{version.version} is current); nothing to "
            "apply (--rerun applies it again)"
        )
        _print({**document, **place.describe()}, line, args.json)
        return 0
    if not place.stack:
        document = run_policy(version)
        _print(
            {**document, **place.describe()}, f"{outcome_line(document)}\n{place.line()}", args.json
        )
        return _exit_code(document.get("status"))
    run = wait_for_dispatch(place.store, version)
    if args.wait is None:
        document = {
            "policy": version.name,
            "version": version.version,
            "status": "stored",
            "flow_run": run.get("flow_run"),
            "changes": version.changes,
        }
        line = (
            f"policy {version.name} v{version.version} stored "
            f"({', '.join(sorted(version.changes)) or 'rerun'}); run {run.get('flow_run_name')} "
            f"({run.get('flow_run')}) created; {place.line()}"
        )
        _print({**document, **place.describe()}, line, args.json)
        return 0
    outcome = wait_for_outcome(place.store, version, args.wait)
    if outcome is None:
        document = {"policy": version.name, "version": version.version, "status": "timeout"}
        line = (
            f"policy {version.name} v{version.version}: run {run.get('flow_run')} did not end "
            f"within {args.wait:g} s"
        )
        _print({**document, **place.describe()}, line, args.json)
        return 1
    _print({**outcome, **place.describe()}, f"{outcome_line(outcome)}\n{place.line()}", args.json)
    return _exit_code(outcome.get("status"))


def wait_for_dispatch(
    store: StateStore, version: PolicyVersion, timeout_s: float = DISPATCH_WAIT_S
) -> dict[str, Any]:
    """The flow run the workflow created for ``version``; :class:`DispatchError` after
    ``timeout_s`` (the version stays stored: the dispatcher picks it up once it runs)."""
    found = _poll(
        lambda: stored_policies.dispatched(store, version.name, version.version), timeout_s
    )
    if found is not None:
        return found
    raise DispatchError(
        f"policy {version.name} v{version.version} is stored, but no run was created for it "
        f"within {timeout_s:g} s: is the workflow's dispatcher running? "
        f"(`{command('stack', 'status')}`)"
    )


def wait_for_outcome(
    store: StateStore, version: PolicyVersion, timeout_s: float
) -> dict[str, Any] | None:
    """The newest recorded outcome of ``version`` within ``timeout_s``, else ``None``."""
    found = _poll(lambda: stored_policies.outcomes(store, version.name, version.version), timeout_s)
    return found[-1] if found else None


def _poll(read: Callable[[], T | None], timeout_s: float) -> T | None:
    """``read()`` every :data:`POLL_S` until it finds something or ``timeout_s`` has passed.

    A transient outage (S3 or MLflow restarting: :func:`~dpmerge.errors.is_transient`) is
    waited out, as the workflow's runs wait it out (docs/design.md#workflow); only one that
    lasts until the deadline is raised (exit 1, naming it). Any other error is raised at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        outage: BaseException | None = None
        try:
            found = read()
        except Exception as error:
            if not is_transient(error):
                raise
            outage = error
        else:
            if found:
                return found
        if time.monotonic() >= deadline:
            if outage is not None:
                raise outage
            return None
        time.sleep(POLL_S)


def outcome_line(outcome: dict[str, Any]) -> str:
    status = outcome.get("status")
    if status in ("rejected", "refused") or "alias" not in outcome:
        number = f" v{outcome.get('policy_version')}" if outcome.get("policy_version") else ""
        reasons = "; ".join(outcome.get("reasons", []))
        return f"policy {outcome.get('policy')}{number}: {status} — {reasons}"
    from dpmerge.policy_merge import PolicyOutcome

    return PolicyOutcome.from_dict(outcome).summary()


def run_policy(version: PolicyVersion) -> dict[str, Any]:
    """Apply stored ``version`` in this process and return its outcome document (an expected
    outcome, or ``rejected``/``refused``); a run that failed for another reason raises its
    error (a bug's traceback is the news)."""
    from flows.merge import merge_on_policy, run_name

    flow = merge_on_policy.with_options(flow_run_name=run_name(version))
    state = flow(version.name, version.version, return_state=True)
    document = state.result(raise_on_failure=False)
    if isinstance(document, dict):
        return document
    if isinstance(document, BaseException):
        raise document
    raise RuntimeError(f"policy {version.name}: run ended {state.name}: {state.message}")
