"""``dpmerge verify MODEL_URI``: check a release before serving it (docs/design.md#security).

Downloads the MLflow model ``models:/<releases>@<alias>`` (or ``models:/<releases>/<version>``,
or ``@<alias>``: the one releases model carrying that alias) with the caller's credentials (a
consumer's are enough) and checks its Ed25519-signed manifest under the workflow's public key
(``--public-key`` or ``$DPMERGE_RELEASE_PUBLIC_KEY``): the version's tags and every file — the
pt2 program, the weights, ``MLmodel`` — must be the ones the workflow registered, and the card
consumers read — the version's description and its run's ``privacy_card.json`` — must be exactly
the signed card among those files. Exit 0 when they are; exit 2 with one line when anything
differs (swapped weights, an edited card or description, a planted version): do not serve it.
An alias is resolved once, and only if the workflow's signed, unexpired serving statement for it
names the version it resolves to (dpmerge.serving_statement): an alias moved to an older or
another policy's release is refused; ``models:/NAME/VERSION`` names no alias and needs none.

``--download DIR`` leaves the verified model directory in DIR (a new or empty directory) and
prints the command that serves exactly those files (``mlflow models serve -m DIR``): serving
``models:/…@alias`` instead would resolve the alias and download again, after the check.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from dpmerge.errors import InputError
from dpmerge.locate import locate_registry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = release_parser(
        subparsers, "verify", "check a release's signature and files before serving it", __doc__
    )
    parser.add_argument(
        "--download",
        metavar="DIR",
        default=None,
        help="leave the verified model in DIR (new or empty) and print how to serve it",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=_verify)


def release_parser(
    subparsers: argparse._SubParsersAction, name: str, summary: str, doc: str | None
) -> argparse.ArgumentParser:
    """The parser of command ``name`` (``verify``, ``serve``) with the release to check and
    how."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=doc,
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
    return parser


def verified(
    model_uri: str, public_key: str | None, tracking_uri: str | None, target: Path | None
) -> dict[str, Any]:
    """Resolve ``model_uri`` once, check the model it names (its statement, signature, files
    and card) and, with ``target`` (checked by :func:`_target`), move the verified directory
    there; what was verified."""
    from dpmerge import manifests
    from dpmerge.registry import Registry

    public_key = (
        manifests.checked_public_key(public_key)
        if public_key
        else manifests.configured_public_key()
    )
    tracking_uri = locate_registry(tracking_uri).tracking_uri
    if model_uri.startswith("@"):
        from dpmerge.registry.catalog import open_catalog

        model_uri = f"models:/{open_catalog(tracking_uri).holder(model_uri[1:])}{model_uri}"
    registry = Registry(tracking_uri)
    name, version = registry.resolve_served(model_uri, public_key)
    with _scratch(target) as scratch:
        manifest, root = registry.verified_model(name, version, scratch, public_key)
        registry.check_card(registry.get_version(name, version), manifest, root)
        if target is not None:
            _place(root, target)
    facts = manifest.facts
    document: dict[str, Any] = {
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
    if target is not None:
        document["directory"] = str(target)
    return document


def serve_command(directory: Path, port: int, program: str | None = None) -> list[str]:
    """``mlflow models serve`` on exactly ``directory`` (never a ``models:/`` URI, which MLflow
    would resolve again), on the loopback interface; ``program`` names MLflow's executable
    (default: the one beside this Python)."""
    mlflow = program or str(Path(sys.executable).parent / "mlflow")
    return [
        *(mlflow, "models", "serve", "-m", str(directory), "--env-manager", "local"),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]


def _verify(args: argparse.Namespace) -> int:
    from dpmerge.formatting import epsilon_text

    target = _target(args.download) if args.download is not None else None
    document = verified(args.model_uri, args.public_key, args.tracking_uri, target)
    if target is not None:
        document["serve"] = shlex.join(serve_command(target, 8090, program="mlflow"))
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(
        f"verified: {document['model_uri']} = {document['name']} v{document['version']} "
        f"(release {document['release'][:12]}…) — "
        f"ε = {epsilon_text(document['epsilon'])}, δ = {document['delta']:g} "
        f"({document['bound']} bound, {document['accountant']}); {document['files']} files, "
        f"its tags and its card match the manifest signed by key {document['key']}; registry "
        f"{document['registry']}"
    )
    if target is not None:
        print(f"the verified files are in {target}; serve exactly them with:")
        print(f"  {document['serve']}")
    return 0


def _target(text: str) -> Path:
    """``--download DIR`` checked before anything is read: a new or empty directory under a
    writable one; :class:`InputError` otherwise."""
    target = Path(text).expanduser().absolute()
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise InputError(f"--download {text}: exists and is not an empty directory")
    if not target.parent.is_dir():
        raise InputError(f"--download {text}: {target.parent} is not a directory")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise InputError(f"--download {text}: {target.parent} is not writable")
    return target


def _scratch(target: Path | None) -> tempfile.TemporaryDirectory[str]:
    """Where the model is downloaded and verified: beside ``target`` (so that it is moved
    there only once verified, on the same file system), else anywhere temporary."""
    try:
        return tempfile.TemporaryDirectory(
            prefix=".dpmerge-verify-", dir=target.parent if target else None
        )
    except OSError as error:
        raise InputError(f"--download {target}: cannot write beside it ({error})") from None


def _place(root: Path, target: Path) -> None:
    """Move the verified model directory ``root`` to ``target`` (same file system)."""
    try:
        if target.exists():
            target.rmdir()  # empty, checked by _target
        root.rename(target)
    except OSError as error:
        raise InputError(
            f"--download {target}: cannot place the verified model ({error})"
        ) from None
