"""Time-to-policy: from emitting ``dpmerge.policy.updated`` to the policy's alias naming the new
merged release, in one run beside retraining the same model at the target.

Run: ``.venv/bin/python benchmarks/bench_time_to_policy.py [--dataset fashion-mnist]
[--targets 3,0.5,1,1.5,2,2.5] [--epochs 3]``

It starts its own local stack on free loopback ports (S3, MLflow on S3, Prefect server and
workers polling every second), deploys ``merge-on-policy`` and ``train-candidate-gpu`` from
deployments/prefect.yaml, trains and registers logistic-regression candidates here, primes the
merge caches as the train-candidates flow does (``--cold`` skips that), then emits one policy
event per target, one after another, and polls the registry alias every 0.25 s. The first event
after the workers started also starts the warm flow-run process (flows/warm.py) and is reported
apart; the median is over the others. Finally the same model is retrained at a target ε (σ
calibrated to it, the same epochs) twice: in this process, and as a run of
``train-candidate-gpu`` on the stack (run created → candidate registered), for the ratios.
Workers are stopped before servers at the end. Figures are recorded in
docs/workflow.md#time-to-policy; the goal on the 2-core development machine is ≤ 15 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from harness import deploy, local_stack, train_candidates

RETRAIN_DEPLOYMENT = "train-candidate/train-candidate-gpu"


def task_breakdown(url: str, flow_run_id: Any) -> list[tuple[str, float]]:
    """(task name, seconds) of a flow run's task runs, in start order."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with SyncPrefectClient(url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    timed = sorted((r for r in runs if r.start_time and r.end_time), key=lambda r: r.start_time)
    return [(r.name.rsplit("-", 1)[0], (r.end_time - r.start_time).total_seconds()) for r in timed]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=None, help="default: fashion-mnist, else digits")
    parser.add_argument("--sigmas", default="0.7,0.9,1.2,1.8,3.0", help="candidate σ levels")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--targets", default="3,0.5,1,1.5,2,2.5", help="policy ε* per event")
    parser.add_argument("--retrain-target", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--state-dir", default=None, help="stack state, kept (default: temporary)")
    parser.add_argument("--cold", action="store_true", help="skip priming the merge caches")
    parser.add_argument("--json", type=Path, help="also write the summary figures as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from flows.commands.policy_options import default_dataset

    dataset = args.dataset or default_dataset()
    with local_stack(args.state_dir, reuse=False) as url:
        deploy("merge-on-policy/merge-on-policy", RETRAIN_DEPLOYMENT)
        sigmas = [float(s) for s in args.sigmas.split(",")]
        registered, train_seconds = train_candidates(
            dataset, sigmas, args.epochs, args.delta, prime=not args.cold
        )
        return measure(args, url, dataset, registered, train_seconds)


def measure(
    args: argparse.Namespace, url: str, dataset: str, registered: str, train_seconds: list[float]
) -> int:
    from mlflow import MlflowClient
    from prefect.client.orchestration import SyncPrefectClient

    from dpmerge.policies import policy_from_dict
    from dpmerge.registry.names import CANDIDATES_SUFFIX, RELEASES_SUFFIX
    from flows import runtime

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    merged = registered.removesuffix(f"-{CANDIDATES_SUFFIX}") + f"-{RELEASES_SUFFIX}"

    def alias_version() -> str | None:
        try:
            aliases = client.get_registered_model(merged).aliases
        except Exception:
            return None
        return str(aliases["policy-bench"]) if "policy-bench" in aliases else None

    times: list[float | None] = []
    unchanged = 0
    for target in [float(t) for t in args.targets.split(",")]:
        policy = policy_from_dict(
            {
                "name": "bench",
                "target_epsilon": target,
                "target_delta": args.delta,
                "dataset": dataset,
                "model": "logreg",
            }
        )
        before = alias_version()
        emitted = time.time()
        start = time.perf_counter()
        event_id = runtime.emit_policy_event(policy.event_payload(), policy.resource_id, "bench")
        moved = None
        with SyncPrefectClient(
            url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")
        ) as prefect:
            while time.perf_counter() - start < 300:
                current = alias_version()
                if current is not None and current != before:
                    moved = time.perf_counter() - start
                    break
                found = runtime.find_policy_run(event_id, prefect)
                if found is not None and found.state is not None and found.state.is_final():
                    if alias_version() != before:  # it moved just before the run ended
                        moved = time.perf_counter() - start
                    break  # ended without moving the alias (Unchanged, or a failure)
                time.sleep(0.25)
        run = runtime.wait_for_policy_run(event_id, 300)
        if run.state == "Unchanged":  # the release already serving meets this target too
            unchanged += 1
        else:
            times.append(moved)
        outcome = run.outcome or {}
        phases = _phases(url, run.id, emitted)
        print(
            f"  ε* = {target:g}: alias moved after {f'{moved:.1f} s' if moved else 'never'} "
            f"({run.state}); {outcome.get('method', '-')} ε = {outcome.get('epsilon')}, "
            f"test accuracy {outcome.get('test_accuracy')}{phases}"
        )
        if run.id:
            steps = task_breakdown(url, run.id)
            print("      tasks: " + ", ".join(f"{name} {sec:.2f}" for name, sec in steps))
    retrain_here, retrain_stack = retrain(args, url, dataset)
    first, rest = times[0], [t for t in times[1:] if t is not None]
    print("\nsummary")
    print(
        f"  candidates: {len(train_seconds)} × {args.epochs} epochs, training "
        f"{min(train_seconds):.1f}–{max(train_seconds):.1f} s each"
    )
    print(f"  first event (also starts the warm flow-run process): {first:.1f} s")
    if rest:
        median = statistics.median(rest)
        print(
            f"  time to policy (emit → alias moved): median {median:.1f} s, min {min(rest):.1f} s, "
            f"max {max(rest):.1f} s over {len(rest)} events"
            + (f"; {unchanged} more ended Unchanged (nothing to move)" if unchanged else "")
        )
        print(f"  retraining at ε* = {args.retrain_target:g} in-process: {retrain_here:.1f} s")
        print(f"  retraining at ε* = {args.retrain_target:g} on the stack: {retrain_stack:.1f} s")
        print(
            f"  ratio retraining / time-to-policy: {retrain_here / median:.2f} in-process, "
            f"{retrain_stack / median:.2f} on the stack"
        )
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "time_to_policy_median_s": median,
                        "time_to_policy_s": rest,
                        "first_event_s": first,
                        "retrain_in_process_s": retrain_here,
                        "retrain_on_stack_s": retrain_stack,
                    }
                )
            )
    return 0 if None not in times else 1


def _phases(url: str, run_id: str | None, emitted: float) -> str:
    if run_id is None:
        return ""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as prefect:
        run = prefect.read_flow_run(run_id)
    if run.start_time is None:
        return ""
    created = run.created.timestamp() - emitted
    running = run.start_time.timestamp() - emitted
    return f" [run created +{created:.1f} s, flow code running +{running:.1f} s]"


def retrain(args: argparse.Namespace, url: str, dataset: str) -> tuple[float, float]:
    """Seconds to retrain the model at ``--retrain-target``: in this process, and as a run of
    the training deployment on the stack (run created → registered)."""
    from prefect.client.orchestration import SyncPrefectClient

    from dpmerge.data import load_dataset
    from dpmerge.training import TrainConfig, train_candidate

    config = TrainConfig(
        dataset=dataset,
        model="logreg",
        target_epsilon=args.retrain_target,
        delta=args.delta,
        epochs=args.epochs,
        name="retrain",
    )
    data = load_dataset(dataset)
    start = time.perf_counter()
    train_candidate(config, data)
    here = time.perf_counter() - start
    with SyncPrefectClient(url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as client:
        deployment = client.read_deployment_by_name(RETRAIN_DEPLOYMENT)
        start = time.perf_counter()
        run = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "name": "retrain-bench",
                "dataset": dataset,
                "model": "logreg",
                "target_epsilon": args.retrain_target,
                "delta": args.delta,
                "epochs": args.epochs,
            },
        )
        while True:
            state = client.read_flow_run(run.id).state
            if state is not None and state.is_final():
                break
            time.sleep(0.25)
        stack = time.perf_counter() - start
    print(f"  retraining through {RETRAIN_DEPLOYMENT}: {state.name} in {stack:.1f} s")
    return here, stack


if __name__ == "__main__":
    sys.exit(main())
