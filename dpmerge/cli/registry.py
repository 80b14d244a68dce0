"""``dpmerge registry ls|show``: candidates and merged releases with their privacy, policy,
target and aliases; one version's privacy card. ``quarantine`` and ``sign``: the repairs for a
candidate whose record fails verification (docs/design.md#security).

Read-only and quick: the registry is found as every command finds it (:mod:`dpmerge.locate`:
``--tracking-uri`` or ``--home``, ``$MLFLOW_TRACKING_URI``, the local stack, the embedded
state), named in the output (``registry: <uri> (<kind>; from <where>)``, and ``"registry"`` in
the JSON), and read through :mod:`dpmerge.registry.catalog`, without importing MLflow or torch.
Nothing is created: with no registry anywhere the command says where it looked (exit 2); a
local stack that is recorded but stopped is named with ``dpmerge stack up`` (exit 1).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile

from dpmerge.errors import InputError
from dpmerge.formatting import cut, epsilon_text, number_text, printable
from dpmerge.locate import Located, locate_registry
from dpmerge.registry.catalog import open_catalog
from dpmerge.registry.versions import VersionSummary

TRACKING_HELP = (
    "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the local stack, else "
    "the embedded state $DPMERGE_HOME or ./.dpmerge)"
)
HOME_HELP = "use the embedded state in this directory (instead of --tracking-uri)"
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
    ls.add_argument(
        "--internal",
        action="store_true",
        help="also show candidates' accuracies (internal: beside an RS release's accuracy they "
        "reveal the drawn candidate)",
    )
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
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    quarantine = actions.add_parser(
        "quarantine",
        help="take a version out of use (never merged, reused or promoted again)",
        description=(
            "Mark a candidate or merged version dp.status=quarantined: for a candidate whose "
            "record fails verification (changed after registration) or was trained with fixed "
            "seeds. Policy merges then run without it."
        ),
    )
    sign = actions.add_parser(
        "sign",
        help="re-sign a candidate whose record matches its run's params (key change, old version)",
        description=(
            "Re-sign a candidate registered before record signing or under another key, after "
            "checking its files against dp.content_hash and its record against the params its "
            "run logged at registration (MLflow never changes a logged param)."
        ),
    )
    for sub in (quarantine, sign):
        sub.add_argument("model", help="registered model name")
        sub.add_argument("version", type=_version, help="version number")
    quarantine.add_argument("--reason", default="quarantined by an operator", help="recorded")
    quarantine.set_defaults(handler=_quarantine)
    sign.set_defaults(handler=_sign)
    for sub in (ls, show, quarantine, sign):
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
        where.add_argument("--home", default=None, help=HOME_HELP)


def _version(text: str) -> str:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text[:40]!r}")
    return str(int(text))


def _located(args: argparse.Namespace) -> Located:
    return locate_registry(args.tracking_uri, home=args.home)


def _registry(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The writable registry where every command finds it (imports MLflow: repairs only)."""
    from dpmerge.registry import Registry

    located = _located(args)
    print(located.describe())
    return Registry(located.tracking_uri)


def _quarantine(args: argparse.Namespace) -> int:
    _registry(args).quarantine(args.model, args.version, args.reason)
    print(f"{args.model} v{args.version} quarantined: it is never merged or promoted again")
    return 0


def _sign(args: argparse.Namespace) -> int:
    registry = _registry(args)
    with tempfile.TemporaryDirectory(prefix="dpmerge-sign-") as scratch:
        path = registry.download_candidate(args.model, args.version, scratch)
        registry.sign(args.model, args.version, path)
    print(f"{args.model} v{args.version} signed with key {registry.keys.key_id}")
    return 0


def _list(args: argparse.Namespace) -> int:
    located = _located(args)
    rows = open_catalog(located.tracking_uri).rows(args.name, internal=args.internal)
    if args.json:
        document = {"registry": located.to_dict(), "versions": [r.to_dict() for r in rows]}
        print(json.dumps(document, indent=2))
        return 0
    print(located.describe())
    if not rows:
        print("no dpmerge versions registered")
        return 0
    header = ("model", "ver", "role", "status", "ε (accountant, δ)", "bound", "policy", "ε*")
    table = [(*header, "acc", "aliases"), *(_row(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
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
    cells = (
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
    return tuple(printable(cell) for cell in cells)  # registry writers are not trusted


def _show(args: argparse.Namespace) -> int:
    match = _REFERENCE.match(args.reference)
    if match is None:
        raise InputError(
            "expected NAME, NAME@ALIAS, NAME/VERSION or @ALIAS, got "
            + cut(repr(args.reference), 80)
        )
    located = _located(args)
    catalog = open_catalog(located.tracking_uri)
    detail = catalog.detail(match["name"], match["version"], match["alias"] or match["only"])
    if args.json:
        print(json.dumps({"registry": located.to_dict(), **detail.to_dict()}, indent=2))
        return 0
    tags = detail.stored.tags
    aliases = ", ".join(detail.aliases) or "none"
    heading = (
        f"{detail.stored.name} v{detail.stored.version} — {tags.get('dp.role', '?')}, "
        f"{tags.get('dp.status', '?')}; aliases: {aliases}"
    )
    print(located.describe())
    print(printable(heading) + "\n")
    card = detail.description or "(no description)"
    print("\n".join(printable(line) for line in card.splitlines()))
    return 0
