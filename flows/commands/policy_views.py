"""``dpmerge policy ls|show|history``: the stored policies, read from the release-state store
(docs/design.md#release-state). Read-only; readers without the workflow's key (operators) see
the documents without their signatures checked. Every object is read within the store's caps:
one that is not what its key says is shown as rejected (naming the key and the field), never
a traceback (:mod:`dpmerge.state.rejections`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dpmerge.formatting import epsilon_text
from dpmerge.policies import PolicyError
from dpmerge.state import AliasState, StateStore, inbox, rejections
from dpmerge.state import policies as stored_policies
from dpmerge.state import serving as state_serving
from dpmerge.state.policies import PolicyVersion
from flows.dispatch import strays


def aliases_by_owner(store: StateStore) -> dict[str, list[AliasState]]:
    """Every alias the store knows, by the policy that owns it."""
    found: dict[str, list[AliasState]] = {}
    for dataset in state_serving.datasets(store):
        for alias in state_serving.read_state(store, dataset).aliases.values():
            found.setdefault(alias.owner, []).append(alias)
    return found


def serving_text(alias: AliasState | None) -> str:
    """What an alias serves, for people."""
    if alias is None or alias.state.value == "unset":
        return "not served yet"
    if alias.serving is None:
        return f"{alias.state.value} ({alias.reason})" if alias.reason else alias.state.value
    guarantee = alias.guarantee
    epsilon = f", ε ≤ {epsilon_text(guarantee.epsilon)}" if guarantee else ""
    flag = "NON-COMPLIANT: " if alias.state.value == "noncompliant" else ""
    return f"{flag}v{alias.serving}{epsilon} (set by v{alias.policy_version})"


def _alias_of(version: PolicyVersion, owned: dict[str, list[AliasState]]) -> AliasState | None:
    mine = [a for a in owned.get(version.name, []) if a.alias == version.policy.alias]
    return mine[0] if mine else None


def _summary(version: PolicyVersion, alias: AliasState | None) -> dict[str, Any]:
    return {
        "version": version.version,
        "policy": version.to_dict()["policy"],
        "created": version.created,
        "author": version.author,
        "serving": alias.to_dict() if alias else None,
    }


def show(command: str, args: argparse.Namespace, store: StateStore, where: dict[str, str]) -> int:
    if command == "ls":
        return _ls(store, args.json, where)
    current = stored_policies.latest(store, args.name)
    known = current is not None or (
        command == "history" and stored_policies.newest_number(store, args.name) > 0
    )
    if not known:
        names = stored_policies.policy_names(store)
        raise PolicyError(
            f"no policy {args.name!r} in {store.where}; stored: {', '.join(names) or 'none'}"
        )
    if command == "show" and current is not None:
        return _show(store, current, args.json, where)
    return _history(store, args.name, args.json, where)


def refused(store: StateStore) -> list[dict[str, Any]]:
    """Every request the workflow rejected, and every object in the canonical tree that is
    not what its key says: recorded by the dispatcher, or (embedded, or not yet polled) found
    now."""
    found = inbox.rejected(store) + rejections.recorded(store)
    return found + [r.to_dict() for r in strays(store, set())]


def _ls(store: StateStore, as_json: bool, where: dict[str, str]) -> int:
    owned = aliases_by_owner(store)
    rows = []
    for name in stored_policies.policy_names(store):
        current = stored_policies.latest(store, name)
        if current is not None:
            rows.append((current, _alias_of(current, owned)))
    bad = refused(store)
    if as_json:
        document = {**where, "policies": [_summary(v, a) for v, a in rows], "rejected": bad}
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    registry = where["registry"]
    print(f"registry: {registry['uri']} ({registry['kind']}; from {registry['source']})")
    print(f"state {where['state']}")
    for entry in bad:
        print(
            f"rejected (never applied): {entry.get('key')}: field {entry.get('field')!r}: "
            f"{entry.get('reason')}"
        )
    if not rows:
        print("no policies stored")
        return 0
    table = [("policy", "ver", "ε*", "δ*", "method", "gate", "min acc", "alias", "serves")]
    for version, alias in rows:
        p = version.policy
        table.append(
            (
                p.name,
                str(version.version),
                f"{p.target_epsilon:g}",
                f"{p.target_delta:g}",
                str(p.method),
                str(p.gating_bound),
                f"{p.min_accuracy:g}",
                str(p.alias),
                serving_text(alias),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _show(store: StateStore, version: PolicyVersion, as_json: bool, where: dict[str, str]) -> int:
    alias = _alias_of(version, aliases_by_owner(store))
    ran = stored_policies.outcomes(store, version.name, version.version)
    if as_json:
        document = {**where, **_summary(version, alias), "outcomes": ran}
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    print(f"policy {version.name} v{version.version} ({version.created} by {version.author})")
    for key, value in version.to_dict()["policy"].items():
        print(f"  {key}: {value}")
    print(f"serves: {serving_text(alias)}")
    if alias is not None and alias.reason:
        print(f"  why: {alias.reason}")
    if ran:
        last = ran[-1]
        print(f"last run: {last.get('status')} ({last.get('state')}) at {last.get('at')}")
    print(f"state {where['state']}")
    return 0


def _history(store: StateStore, name: str, as_json: bool, where: dict[str, str]) -> int:
    entries: list[dict[str, Any]] = []
    for _, number in stored_policies.stored_keys(store, name):
        try:
            version = stored_policies.read_version(store, name, number)
        except PolicyError as error:
            entries.append(
                {
                    "version": number,
                    "invalid": str(error),
                    "field": error.field,
                    "outcomes": stored_policies.outcomes(store, name, number),
                }
            )
            continue
        if version is None:
            continue
        entries.append(
            {
                **version.to_dict(),
                "dispatch": stored_policies.dispatched(store, version.name, version.version),
                "outcomes": stored_policies.outcomes(store, version.name, version.version),
            }
        )
    if as_json:
        print(json.dumps({**where, "history": entries}, indent=2, ensure_ascii=False))
        return 0
    for entry in entries:
        if "invalid" in entry:
            print(f"v{entry['version']}  rejected (field {entry['field']!r}; supersedes nothing)")
            print(f"    why: {entry['invalid']}")
            continue
        changes = ", ".join(
            f"{k}: {old!r} → {new!r}" for k, (old, new) in sorted(entry["changes"].items())
        )
        print(f"v{entry['version']}  {entry['created']}  {entry['author']}  ({entry['source']})")
        print(f"    changed: {changes or 'nothing (rerun)'}")
        for outcome in entry["outcomes"] or [{"status": "no run yet"}]:
            reasons = "; ".join(outcome.get("reasons", []))
            print(
                f"    outcome: {outcome.get('status')}"
                + (f" ({outcome.get('state')})" if outcome.get("state") else "")
                + (f" — {reasons}" if reasons else "")
            )
    print(f"state {where['state']}")
    return 0
