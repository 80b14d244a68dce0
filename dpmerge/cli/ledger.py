"""``dpmerge ledger rebuild``: the release ledger rebuilt from the registry
(docs/design.md#release-ledger) — the repair for a ledger that was lost or cannot be read."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ledger",
        help="the release ledger: rebuild it from the registry",
        description="The release ledger (S3 with a stack configured, else <home>/ledger.json).",
    )
    actions = parser.add_subparsers(dest="ledger_command", required=True)
    rebuild = actions.add_parser(
        "rebuild",
        help="add every release the registry marks as counted (dp.released) back to the ledger",
        description=(
            "Rebuild the release ledger from the registry: every merged version tagged "
            "dp.released becomes an entry again, its candidates read from their verified "
            "records. Entries of a readable ledger are kept; an unreadable one is replaced."
        ),
    )
    rebuild.add_argument("--home", default=None, help="state directory (default $DPMERGE_HOME)")
    rebuild.set_defaults(handler=_rebuild)


def _rebuild(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dpmerge import policy_merge as pm
    from dpmerge.errors import InputError

    workspace = pm.Workspace.from_env(args.home)
    database = workspace.tracking_uri.removeprefix("sqlite:///")
    if workspace.tracking_uri.startswith("sqlite:///") and not Path(database).is_file():
        raise InputError(f"no registry at {workspace.tracking_uri}: nothing to rebuild from")
    added = pm.rebuild_ledger(workspace)
    print(f"release ledger: {len(added)} release(s) added back from {workspace.tracking_uri}")
    return 0
