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
    rebuild.add_argument(
        "--home",
        default=None,
        help="use the embedded state in this directory (default: the registry every command "
        "finds: $MLFLOW_TRACKING_URI, the local stack, $DPMERGE_HOME or ./.dpmerge)",
    )
    rebuild.set_defaults(handler=_rebuild)


def _rebuild(args: argparse.Namespace) -> int:
    import dataclasses

    from dpmerge import policy_merge as pm
    from dpmerge.errors import InputError
    from dpmerge.locate import command, locate_registry

    located = locate_registry(home=args.home)  # never creates a registry to rebuild from
    print(located.describe())
    workspace = pm.Workspace.from_env(args.home)
    if located.stack is not None and workspace.s3 is None:
        raise InputError(
            "the local stack keeps its release ledger in its S3, which this shell does not "
            f'reach: run `eval "$({command("stack", "env")})"` first'
        )
    workspace = dataclasses.replace(workspace, tracking_uri=located.tracking_uri)
    added = pm.rebuild_ledger(workspace)
    print(f"release ledger: {len(added)} release(s) added back")
    return 0
