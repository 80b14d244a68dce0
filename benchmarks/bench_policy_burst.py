"""A burst of policy changes: N policy versions over P policies, stored as fast as operators'
``dpmerge policy set`` can store them, drained by the stack's dispatcher and ``merge-on-policy``.

Run: ``.venv/bin/python benchmarks/bench_policy_burst.py [--versions 200] [--policies 10]
[--warm-max-runs 4]``

It starts a stack on free ports (PostgreSQL; its dispatcher and cpu/gpu workers), deploys
``merge-on-policy``, trains and registers five logistic-regression candidates here, then stores
the versions from ``--writers`` threads through the operator role's store (the policy-set code
path on a stack: a request in the operator's inbox, recorded as the next version by the
dispatcher, ``dpmerge.state.inbox``; targets drawn from ``--targets``), and waits until every
version is accounted for. It prints: versions stored and how long that took, versions
lost (neither dispatched nor recorded superseded), runs created and their final states, failed
runs, the drain time (first version stored → last outcome recorded), whether each policy's
alias (its serving pointer and the MLflow alias) ends on its last version's release, the
``database is locked`` lines in every server log, and the load. ``--warm-max-runs`` sets the
warm flow-run process's cap on runs started at once (flows/warm.py, ``DPMERGE_WARM_MAX_RUNS``).
Figures are recorded in docs/results.md#scale-out; the goal on the 2-core development machine
is 0 lost, 0 failed, every alias on its last version, 0 locked, drain ≤ 3 min.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from harness import (
    deploy,
    flow_runs,
    load,
    local_stack,
    locked_lines,
    operator_store,
    pointer,
    policy_fields,
    releases_model,
    store_version,
    train_candidates,
    workflow_store,
)

DELTA = 1e-5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=200)
    parser.add_argument("--policies", type=int, default=10)
    parser.add_argument("--writers", type=int, default=10, help="threads storing versions")
    parser.add_argument("--targets", default="0.5,0.75,1,1.5,2,3", help="ε* drawn per version")
    parser.add_argument("--dataset", default=None, help="default: fashion-mnist, else digits")
    parser.add_argument("--sigmas", default="0.7,0.9,1.2,1.8,3.0")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warm-max-runs", type=int, default=None, help="flows/warm.py's cap")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--state-dir", default=None, help="stack state, kept (default: temporary)")
    parser.add_argument("--seed", type=int, default=0, help="order of the targets")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from flows.commands.policy_options import default_dataset

    dataset = args.dataset or default_dataset()
    env = {"DPMERGE_WARM_MAX_RUNS": str(args.warm_max_runs)} if args.warm_max_runs else {}
    with local_stack(args.state_dir, env) as config:
        deploy("merge-on-policy/merge-on-policy")
        sigmas = [float(s) for s in args.sigmas.split(",")]
        candidates, _ = train_candidates(dataset, sigmas, args.epochs, DELTA)
        return burst(args, config, dataset, releases_model(candidates))


def burst(args: argparse.Namespace, config: Any, dataset: str, releases: str) -> int:
    from mlflow import MlflowClient

    from dpmerge.state import policies

    rng = random.Random(args.seed)
    targets = [float(t) for t in args.targets.split(",")]
    names = [f"burst-{i:02d}" for i in range(args.policies)]
    plan = [(names[i % len(names)], rng.choice(targets)) for i in range(args.versions)]
    operator = operator_store(config)
    print(f"storing {len(plan)} versions over {len(names)} policies; {load()}")
    started = time.time()

    def write(name: str) -> list[int]:
        return [
            store_version(operator, name, policy_fields(dataset, t, DELTA))
            for n, t in plan
            if n == name
        ]

    with ThreadPoolExecutor(max_workers=args.writers) as pool:
        stored = dict(zip(names, pool.map(write, names), strict=True))
    print(f"stored {sum(map(len, stored.values()))} versions in {time.time() - started:.1f} s")
    last = {name: versions[-1] for name, versions in stored.items()}

    wanted = {(name, v) for name, versions in stored.items() for v in versions}
    dispatch: dict[tuple[str, int], dict[str, Any]] = {}
    outcome_at: dict[tuple[str, int], float] = {}
    deadline = started + args.timeout
    while True:
        _collect(operator, "dispatch/", wanted, dispatch)
        ended: dict[tuple[str, int], dict[str, Any]] = {}
        _collect(operator, "outcomes/", wanted - outcome_at.keys(), ended)
        outcome_at |= {k: datetime.fromisoformat(d["at"]).timestamp() for k, d in ended.items()}
        runs = {k: d["flow_run"] for k, d in dispatch.items() if "flow_run" in d}
        if wanted <= dispatch.keys() and runs.keys() <= outcome_at.keys():
            break
        if time.time() > deadline:
            break
        time.sleep(1.0)
    lost = sorted(wanted - dispatch.keys())
    superseded = [k for k, d in dispatch.items() if "superseded_by" in d]
    drain = max(outcome_at.values(), default=float("nan")) - started
    states = flow_runs(config, list(runs.values()))
    names_of = collections.Counter(
        (r.state.type.value, r.state.name) if r.state else ("NONE", "") for r in states.values()
    )
    failed = [
        r for r in states.values() if not r.state or r.state.type.value in ("FAILED", "CRASHED")
    ]
    unfinished = [k for k in runs if k not in outcome_at]
    print(f"versions lost (neither dispatched nor superseded): {len(lost)}")
    print(f"recorded superseded by the dispatcher (never ran): {len(superseded)}")
    print(f"runs created: {len(runs)}; without an outcome after the timeout: {len(unfinished)}")
    print(f"final states: {dict(names_of)}")
    print(f"failed or crashed runs: {len(failed)}")
    print(f"drain (first version stored → last outcome recorded): {drain:.1f} s")

    workflow = workflow_store()
    mlflow = MlflowClient()
    aliases = mlflow.get_registered_model(releases).aliases
    correct = 0
    for name in names:
        alias = f"policy-{name}"
        state = pointer(workflow, releases, alias)
        served = str(aliases.get(alias))
        last_outcome = policies.outcomes(operator, name, last[name])
        expected = last_outcome[-1].get("serving_version") if last_outcome else None
        ok = (
            state is not None
            and state.policy_version == last[name]
            and state.serving == served == str(expected)
        )
        correct += ok
        if not ok:
            version = state.policy_version if state else None
            print(
                f"  {alias}: last version v{last[name]}, pointer at v{version} serving "
                f"{state.serving if state else None}, MLflow alias → {served}, the last "
                f"outcome serves {expected}"
            )
    print(f"aliases on their last version's release: {correct} of {len(names)}")
    locked = locked_lines(config)
    print(f"'database is locked' in the server logs: {locked}")
    print(f"after the drain: {load()}")
    ok = not (lost or failed or unfinished or locked) and correct == len(names)
    print(
        f"summary: {args.versions} versions / {args.policies} policies, {len(lost)} lost, "
        f"{len(failed)} failed, drain {drain:.0f} s, {correct}/{len(names)} aliases right, "
        f"{locked} locked, warm cap {args.warm_max_runs or 'default'}: "
        + ("ok" if ok else "NOT OK")
    )
    return 0 if ok else 1


def _collect(
    store: Any, prefix: str, wanted: set[tuple[str, int]], found: dict[tuple[str, int], Any]
) -> None:
    """The first document under ``<prefix><policy>/<version>…`` of each wanted version not
    found yet (one listing, then a read per new version)."""
    for key in store.keys(prefix):
        name, number = key.split("/")[1:3]
        version = (name, int(number.removesuffix(".json")))
        if version in wanted and version not in found:
            document = store.read(key)
            if document is not None:
                found[version] = document.document


if __name__ == "__main__":
    sys.exit(main())
