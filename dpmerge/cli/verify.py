"""``dpmerge verify MODEL_URI``: check a release before serving it (docs/design.md#security).

Downloads the MLflow model ``models:/<releases>@<alias>`` (or ``models:/<releases>/<version>``,
or ``@<alias>``: the one releases model carrying that alias) with the caller's credentials (a
consumer's are enough) and checks its Ed25519-signed manifest under the workflow's public key
(``--public-key`` or ``$DPMERGE_RELEASE_PUBLIC_KEY``): the version's tags and every file — the
pt2 program, the weights, ``MLmodel`` — must be the ones the workflow registered. Exit 0 when
they are; exit 2 with one line when anything differs (swapped weights, an edited card, a
planted version): do not serve it.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from dpmerge.locate import locate_registry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check a release's signature and files before serving it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model_uri",
        metavar="MODEL_URI",
        help="models:/NAME@ALIAS, models:/NAME/VERSION or @ALIAS (the releases model with it)",
    )
    parser.add_argument(
        "--public-key",
        default=None,
        help="the workflow's release public key, hexadecimal (default $DPMERGE_RELEASE_PUBLIC_KEY)",
    )
    parser.add_argument("--tracking-uri", default=None, help="MLflow tracking URI")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=_verify)


def _verify(args: argparse.Namespace) -> int:
    from dpmerge import manifests
    from dpmerge.formatting import epsilon_text
    from dpmerge.registry import Registry

    public_key = (
        manifests.checked_public_key(args.public_key)
        if args.public_key
        else (manifests.configured_public_key())
    )
    tracking_uri = locate_registry(args.tracking_uri).tracking_uri
    model_uri = args.model_uri
    if model_uri.startswith("@"):
        from dpmerge.registry.catalog import open_catalog

        model_uri = f"models:/{open_catalog(tracking_uri).holder(model_uri[1:])}{model_uri}"
    registry = Registry(tracking_uri)
    name, version = registry.resolve(model_uri)
    with tempfile.TemporaryDirectory(prefix="dpmerge-verify-") as scratch:
        manifest, _ = registry.verified_model(name, version, scratch, public_key)
    facts = manifest.facts
    document = {
        "verified": True,
        "model_uri": model_uri,
        "name": name,
        "version": version,
        "release": manifest.release,
        "key": manifests.fingerprint(public_key),
        "files": len(manifest.files),
        "epsilon": float(facts["dp.epsilon"]),
        "delta": float(facts["dp.delta"]),
        "bound": facts.get("dp.gating_bound"),
        "accountant": facts.get("dp.accountant"),
        "registry": registry.tracking_uri,
    }
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(
        f"verified: {model_uri} = {name} v{version} (release {manifest.release[:12]}…) — "
        f"ε = {epsilon_text(document['epsilon'])}, δ = {document['delta']:g} "
        f"({document['bound']} bound, {document['accountant']}); {document['files']} files and "
        f"its tags match the manifest signed by key {document['key']}; registry "
        f"{registry.tracking_uri}"
    )
    return 0
