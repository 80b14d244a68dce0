"""``dpmerge candidates list`` and ``dpmerge candidates import``: candidate directories.

``list`` turns candidate directories into the candidates file ``dpmerge account`` reads;
``import`` brings a DP model trained elsewhere in as a candidate directory, attested and signed
by the workflow identity (docs/design.md#imported-candidates). Options are checked here before
torch loads.
"""

from __future__ import annotations

import argparse
import sys

from dpmerge.cli.common import print_json, probability
from dpmerge.data.sources import check_source
from dpmerge.errors import ModelFactoryError
from dpmerge.model_reference import misplaced_factory_options, parse_reference
from dpmerge.vocabulary import DatasetName, ModelName, values


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("candidates", help="list or import candidate directories")
    actions = group.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="print the candidates file of candidate directories")
    listing.add_argument("dirs", nargs="+", metavar="DIR")
    listing.set_defaults(handler=_list)
    imported = actions.add_parser(
        "import",
        help="import a DP model trained elsewhere as a candidate",
        description="Check weights (safetensors, a torch state dict or an Opacus checkpoint) "
        "against a built-in model or your factory (module:callable) on a dataset, read the "
        "privacy profile (a DP-SGD record, the checkpoint's Opacus accountant history, an RDP "
        "curve or an ε(δ) curve), and write a "
        "candidate directory attested by --attested-by and signed with the workflow key "
        "(docs/design.md#imported-candidates).",
    )
    imported.add_argument("weights", metavar="WEIGHTS")
    imported.add_argument("--profile", required=True, help="privacy profile JSON file")
    imported.add_argument(
        "--model",
        required=True,
        help=f"{', '.join(m for m in values(ModelName) if m != ModelName.TRANSFORMERS)}, or "
        "module:callable (your factory, as in training)",
    )
    imported.add_argument("--model-path", help="directory of your factory's code (as in training)")
    imported.add_argument(
        "--fix-model", action="store_true", help="Opacus' ModuleValidator.fix, as in training"
    )
    imported.add_argument("--dataset", required=True, choices=values(DatasetName))
    imported.add_argument("--data-root", help="folder holding the dataset files (table: spec)")
    imported.add_argument("--limit", type=int, help="rows kept per file (as in training)")
    imported.add_argument("--name", required=True, help="the candidate's name")
    imported.add_argument(
        "--attested-by", required=True, help="who vouches for the profile (shown on the card)"
    )
    imported.add_argument("--out", required=True, help="candidate directory to write")
    imported.add_argument(
        "--delta", type=probability, default=1e-5, help="δ of the ε printed (default 1e-5)"
    )
    imported.add_argument("--json", action="store_true", help="print JSON instead of a line")
    imported.set_defaults(handler=_import)


def _list(args: argparse.Namespace) -> int:
    from dpmerge.accounting.records import candidates_from_dicts, candidates_to_document
    from dpmerge.merging import read_candidate_dir

    candidates = [read_candidate_dir(p).record for p in args.dirs]
    document = candidates_to_document(candidates)
    candidates_from_dicts(document["candidates"])  # names must be unique, as the reader demands
    print_json(document)
    return 0


def _check_model(args: argparse.Namespace) -> None:
    """A built-in model but ``transformers`` (a fine-tuned model is not imported), or a
    factory reference; the factory's options only with a factory."""
    if args.model == ModelName.TRANSFORMERS:
        raise ModelFactoryError(
            "an import takes a built-in model or your factory, not a fine-tuned transformer"
        )
    misplaced = misplaced_factory_options(args.model, args.model_path, args.fix_model)
    if misplaced:
        raise ModelFactoryError(misplaced)
    if args.model not in values(ModelName):
        parse_reference(args.model)


def _import(args: argparse.Namespace) -> int:
    check_source(args.dataset, args.data_root)
    _check_model(args)
    from dpmerge.accounting.candidate import candidate_bound
    from dpmerge.accounting.delta import check_delta_against
    from dpmerge.data import load_dataset
    from dpmerge.importing import import_candidate, importer_key
    from dpmerge.models import model_spec
    from dpmerge.workspace import Workspace

    key = importer_key(Workspace.from_env())
    data = load_dataset(args.dataset, args.data_root, limit=args.limit)
    delta_check = check_delta_against(args.delta, data.dataset_size)
    result = import_candidate(
        args.weights,
        args.profile,
        spec=model_spec(args.model, data, model_path=args.model_path, fix=args.fix_model),
        data=data,
        name=args.name,
        attested_by=args.attested_by,
        key=key,
        out_dir=args.out,
        delta=args.delta,
    )
    bound = candidate_bound(result.record, args.delta)
    if args.json:
        print_json(
            {
                "path": str(result.path),
                "weights_format": result.weights_format.value,
                "profile": result.profile.value,
                "attested_by": args.attested_by,
                "key_id": result.key_id,
                "weights_sha256": result.weights_sha256,
                "privacy": bound.to_dict(),
            }
        )
    else:
        print(
            f"imported {args.name!r} ({result.weights_format.value} weights, "
            f"{result.profile.value} profile, attested by {args.attested_by}, signed by key "
            f"{result.key_id}): {result.path}"
        )
    if delta_check.warning:
        print(f"dpmerge: {delta_check.warning}", file=sys.stderr)
    return 0
