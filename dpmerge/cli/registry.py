"""``dpmerge registry ls``: candidates and merged versions with their privacy and aliases;
``quarantine`` and ``sign``: the repairs for a candidate whose record fails verification
(docs/design.md#security)."""

from __future__ import annotations

import argparse
import json
import tempfile

from dpmerge.privacy_card import eps_text
from dpmerge.registry import Registry, VersionSummary

TRACKING_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"


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
    ls.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
    ls.add_argument("--name", default=None, help="only this registered model")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.add_argument(
        "--internal",
        action="store_true",
        help="also show candidates' accuracies (internal: beside an RS release's accuracy they "
        "reveal the drawn candidate)",
    )
    ls.set_defaults(handler=_list)
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
        sub.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
    quarantine.add_argument("--reason", default="quarantined by an operator", help="recorded")
    quarantine.set_defaults(handler=_quarantine)
    sign.set_defaults(handler=_sign)


def _version(text: str) -> str:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text[:40]!r}")
    return str(int(text))


def _quarantine(args: argparse.Namespace) -> int:
    Registry(args.tracking_uri).quarantine(args.model, args.version, args.reason)
    print(f"{args.model} v{args.version} quarantined: it is never merged or promoted again")
    return 0


def _sign(args: argparse.Namespace) -> int:
    registry = Registry(args.tracking_uri)
    with tempfile.TemporaryDirectory(prefix="dpmerge-sign-") as scratch:
        path = registry.download_candidate(args.model, args.version, scratch)
        registry.sign(args.model, args.version, path)
    print(f"{args.model} v{args.version} signed with key {registry.keys.key_id}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = Registry(args.tracking_uri).list_versions(args.name, internal=args.internal)
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
