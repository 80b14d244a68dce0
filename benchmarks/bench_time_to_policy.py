"""Time-to-policy: from emitting ``dpmerge.policy.updated`` to the policy's alias naming the new
merged release, against retraining the same model at the target.

Run: ``.venv/bin/python benchmarks/bench_time_to_policy.py [--dataset fashion-mnist]
[--targets 0.5,1,1.5,2,3] [--epochs 3]``

It starts its own local stack on free loopback ports (moto S3, MLflow on S3, Prefect server
and workers polling every second, requeue wait 1 s), deploys ``merge-on-policy/cpu`` from
deployments/prefect.yaml, trains and registers logistic-regression candidates here (timing each
one: the retraining reference), primes the merge caches as the train-candidates flow does
(``--cold`` skips that), then emits one policy event per target, one after another, and
polls the registry alias every 0.1 s. Finally it retrains one model at a target ε (σ calibrated
to it, the same epochs) for the ratio. Workers are stopped before servers at the end. Figures
are recorded in docs/workflow.md. The target on the 2-core development machine is ≤ 15 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {
    "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def task_breakdown(config, flow_run_id) -> list[tuple[str, float]]:
    """(task name, seconds) of a flow run's task runs, in start order."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with SyncPrefectClient(config.prefect_api_url) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    timed = [r for r in runs if r.start_time and r.end_time]
    timed.sort(key=lambda r: r.start_time)
    return [(r.name.rsplit("-", 1)[0], (r.end_time - r.start_time).total_seconds()) for r in timed]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=None, help="default: fashion-mnist, else digits")
    parser.add_argument("--sigmas", default="0.7,0.9,1.2,1.8,3.0", help="candidate σ levels")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--targets", default="0.5,1,1.5,2,3", help="policy ε* per event")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--state-dir", default=None, help="stack state, kept (default: temporary)")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="skip priming the merge caches (the first event then builds them)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.update(SERVER_ENV)
    scratch = Path(args.state_dir or tempfile.mkdtemp(prefix="dpmerge-bench-"))
    os.environ["DPMERGE_HOME"] = str(scratch / "home")

    import torch

    from dpmerge import stack
    from flows.commands.policy_options import default_dataset

    dataset = args.dataset or default_dataset()
    s3_port, mlflow_port, prefect_port = free_ports(3)
    config = stack.StackConfig(
        state_dir=scratch / "stack",
        s3_port=s3_port,
        mlflow_port=mlflow_port,
        prefect_port=prefect_port,
    )
    print(f"stack in {config.state_dir}; dataset {dataset}; 2 cores, torch threads 1")
    start = time.perf_counter()
    stack.up(config)
    print(f"stack up in {time.perf_counter() - start:.1f} s")
    try:
        os.environ.update(config.client_env())
        return run(args, config, dataset, torch)
    finally:
        stopped = stack.down(config)
        print("stopped:", ", ".join(stopped))
        if args.state_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, config, dataset: str, torch) -> int:
    from mlflow import MlflowClient

    from dpmerge.data import load_dataset
    from dpmerge.policies import policy_from_dict
    from dpmerge.registry import Registry
    from dpmerge.training import TrainConfig, save_candidate, train_candidate
    from flows import runtime

    torch.set_num_threads(1)
    start = time.perf_counter()
    deployed = subprocess.run(
        [
            *(str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy"),
            *("--name", "merge-on-policy/cpu", "--prefect-file", "deployments/prefect.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if deployed.returncode != 0:
        print(deployed.stdout[-3000:], deployed.stderr[-3000:])
        return 1
    print(f"deployed merge-on-policy/cpu in {time.perf_counter() - start:.1f} s")

    data = load_dataset(dataset)
    registry = Registry(config.mlflow_url)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    train_seconds = []
    with tempfile.TemporaryDirectory(prefix="dpmerge-bench-cands-") as root:
        for sigma in sigmas:
            cfg = TrainConfig(
                dataset=dataset,
                model="logreg",
                noise_multiplier=sigma,
                epochs=args.epochs,
                name=f"{dataset}-logreg-s{sigma:g}",
                delta=args.delta,
            )
            t0 = time.perf_counter()
            result = train_candidate(cfg, data)
            train_seconds.append(time.perf_counter() - t0)
            path = save_candidate(result, Path(root) / cfg.name, args.delta)
            registered = registry.register_candidate(path)
            print(
                f"  candidate σ = {sigma:g}: trained in {train_seconds[-1]:.1f} s, "
                f"test accuracy {result.metrics['test_accuracy']:.4f}, v{registered.version}"
            )

    if not args.cold:  # what the train-candidates flow does once its candidates are registered
        from dpmerge import policy_merge as pm

        t0 = time.perf_counter()
        pm.prime_caches(pm.Workspace.from_env(), dataset, "logreg")
        print(f"merge caches primed in {time.perf_counter() - t0:.1f} s")

    client = MlflowClient(config.mlflow_url)
    merged = f"{registered.name}-merged"

    def alias_version() -> str | None:
        try:
            aliases = client.get_registered_model(merged).aliases
        except Exception:
            return None
        return str(aliases["policy-bench"]) if "policy-bench" in aliases else None

    rows = []
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
        t0 = time.perf_counter()
        event_id = runtime.emit_policy_event(policy.event_payload(), policy.resource_id, "bench")
        moved = None
        while time.perf_counter() - t0 < 300:
            current = alias_version()
            if current is not None and current != before:
                moved = time.perf_counter() - t0
                break
            time.sleep(0.25)
        emitted = time.time() - (time.perf_counter() - t0)
        run = runtime.wait_for_policy_run(event_id, 300)
        state = run.state.name if run is not None and run.state else "no run"
        phases = ""
        if run is not None and run.start_time is not None:
            created = run.created.timestamp() - emitted
            running = run.start_time.timestamp() - emitted
            phases = f" [run created +{created:.1f} s, flow code running +{running:.1f} s]"
        tags = client.get_model_version(merged, alias_version()).tags if moved else {}
        rows.append((target, moved, state, tags))
        if run is not None:
            steps = task_breakdown(config, run.id)
        print(
            f"  ε* = {target:g}: alias moved after "
            f"{f'{moved:.1f} s' if moved else 'never'} ({state}); "
            f"{tags.get('dp.method', '-')} ε = {float(tags.get('dp.epsilon', 'nan')):.4f}, "
            f"test accuracy {float(tags.get('dp.accuracy', 'nan')):.4f}{phases}"
        )
        if run is not None:
            print("      tasks: " + ", ".join(f"{name} {sec:.2f}" for name, sec in steps))

    retrain_target = float(args.targets.split(",")[-2 if "," in args.targets else -1])
    cfg = TrainConfig(
        dataset=dataset,
        model="logreg",
        target_epsilon=retrain_target,
        delta=args.delta,
        epochs=args.epochs,
        name="retrain",
    )
    t0 = time.perf_counter()
    retrained = train_candidate(cfg, data)
    retrain_seconds = time.perf_counter() - t0

    times = [m for _, m, _, _ in rows if m is not None]
    print("\nsummary")
    print(
        f"  candidates: {len(sigmas)} × {args.epochs} epochs, training {train_seconds[0]:.1f}–"
        f"{max(train_seconds):.1f} s each ({sum(train_seconds):.1f} s in all)"
    )
    if times:
        print(
            f"  time to policy (emit → alias moved): median {statistics.median(times):.1f} s, "
            f"min {min(times):.1f} s, max {max(times):.1f} s over {len(times)} events"
        )
    print(
        f"  retraining at ε* = {retrain_target:g} (σ calibrated, {args.epochs} epochs): "
        f"{retrain_seconds:.1f} s, test accuracy {retrained.metrics['test_accuracy']:.4f}"
    )
    if times:
        print(
            f"  ratio retraining / time-to-policy (median): "
            f"{retrain_seconds / statistics.median(times):.2f}"
        )
    return 0 if len(times) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
