"""``dpmerge ledger rebuild`` and ``dpmerge state restore``: the repairs of the release-state
store (docs/design.md#release-state).

* ``state restore`` — a dataset document (the ledger and the serving pointers) that no longer
  matches its signature or cannot be read is replaced by its newest earlier version that does
  (the state bucket is versioned; the embedded store keeps earlier versions too);
* ``ledger rebuild`` — a ledger that was rolled back or replaced gets back every release whose
  signed merged version MLflow holds (adding releases only raises the cumulative bound).

Both need the workflow's key (they sign what they write).
"""

from __future__ import annotations

import argparse

from dpmerge.locate import locate_registry

TRACKING_HELP = "MLflow tracking URI (default: found as every command finds it)"


def register(subparsers: argparse._SubParsersAction) -> None:
    ledger = subparsers.add_parser(
        "ledger",
        help="the release ledger: add back releases a rolled-back ledger lacks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = ledger.add_subparsers(dest="ledger_command", required=True)
    rebuild = actions.add_parser(
        "rebuild",
        help="count every signed merged version the ledger lacks",
        description="Add back every release whose signed merged version MLflow holds but the "
        "ledger lacks, its candidates read from their verified records.",
    )
    rebuild.set_defaults(handler=_rebuild)
    state = subparsers.add_parser(
        "state",
        help="the release-state store: restore a damaged document",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    state_actions = state.add_subparsers(dest="state_command", required=True)
    restore = state_actions.add_parser(
        "restore",
        help="replace damaged dataset documents by their newest signed version",
        description="Replace each dataset document that fails its signature (or cannot be "
        "read) by its newest earlier version that verifies; report what was done.",
    )
    restore.set_defaults(handler=_restore)
    for sub in (rebuild, restore):
        sub.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)


def _workspace(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from dpmerge.errors import InputError
    from dpmerge.workspace import Workspace

    located = locate_registry(args.tracking_uri)
    print(located.describe())
    workspace = Workspace.of_registry(located.tracking_uri)
    if workspace.workflow_key() is None:
        raise InputError(
            "this repair signs what it writes and needs the workflow's key (run it with the "
            "workflow role's environment)"
        )
    return workspace


def _rebuild(args: argparse.Namespace) -> int:
    from dpmerge import policy_merge as pm

    workspace = _workspace(args)
    added = pm.rebuild_ledger(workspace)
    print(
        f"release ledger: {len(added)} release(s) added back from {workspace.tracking_uri} "
        f"(state {workspace.state().where})"
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    from dpmerge.state.serving import dataset_key, datasets

    store = _workspace(args).state()
    unrestorable = 0
    for dataset in datasets(store):
        skipped = store.restore(dataset_key(dataset))
        if skipped is None:
            unrestorable += 1
            print(f"{dataset}: no earlier version verifies; nothing changed")
        elif skipped:
            print(f"{dataset}: restored the newest signed version ({skipped} newer one(s) dropped)")
        else:
            print(f"{dataset}: verifies; nothing to restore")
    print(f"state {store.where}")
    return 1 if unrestorable else 0
