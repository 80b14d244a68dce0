"""``dpmerge registry ls|show``: candidates and merged releases with their privacy, policy,
target, aliases and what each alias serves now; one version's privacy card (a release's public
card, or with ``--internal`` its internal card from the release-state store), or what a
revoked alias was revoked by. ``quarantine``: take a version out of use (recorded in the
release-state store, docs/design.md#release-state). ``verify``: compare MLflow with the
release-state store and the signatures, and with ``--repair`` repair what is safe to repair.

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
import os
import re
from typing import Any

from dpmerge import manifests
from dpmerge.errors import InputError, RefusalError
from dpmerge.formatting import cut, epsilon_text, number_text, printable
from dpmerge.locate import Located, command, locate_registry
from dpmerge.registry.catalog import open_catalog
from dpmerge.registry.shown_card import ShownCard, check_shown_card
from dpmerge.registry.tags import ROLE_MERGED
from dpmerge.registry.versions import VersionSummary
from dpmerge.state.releases import read_release
from dpmerge.vocabulary import CardCheck

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
            "Print one version: its tags and description (for a release, its privacy card, "
            "under the ε, δ and bound its signature states and whether the card is the signed "
            "one). NAME alone shows the latest version; @ALIAS the release a policy's alias names."
        ),
    )
    show.add_argument("reference", metavar="NAME[@ALIAS|/VERSION] | @ALIAS")
    show.add_argument(
        "--public-key",
        default=None,
        help="the workflow's release public key, hexadecimal (default $DPMERGE_RELEASE_PUBLIC_KEY)",
    )
    show.add_argument(
        "--internal",
        action="store_true",
        help="a release's internal card from the release-state store: its candidates, their "
        "records, weights and every note (workflow and operators only)",
    )
    show.set_defaults(handler=_show)
    for sub in (ls, show):
        sub.add_argument("--json", action="store_true", help="machine-readable output")
    quarantine = actions.add_parser(
        "quarantine",
        help="take a version out of use (never merged, reused or promoted again)",
        description=(
            "Record in the release-state store that a candidate or merged version is out of "
            "use — for a candidate whose record fails verification (changed after "
            "registration, unsigned) or was trained with fixed seeds — and tag it "
            "dp.status=quarantined in MLflow (a projection: the store decides). Policy merges "
            "then run without it; the repair for a bad candidate is to retrain it."
        ),
    )
    quarantine.add_argument("model", help="registered model name")
    quarantine.add_argument("version", type=_version, help="version number")
    quarantine.add_argument("--reason", default="quarantined by an operator", help="recorded")
    quarantine.set_defaults(handler=_quarantine)
    verify = actions.add_parser(
        "verify",
        help="compare MLflow with the release-state store and the signatures (drift)",
        description=(
            "One line per finding — an alias not where its serving pointer says, an alias no "
            "policy owns, a served release whose card or signature does not match, a served "
            "release the ledger lacks, a release that no longer meets its policy, a ready "
            "candidate whose signed record does not verify (forged) — and exit 1 "
            "if there is any (0 when everything agrees). --repair moves aliases back, removes "
            "unmanaged ones, counts unwitnessed releases and re-tags quarantined versions."
        ),
    )
    verify.add_argument("--repair", action="store_true", help="repair what is safe to repair")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(handler=_verify)
    for sub in (ls, show, quarantine, verify):
        where = sub.add_mutually_exclusive_group()
        where.add_argument("--tracking-uri", default=None, help=TRACKING_HELP)
        where.add_argument("--home", default=None, help=HOME_HELP)


def _version(text: str) -> str:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a version number, got {text[:40]!r}")
    return str(int(text))


def _located(args: argparse.Namespace) -> Located:
    return locate_registry(args.tracking_uri, home=args.home)


def _workspace(args: argparse.Namespace, located: Located | None = None):  # type: ignore[no-untyped-def]
    """The registry where every command finds it, with its release-state store."""
    from dpmerge.workspace import Workspace

    return Workspace.of_registry((located or _located(args)).tracking_uri)


def _quarantine(args: argparse.Namespace) -> int:
    from dpmerge.registry.errors import RegistryPermissionError

    located = _located(args)
    print(located.describe())
    workspace = _workspace(args, located)
    registry = workspace.registry()
    registry.get_version(args.model, args.version)  # it must exist
    record = _record_quarantine(workspace, args.model, args.version, args.reason)
    try:  # MLflow's tag is a projection of the record (an operator may not set it)
        registry.quarantine(args.model, args.version, record.reason)
        projected = "tagged dp.status=quarantined in MLflow"
    except RegistryPermissionError:
        projected = (
            "MLflow's dp.status tag is the workflow's to set (its verify-state run, or "
            f"`{command('registry', 'verify', '--repair')}` as the workflow)"
        )
    print(
        f"{args.model} v{args.version} quarantined (recorded in {workspace.state().where}): it "
        f"is never merged, reused or promoted again; {projected}"
    )
    return 0


def _record_quarantine(workspace: Any, model: str, version: str, reason: str) -> Any:
    """The quarantine record: embedded, written here; on a stack, requested (operators write
    requests, never state) and recorded by the workflow's dispatcher."""
    from dpmerge.errors import InputError
    from dpmerge.state import inbox
    from dpmerge.state.quarantine import quarantine, quarantined

    store = workspace.state()
    if workspace.s3 is None:
        return quarantine(store, model, version, reason)
    key = inbox.submit_quarantine(store, model, version, reason)
    handled = inbox.wait(store, key)
    recorded = quarantined(store, model).get(str(int(version)))
    if recorded is None:
        rejected = handled.get("rejected") or {}
        raise InputError(f"the workflow rejected request {key}: {rejected.get('reason')}")
    return recorded


def _verify(args: argparse.Namespace) -> int:
    from dpmerge.policy_merge.verify import verify

    located = _located(args)
    workspace = _workspace(args, located)
    findings = verify(workspace, repair=args.repair)
    where = {"registry": located.to_dict(), "state": workspace.state().where}
    if args.json:
        print(json.dumps({**where, "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        print(located.describe())
        for finding in findings:
            print(printable(finding.line()))
        print(
            f"{len(findings)} finding(s); state {where['state']}"
            + (
                ""
                if workspace.workflow_key()
                else " (state documents' signatures not checked: no workflow key)"
            )
        )
    return 1 if findings else 0


def _aliases(located: Located) -> list[Any]:
    """The serving pointers of the registry's release-state store (none when it has none, or
    when this environment cannot read it: a consumer's)."""
    from dpmerge.state.serving import every_alias
    from dpmerge.workspace import Workspace

    workspace = Workspace.of_registry(located.tracking_uri)
    return [] if workspace.stack_without_state else every_alias(workspace.state())


def _serves(alias: Any) -> str:
    flag = "NON-COMPLIANT " if alias.state == "noncompliant" else ""
    return f"{flag}{alias.alias} ({alias.owner} v{alias.policy_version})"


def _list(args: argparse.Namespace) -> int:
    located = _located(args)
    rows = open_catalog(located.tracking_uri).rows(args.name, internal=args.internal)
    serving: dict[tuple[str, str], list[str]] = {}
    for alias in _aliases(located):
        if alias.serving is not None:
            serving.setdefault((alias.model, alias.serving), []).append(_serves(alias))
    if args.json:
        documents = [{**r.to_dict(), "serves": serving.get((r.name, r.version), [])} for r in rows]
        print(json.dumps({"registry": located.to_dict(), "versions": documents}, indent=2))
        return 0
    print(located.describe())
    if not rows:
        print("no dpmerge versions registered")
        return 0
    header = ("model", "ver", "role", "status", "ε (accountant, δ)", "bound", "policy", "ε*")
    table = [(*header, "acc", "aliases", "serves (policy version)")]
    table += [
        (*_row(r), printable("; ".join(serving.get((r.name, r.version), [])) or "—")) for r in rows
    ]
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
    alias = match["alias"] or match["only"]
    pointers = [a for a in _aliases(located) if alias is not None and a.alias == alias]
    if match["name"]:
        pointers = [a for a in pointers if a.model == match["name"]]
    pointer = pointers[0] if len(pointers) == 1 else None
    if pointer is not None and pointer.serving is None:
        return _not_serving(pointer, located, args.json)
    catalog = open_catalog(located.tracking_uri)
    detail = catalog.detail(match["name"], match["version"], alias)
    shown = None
    if detail.stored.tags.get("dp.role") == ROLE_MERGED:
        shown = check_shown_card(catalog, detail, _public_key(args.public_key))
    internal = _internal(args, located, detail) if args.internal else None
    if args.json:
        document = {"registry": located.to_dict(), **detail.to_dict()}
        document["signed"] = shown.to_dict() if shown else None
        document["serving_pointer"] = pointer.to_dict() if pointer else None
        if internal is not None:
            document["internal"] = internal
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    tags = detail.stored.tags
    aliases = ", ".join(detail.aliases) or "none"
    heading = (
        f"{detail.stored.name} v{detail.stored.version} — {tags.get('dp.role', '?')}, "
        f"{tags.get('dp.status', '?')}; aliases: {aliases}"
    )
    print(located.describe())
    print(printable(heading))
    if pointer is not None:
        state = "NON-COMPLIANT (kept by its policy)" if pointer.state == "noncompliant" else ""
        print(
            f"{pointer.alias}: serves v{pointer.serving} for policy {pointer.owner} "
            f"v{pointer.policy_version} since {pointer.since} {state}".rstrip()
        )
        if pointer.serving != detail.stored.version:
            print(
                f"WARNING: MLflow's alias names v{detail.stored.version}, but the serving "
                f"pointer says v{pointer.serving}: `dpmerge registry verify --repair` moves it back"
            )
    if shown is not None:
        print("\n".join(printable(line) for line in _signed_lines(shown)))
    print()
    card = internal["card"] if internal is not None else detail.description
    print("\n".join(printable(line) for line in (card or "(no description)").splitlines()))
    return 0


def _public_key(given: str | None) -> str | None:
    """``--public-key``, else ``$DPMERGE_RELEASE_PUBLIC_KEY`` where set, else ``None``."""
    if given:
        return manifests.checked_public_key(given)
    return manifests.configured_public_key() if os.environ.get(manifests.PUBLIC_KEY_ENV) else None


def _signed_lines(shown: ShownCard) -> list[str]:
    """What the release's signature states, and whether the card below is the signed one."""
    facts = shown.facts
    if not facts:
        label = "NOT SIGNED" if shown.check == CardCheck.UNSIGNED else "not checked"
        return [f"signed record: {label} ({shown.why}); the card below is unverified"]
    signed = (
        f"signed record (key {shown.key}): ε = {epsilon_text(float(facts['dp.epsilon']))}, "
        f"δ = {float(facts['dp.delta']):g} ({facts.get('dp.gating_bound')} bound, "
        f"{facts.get('dp.accountant')})"
    )
    if shown.check == CardCheck.EDITED:
        return [
            signed,
            f"WARNING: {shown.why}; the ε above is the signed one, not the card's: do not "
            "trust or serve this release",
        ]
    if shown.check == CardCheck.SIGNED:
        return [f"{signed}; {shown.why}"]
    return [f"{signed}; {shown.why}: the card below is unverified"]


def _internal(args: argparse.Namespace, located: Located, detail: Any) -> dict[str, Any]:
    """The internal record of the release ``detail`` shows (:mod:`dpmerge.state.releases`)."""
    stored = detail.stored
    if stored.tags.get("dp.role") != ROLE_MERGED:
        raise InputError(f"{stored.name} v{stored.version} is not a release: no internal card")
    state = _workspace(args, located).state()
    record = read_release(state, stored.tags.get("dp.content_hash", ""))
    if record is None:
        raise RefusalError(
            f"{stored.name} v{stored.version} has no internal record in the release-state "
            f"store {state.where}"
        )
    return record


def _not_serving(pointer: Any, located: Located, as_json: bool) -> int:
    """An alias that serves nothing: by which policy version, run, when and why."""
    if as_json:
        document = {"registry": located.to_dict(), "serving_pointer": pointer.to_dict()}
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    print(located.describe())
    if pointer.state == "unset":
        print(f"{pointer.model}@{pointer.alias}: claimed by policy {pointer.owner}, never served")
        return 0
    print(
        f"{pointer.model}@{pointer.alias}: {pointer.state.upper()} by policy {pointer.owner} "
        f"v{pointer.policy_version} (run {pointer.run or 'in-process'}) at {pointer.since}"
    )
    print(f"  why: {printable(pointer.reason or '(not recorded)')}")
    previous = [h for h in pointer.history if h.get("version")]
    if previous:
        last = previous[-1]
        print(
            f"  served before: v{last['version']} (set by policy version {last['policy_version']})"
        )
    return 0
