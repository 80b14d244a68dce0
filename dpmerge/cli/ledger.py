"""``dpmerge ledger show``, ``dpmerge ledger rebuild`` and ``dpmerge state restore``: the
release ledger now, and the repairs of the release-state store (docs/design.md#release-state).

* ``ledger show`` — each data source's cumulative bound (every subset) as of now (a card's
  ledger line is the bound as of the time it states; later releases raise it). Reads only;
  the documents' signatures are checked where the workflow's key is at hand, and the output
  says when not;
* ``state restore`` — a dataset document (the ledger and the serving pointers) that no longer
  matches its signature or cannot be read is replaced by its newest earlier version that does
  (the state bucket is versioned; the embedded store keeps earlier versions too);
* ``ledger rebuild`` — a ledger that was rolled back or replaced gets back every release whose
  signed merged version MLflow holds (adding releases only raises the cumulative bound).

The repairs need the workflow's key (they sign what they write).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from dpmerge.cli.common import print_json, probability
from dpmerge.formatting import epsilon_text
from dpmerge.locate import locate_registry

TRACKING_HELP = "MLflow tracking URI (default: found as every command finds it)"


def register(subparsers: argparse._SubParsersAction) -> None:
    ledger = subparsers.add_parser(
        "ledger",
        help="the release ledger: its bound now, or add back releases a rollback lost",
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
    show = actions.add_parser(
        "show",
        help="each data source's cumulative bound now",
        description="The cumulative bound of every release counted in each data source's "
        "ledger, every subset together (the joint release of every candidate used, "
        "docs/design.md#release-ledger), now.",
    )
    show.add_argument("--source", help="only this data source (a dataset name, e.g. digits)")
    show.add_argument(
        "--delta",
        type=probability,
        help="δ of the bound (default: the largest δ a counted release was made at)",
    )
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(handler=_show)
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
    for sub in (show, rebuild, restore):
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


def _show(args: argparse.Namespace) -> int:
    from dpmerge.state.serving import read_state, sources
    from dpmerge.state.store import stamp
    from dpmerge.workspace import Workspace

    located = locate_registry(args.tracking_uri)
    store = Workspace.of_registry(located.tracking_uri).state()
    as_of, checked = stamp(), store.key is not None
    ledgers = []
    for source, datasets in sources(store).items():
        if args.source not in (None, source):
            continue
        state = read_state(store, datasets[0])
        ledger = state.ledger
        if not ledger:
            continue
        delta = args.delta or max(r.delta for r in ledger)
        statement = state.statement(delta)
        test, person = statement.test, statement.person
        ledgers.append(
            {
                "source": source,
                "datasets": datasets,
                "epsilon": statement.training.epsilon,
                "delta": delta,
                "accountant": str(statement.training.accountant),
                "test_rows": {
                    "epsilon": test.epsilon,
                    "delta": test.delta,
                    "composition": test.composition.value,
                    "unrecorded": list(test.unrecorded),
                },
                "validation_rows": {"epsilon": statement.validation, "delta": 0.0},
                "per_person": {
                    "epsilon": person.epsilon,
                    "delta": person.delta,
                    "composition": person.composition.value,
                    "accountant": str(statement.training.accountant),
                },
                "releases": len(ledger),
                "last_counted_at": max(r.counted_at for r in ledger),
            }
        )
    if args.json:
        print_json({"as_of": as_of, "signatures_checked": checked, "ledgers": ledgers})
        return 0
    print(located.describe())
    for row in ledgers:
        print(
            f"{row['source']} (every subset: {len(row['datasets'])} dataset identifier(s)): "
            f"training rows ε = {epsilon_text(row['epsilon'])} at δ = {row['delta']:g} "
            f"({row['accountant']}), {row['releases']} release(s), the last counted "
            f"{row['last_counted_at']}"
        )
        print(f"  {_test_line(row['test_rows'])}")
        if row["validation_rows"]["epsilon"]:
            print(
                f"  validation rows: ε = {epsilon_text(row['validation_rows']['epsilon'])} at "
                "δ = 0 (the private selections' ε summed)"
            )
        print(f"  {_person_line(row['per_person'])}")
    if not ledgers:
        print("no release is counted" + (f" for {args.source}" if args.source else ""))
    unchecked = "" if checked else "; signatures not checked (no workflow key here)"
    print(f"as of {as_of} (state {store.where}{unchecked})")
    return 0


def _test_line(test: Mapping[str, Any]) -> str:
    if test["epsilon"] is None:
        shown = ", ".join(r[:12] + "…" for r in test["unrecorded"][:3])
        return (
            f"test rows: NOT BOUNDED — {len(test['unrecorded'])} release(s) have no recorded DP "
            f"estimate of their accuracy (e.g. {shown}; they may have published an exact one)"
        )
    return (
        f"test rows: ε = {epsilon_text(test['epsilon'])} at δ = 0 ({test['composition']} "
        "composition of the releases' Laplace estimates: their ε summed)"
    )


def _person_line(person: Mapping[str, Any]) -> str:
    from dpmerge.privacy_card import PERSON_RULES

    if person["epsilon"] is None:
        return "one person, whichever split: NOT BOUNDED (the test rows are not)"
    rule = PERSON_RULES[person["composition"]]
    return (
        f"one person, whichever split: ε = {epsilon_text(person['epsilon'])} at "
        f"δ = {person['delta']:g} ({person['composition']}: {rule})"
    )
