"""``dpmerge demo``: the whole job on one machine, embedded, in a few minutes.

Trains a handful of DP-SGD candidates (logistic regression on Fashion-MNIST; scikit-learn's
digits where Fashion-MNIST is not installed) with the ``train-candidates`` flow, registers them
in MLflow, applies an example policy with the ``merge-on-policy`` flow (calibrate → merge →
evaluate → register → promote), and prints the candidates, the privacy card, the accuracies and
the promotion. Everything lives under ``--home`` (default ``./.dpmerge``): the MLflow sqlite
database and artifacts, ``PREFECT_HOME``, the release ledger and the RS audit records. Running it
again reuses the registered candidates (``--retrain`` trains new ones) and the merged release.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path
from typing import Any

from dpmerge.cli.common import float_list, positive_float, positive_int
from dpmerge.data.sources import check_source, default_dataset
from dpmerge.errors import InputError
from dpmerge.locate import command, locate_registry, resolve_home

POLICY_FILE = Path(__file__).resolve().parents[2] / "deployments" / "policies.yaml"
DEMO_POLICY = "eu"
PLANS: dict[str, dict[str, Any]] = {
    # σ levels spanning ε ≈ 0.13 … 2.1 at δ = 1e-5 with 3 epochs (the defaults of the
    # train-candidates deployment), so ε* = 2 is reachable by several merges.
    "fashion-mnist": {
        "noise_multipliers": [0.7, 0.9, 1.2, 1.8, 3.0],
        "epochs": 3,
        "batch_size": 256,
    },
    "digits": {
        "noise_multipliers": [1.2, 1.6, 2.0, 3.0, 5.0],
        "epochs": 15,
        "batch_size": 64,
        "learning_rate": 1.0,
    },
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train candidates, register them, apply a policy, promote (embedded, minutes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--home", default=".dpmerge", help="state directory (default .dpmerge)")
    parser.add_argument(
        "--dataset",
        default=None,
        choices=tuple(PLANS),
        help="fashion-mnist or digits (default: fashion-mnist if installed, else digits)",
    )
    parser.add_argument(
        "--noise-multipliers",
        type=float_list,
        default=None,
        help="comma-separated σ levels (default: five levels per dataset)",
    )
    parser.add_argument("--epochs", type=positive_int, default=None, help="epochs per candidate")
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first rows")
    parser.add_argument(
        "--target-epsilon",
        type=positive_float,
        default=None,
        help="override the example policy's ε*",
    )
    parser.add_argument("--retrain", action="store_true", help="train new candidates anyway")
    parser.set_defaults(handler=handle)


def _example_policy(dataset: str, target_epsilon: float | None) -> Any:
    from dpmerge.policies import load_policies, policy_from_dict

    fields: dict[str, Any] = {
        "name": DEMO_POLICY,
        "target_epsilon": 2.0,
        "target_delta": 1e-5,
        "dataset": dataset,
        "model": "logreg",
        "min_accuracy": 0.8,
    }
    if POLICY_FILE.is_file():
        example = {p.name: p for p in load_policies(POLICY_FILE)}.get(DEMO_POLICY)
        if example is not None:
            fields = example.model_dump()
    fields["dataset"] = dataset
    fields["model"] = "logreg"
    if dataset == "digits":
        fields["min_accuracy"] = min(float(fields.get("min_accuracy") or 0.0), 0.8)
    if target_epsilon is not None:
        fields["target_epsilon"] = target_epsilon
    return policy_from_dict(fields)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def handle(args: argparse.Namespace) -> int:
    import warnings

    # known third-party noise (Opacus: secure RNG off, full backward hooks; the library draws
    # its own noise seeds from the OS)
    warnings.filterwarnings("ignore", module=r"opacus\.")
    warnings.filterwarnings("ignore", message=r".*Full backward hook.*")
    home = Path(args.home).absolute()
    dataset = args.dataset or default_dataset()
    check_source(dataset, None)  # every check before the home is made: a refusal leaves nothing
    plan = dict(PLANS[dataset])
    if args.noise_multipliers:
        if not all(0 < sigma < math.inf for sigma in args.noise_multipliers):
            raise InputError(f"--noise-multipliers must be positive, got {args.noise_multipliers}")
        plan["noise_multipliers"] = args.noise_multipliers
    if args.epochs:
        plan["epochs"] = args.epochs
    policy = _example_policy(dataset, args.target_epsilon)
    from flows import runtime

    runtime.configure_embedded(home, force=True)
    located = locate_registry(home=home, create=True)
    print(f"dpmerge demo — state in {home} (MLflow sqlite + artifacts, PREFECT_HOME, ledger)")
    print(located.describe())
    print(
        f"dataset {dataset}, logistic regression; policy {policy.name!r}: "
        f"(ε*, δ*) = ({policy.target_epsilon:g}, {policy.target_delta:g}), "
        f"method {policy.method}, min accuracy {policy.min_accuracy:g}\n"
    )

    from dpmerge import policy_merge as pm
    from dpmerge.registry import RegistryError
    from dpmerge.state.policies import set_policy
    from flows.commands.policy import EXIT_CODES, outcome_line, run_policy
    from flows.training import train_candidates

    workspace = pm.Workspace.from_env()
    start = time.perf_counter()
    existing: tuple[str, ...] = ()
    with contextlib.suppress(RegistryError):
        existing = pm.find_candidates(
            workspace.registry(), dataset, "logreg", workspace.state()
        ).versions
    trained = not existing or args.retrain
    frontier = None
    if not trained:
        print(f"[1/4] reusing {len(existing)} registered candidates (--retrain to train new)")
    else:
        print(
            f"[1/4] training {len(plan['noise_multipliers'])} DP-SGD candidates "
            f"(σ = {', '.join(f'{s:g}' for s in plan['noise_multipliers'])}, "
            f"{plan['epochs']} epochs each) and registering them …"
        )
        training = train_candidates(dataset=dataset, model="logreg", limit=args.limit, **plan)
        frontier = training["frontier"]
    _print_candidates(workspace, dataset, policy.target_delta)
    print(
        f"\n[2/4] applying policy {policy.name!r} (calibrate → merge → evaluate → register → "
        "promote) …"
    )
    change = set_policy(
        workspace.state(), policy.name, policy.event_payload(), source="dpmerge demo"
    )
    outcome = run_policy(change.version)
    print()
    print(outcome_line(outcome))
    if outcome.get("version"):
        card = workspace.registry().card_text(outcome["merged_model"], outcome["version"])
        print("\n[3/4] privacy card of the release\n")
        print(card)
    if frontier is not None:
        print("\n[4/4] the privacy–utility frontier (RS and LC at 6 targets), made by training:")
        print(f"  logged to MLflow run {frontier['run_id']} (experiment dpmerge-reports)")
    elif trained:
        print("\n[4/4] frontier: the report failed (see the log above); the candidates stand")
    else:
        print("\n[4/4] frontier: logged when the candidates were trained (--retrain to redo)")
    print(f"\ndone in {time.perf_counter() - start:.0f} s.\n")
    print(_next_steps(home, policy.name, outcome.get("merged_model")))
    return EXIT_CODES.get(str(outcome.get("status")), 1)


def _print_candidates(workspace: Any, dataset: str, delta: float) -> None:
    from dpmerge import policy_merge as pm
    from dpmerge.formatting import epsilon_text

    registry = workspace.registry()
    pool = pm.find_candidates(registry, dataset, "logreg", workspace.state())
    rows = [["version", "candidate", "σ", "ε (accountant, δ)", "test accuracy"]]
    for version in pool.versions:
        tags = registry.get_version(pool.registered_model, version).tags
        rows.append(
            [
                f"v{version}",
                tags.get("dp.candidate", "?"),
                f"{float(tags.get('dp.noise_multiplier', 'nan')):.3g}",
                f"{epsilon_text(_number(tags.get('dp.epsilon')))} "
                f"({tags.get('dp.accountant')}, {float(tags.get('dp.delta', delta)):g})",
                f"{float(tags.get('dp.accuracy', 'nan')):.4f}",
            ]
        )
    print(f"\ncandidates in {pool.registered_model} (internal):")
    print(_table(rows))


def _number(value: str | None) -> float | None:
    return None if value is None else float(value)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _next_steps(home: Path, policy: str, release: str | None) -> str:
    mlflow = command("ui", "--backend-store-uri", f"sqlite:///{home}/mlflow.db", tool="mlflow")
    prefect = command("server", "start", tool="prefect")
    # the commands find ./.dpmerge (or $DPMERGE_HOME) by themselves; another home is named
    found = home == resolve_home()
    where = [] if found else ["--tracking-uri", f"sqlite:///{home}/mlflow.db"]
    show = command("registry", "show", f"{release or 'MODEL'}@policy-{policy}", *where)
    policy_set = command(
        "policy",
        "set",
        "--name",
        policy,
        "--target-epsilon",
        "3",
        *([] if found else ["--home", str(home)]),
    )
    history = command("policy", "history", policy, *([] if found else ["--home", str(home)]))
    return f"""Look at it (commands run from this directory):
  MLflow UI:  {mlflow} --port 5000
              then http://127.0.0.1:5000 → Models (…-candidates and …-releases, the alias,
              each release's privacy card in its description); Experiments → dpmerge-reports
              (frontier.png, the privacy–utility frontier)
  Prefect UI: PREFECT_HOME={_shown(home)}/prefect {prefect} --port 4200
              then http://127.0.0.1:4200 → Runs (train-candidates, merge-on-policy, artifacts);
              on another port P also set PREFECT_SERVER_API_PORT=P (the UI calls its API there)
  Registry:   {command("registry", "ls", *where)}
              {show}
  Policies:   {policy_set} --dry-run   (what it would release)
              {policy_set}             (apply it here, in-process)
              {history}   (every version: who, when, what changed, how it ended)"""
