"""``dpmerge registry ls``: candidates and merged versions with their privacy and aliases."""

from __future__ import annotations

import argparse
import json

from dpmerge.privacy_card import eps_text
from dpmerge.registry import Registry, VersionSummary


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "registry",
        help="inspect the MLflow model registry (candidates, merged releases, aliases)",
        description="Inspect dpmerge's registered models in MLflow.",
    )
    actions = parser.add_subparsers(dest="registry_command", required=True)
    ls = actions.add_parser(
        "ls",
        help="list candidate and merged versions: role, ε (accountant, δ), accuracy, aliases",
        description=(
            "List candidate and merged versions with their role, status, ε (accountant, δ), "
            "gating bound, accuracy and aliases."
        ),
    )
    ls.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    ls.add_argument("--name", default=None, help="only this registered model")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(handler=_list)


def _list(args: argparse.Namespace) -> int:
    rows = Registry(args.tracking_uri).list_versions(args.name)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    if not rows:
        print("no dpmerge versions registered")
        return 0
    header = ("model", "ver", "role", "status", "ε (accountant, δ)", "bound", "acc", "aliases")
    table = [header, *(_row(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return 0


def _row(r: VersionSummary) -> tuple[str, ...]:
    privacy = (
        f"{eps_text(r.epsilon)} ({r.accountant or '?'}, {r.delta:g})"
        if r.epsilon is not None and r.delta is not None
        else "—"
    )
    role = f"{r.role} ({r.method})" if r.method else r.role
    return (
        r.name,
        r.version,
        role,
        r.status or "—",
        privacy,
        r.bound or "—",
        f"{r.accuracy:.4f}" if r.accuracy is not None else "—",
        ",".join(r.aliases) or "—",
    )
