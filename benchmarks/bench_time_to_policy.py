"""Time-to-policy: from an operator's policy change to its policy's alias serving the new
version's release, at the machine's own load and with a heavy test subset running beside it; beside
retraining the same model at a target.

Run: ``.venv/bin/python benchmarks/bench_time_to_policy.py [--changes 20]
[--phases idle,suite] [--warm-max-runs 4]``

It starts its own stack on free loopback ports (PostgreSQL; the dispatcher polling every
0.5 s, workers every 0.5 s), deploys ``merge-on-policy`` and ``train-candidate-gpu``, trains
and registers five logistic-regression candidates here and primes the merge caches as the
train-candidates flow does. Then, per phase, it changes the policy ``ttp`` one version at a
time as the operator role does (``dpmerge policy set``'s code path on a stack: a request in the
operator's inbox, which the dispatcher records as the next version; ε* runs through
``--targets``, each pass 1.1 % lower than the one before, so every version is a new target and
its run merges and registers a new release) and polls every 0.25 s (each poll reads the
store: a time is at most that much late) until the serving pointer records that version and
the MLflow alias names the version it serves. The
first change after the workers started also starts the warm flow-run process and is reported
apart. ``idle``: nothing else of ours runs. ``suite``: ``--suite`` (pytest files, each starting
its own servers) runs in a loop beside it, started ``--ramp`` seconds before the first change.
It prints each change (requested → run created, → alias), p50/p95 per phase with the load
averages, and retraining the model at ``--retrain-target`` in-process and as a
``train-candidate-gpu`` run on the stack, for the ratios. Figures: docs/results.md#scale-out;
the goal on the 2-core development machine is p95 ≤ 10 s idle and ≤ 20 s under the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import (
    REPO,
    deploy,
    load,
    local_stack,
    operator_store,
    percentile,
    pointer,
    policy_fields,
    releases_model,
    store_version,
    train_candidates,
    workflow_store,
)

RETRAIN_DEPLOYMENT = "train-candidate/train-candidate-gpu"
POLICY = "ttp"
POLL_S = 0.25
PASS_STEP = 0.011
"""Each pass over ``--targets`` is this much lower, so no version repeats a target."""
CHANGE_TIMEOUT_S = 300.0
OWN_SETTINGS = ("PREFECT_", "MLFLOW_", "DPMERGE_", "AWS_")
"""This process's stack settings, kept from the suite beside it."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=None, help="default: fashion-mnist, else digits")
    parser.add_argument("--sigmas", default="0.7,0.9,1.2,1.8,3.0", help="candidate σ levels")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--changes", type=int, default=20, help="measured changes per phase")
    parser.add_argument("--targets", default="3,0.5,1,1.5,2,2.5", help="ε* per pass")
    parser.add_argument("--phases", default="idle,suite")
    parser.add_argument("--suite", default="tests/test_policy_merge.py tests/test_registry.py")
    parser.add_argument("--ramp", type=float, default=45.0, help="suite start → first change")
    parser.add_argument("--retrain-target", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--warm-max-runs", type=int, default=None, help="flows/warm.py's cap")
    parser.add_argument("--state-dir", default=None, help="stack state, kept (default: temporary)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from flows.commands.policy_options import default_dataset

    dataset = args.dataset or default_dataset()
    env = {"DPMERGE_WARM_MAX_RUNS": str(args.warm_max_runs)} if args.warm_max_runs else {}
    with local_stack(args.state_dir, env) as config:
        deploy("merge-on-policy/merge-on-policy", RETRAIN_DEPLOYMENT)
        sigmas = [float(s) for s in args.sigmas.split(",")]
        candidates, _ = train_candidates(dataset, sigmas, args.epochs, args.delta)
        return measure(args, config, dataset, releases_model(candidates))


class Changes:
    """Stores versions of :data:`POLICY` and times each until its alias serves it."""

    def __init__(self, config: Any, dataset: str, releases: str, args: argparse.Namespace):
        from mlflow import MlflowClient

        self.operator = operator_store(config)
        self.workflow = workflow_store()
        self.mlflow = MlflowClient()
        self.dataset, self.releases, self.delta = dataset, releases, args.delta
        base = [float(t) for t in args.targets.split(",")]
        self.targets = (t * (1 - PASS_STEP * k) for k in itertools.count() for t in base)

    def one(self) -> dict[str, Any]:
        from dpmerge.state import policies

        target = next(self.targets)
        start = time.perf_counter()
        version = store_version(
            self.operator, POLICY, policy_fields(self.dataset, target, self.delta)
        )
        dispatched = served = None
        while time.perf_counter() - start < CHANGE_TIMEOUT_S:
            now = time.perf_counter() - start
            if dispatched is None and policies.dispatched(self.operator, POLICY, version):
                dispatched = now
            state = pointer(self.workflow, self.releases, f"policy-{POLICY}")
            if state is not None and state.policy_version == version and state.serving:
                aliases = self.mlflow.get_registered_model(self.releases).aliases
                if str(aliases.get(f"policy-{POLICY}")) == state.serving:
                    served = time.perf_counter() - start
                    break
            time.sleep(POLL_S)
        found = policies.outcomes(self.operator, POLICY, version)
        status = found[-1].get("status") if found else "none"
        print(
            f"  v{version} ε* = {target:g}: run created after {_seconds(dispatched)}, alias "
            f"serving it after {_seconds(served)} ({status})"
        )
        return {"version": version, "target": target, "dispatched": dispatched, "served": served}


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def measure(args: argparse.Namespace, config: Any, dataset: str, releases: str) -> int:
    changes = Changes(config, dataset, releases, args)
    print(f"first change after the workers started (also starts the warm process); {load()}")
    first = changes.one()
    figures: dict[str, Any] = {"first_change_s": first["served"], "phases": {}}
    complete = first["served"] is not None
    for phase in args.phases.split(","):
        with suite_beside(args) if phase == "suite" else contextlib.nullcontext():
            before = load()
            print(f"phase {phase}: {args.changes} changes; before: {before}")
            timed = [changes.one() for _ in range(args.changes)]
            after = load()
        served = [t["served"] for t in timed if t["served"] is not None]
        complete &= len(served) == len(timed)
        summary = {
            "p50_s": statistics.median(served) if served else None,
            "p95_s": percentile(served, 0.95) if served else None,
            "max_s": max(served, default=None),
            "dispatch_p50_s": statistics.median(
                [t["dispatched"] for t in timed if t["dispatched"] is not None] or [float("nan")]
            ),
            "changes": len(timed),
            "never": len(timed) - len(served),
            "load_before": before,
            "load_after": after,
        }
        figures["phases"][phase] = summary
        print(
            f"phase {phase}: requested → alias p50 {summary['p50_s']:.1f} s, p95 "
            f"{summary['p95_s']:.1f} s, max {summary['max_s']:.1f} s over {len(served)} changes "
            f"({summary['never']} never); requested → run created p50 "
            f"{summary['dispatch_p50_s']:.1f} s; {before} before, {after} after"
        )
    here, on_stack = retrain(args, config, dataset)
    figures |= {"retrain_in_process_s": here, "retrain_on_stack_s": on_stack}
    idle = figures["phases"].get("idle", {}).get("p50_s")
    if idle:
        print(
            f"ratio retraining / time-to-policy (idle p50 {idle:.1f} s): "
            f"{here / idle:.2f} in-process, {on_stack / idle:.2f} on the stack"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if complete else 1


@contextlib.contextmanager
def suite_beside(args: argparse.Namespace) -> Iterator[None]:
    """``--suite`` in a loop in the background (each pass starts its own servers); stopped
    with SIGINT so its fixtures stop their stacks, then any stack it left is stopped."""
    import devstack

    scratch = Path(tempfile.mkdtemp(prefix="dpmerge-bench-suite-"))
    stop = threading.Event()
    current: list[subprocess.Popen] = []
    passes: list[int] = []

    clean = {k: v for k, v in os.environ.items() if not k.startswith(OWN_SETTINGS)}

    def loop() -> None:
        while not stop.is_set():
            process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
                    *("--basetemp", str(scratch / f"pass-{len(passes)}"), *args.suite.split()),
                ],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=clean,  # the tests start their own servers, with their own settings
            )
            current[:] = [process]
            passes.append(process.wait())

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    print(f"suite running beside: pytest {args.suite}; waiting {args.ramp:.0f} s; {load()}")
    time.sleep(args.ramp)
    try:
        yield
    finally:
        stop.set()
        for process in current:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
        thread.join(timeout=180)
        for saved in scratch.rglob("stack.json"):
            config = devstack.StackConfig.load(saved.parent)
            if config is not None:
                devstack.down(config)
        print(f"suite passes finished beside the changes: {len(passes)} (exit codes {passes})")


def retrain(args: argparse.Namespace, config: Any, dataset: str) -> tuple[float, float]:
    """Seconds to retrain the model at ``--retrain-target``: in this process, and as a run of
    the training deployment on the stack (run created → registered)."""
    from prefect.client.orchestration import SyncPrefectClient

    from dpmerge.data import load_dataset
    from dpmerge.training import TrainConfig, train_candidate

    train = TrainConfig(
        dataset=dataset,
        model="logreg",
        target_epsilon=args.retrain_target,
        delta=args.delta,
        epochs=args.epochs,
        name="retrain",
    )
    data = load_dataset(dataset)
    start = time.perf_counter()
    train_candidate(train, data)
    here = time.perf_counter() - start
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    with SyncPrefectClient(config.prefect_api_url, auth_string=auth) as client:
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
        on_stack = time.perf_counter() - start
    print(
        f"retraining at ε* = {args.retrain_target:g}: {here:.1f} s in-process, {on_stack:.1f} s "
        f"through {RETRAIN_DEPLOYMENT} ({state.name}); {load()}"
    )
    return here, on_stack


if __name__ == "__main__":
    sys.exit(main())
