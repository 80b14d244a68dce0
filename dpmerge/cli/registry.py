"""``dpmerge registry ls|show``: candidates and merged releases with their privacy, policy,
target and aliases; one version's privacy card.

Read-only and quick: the registry is found as every command finds it (:mod:`dpmerge.locate`:
``--tracking-uri``, ``$MLFLOW_TRACKING_URI``, a running local stack, the embedded state) and
read through :mod:`dpmerge.registry.catalog`, without importing MLflow or torch. Nothing is
created: with no registry anywhere the command says where it looked (exit 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dpmerge.errors import InputError
from dpmerge.formatting import epsilon_text, number_text
from dpmerge.locate import locate_registry
from dpmerge.registry.catalog import Catalog, open_catalog
from dpmerge.registry.versions import VersionSummary

TRACKING_HELP = (
    "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else a running local stack, else "
    "the embedded state $DPMERGE_HOME or ./.dpmerge)"
)
_REFERENCE = re.compile(
    r"^(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>\d+))?$|^@(?P<only>[^@/]+)$"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "registry",
        help="inspect the MLflow model registry (candidates, merged releases, aliases)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="registry_command", required=True)
    ls = actions.add_parser(
        "ls",
        help="list versions: role, status, ε (accountant, δ), bound, policy, target, aliases",
        description=(
            "List candidate and merged versions with their role, status, ε (accountant, δ), "
            "gating bound, policy, target ε*, accuracy and aliases."
        ),
    )
    ls.add_argument("--name", default=None, help="only this registered model")
    ls.set_defaults(handler=_list)
    show = actions.add_parser(
        "show",
        help="one version's privacy card: NAME, NAME@ALIAS, NAME/VERSION or @ALIAS",
        description=(
            "Print one version: its tags and description (for a release, its privacy card). "
            "NAME alone shows the latest version; @ALIAS the release a policy's alias names."
        ),
    )
    show.add_argument("reference", metavar="NAME[@ALIAS|/VERSION] | @ALIAS")
    show.set_defaults(handler=_show)
    for sub in (ls, show):
        sub.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
        sub.add_argument("--json", action="store_true", help="machine-readable output")


def _catalog(args: argparse.Namespace) -> Catalog:
    located = locate_registry(args.tracking_uri)
    return open_catalog(located.tracking_uri)


def _list(args: argparse.Namespace) -> int:
    catalog = _catalog(args)
    rows = catalog.rows(args.name)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no dpmerge versions registered at {catalog.tracking_uri}")
        return 0
    header = ("model", "ver", "role", "status", "ε (accountant, δ)", "bound", "policy", "ε*")
    table = [(*header, "acc", "aliases"), *(_row(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    print(f"registry: {catalog.tracking_uri}")
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return 0


def _row(r: VersionSummary) -> tuple[str, ...]:
    privacy = (
        f"{epsilon_text(r.epsilon)} ({r.accountant or '?'}, {r.delta:g})"
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
        r.policy or "—",
        f"{r.target_epsilon:g}" if r.target_epsilon is not None else "—",
        number_text(r.accuracy) if r.accuracy is not None else "—",
        ",".join(r.aliases) or "—",
    )


def _show(args: argparse.Namespace) -> int:
    match = _REFERENCE.match(args.reference)
    if match is None:
        raise InputError(f"expected NAME, NAME@ALIAS or NAME/VERSION, got {args.reference[:80]!r}")
    detail = _catalog(args).detail(match["name"], match["version"], match["alias"] or match["only"])
    if args.json:
        print(json.dumps(detail.to_dict(), indent=2))
        return 0
    tags = detail.stored.tags
    aliases = ", ".join(detail.aliases) or "none"
    sys.stdout.write(
        f"{detail.stored.name} v{detail.stored.version} — {tags.get('dp.role', '?')}, "
        f"{tags.get('dp.status', '?')}; aliases: {aliases}\n\n"
    )
    print(detail.description or "(no description)")
    return 0
