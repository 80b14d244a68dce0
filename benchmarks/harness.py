"""What the workflow benchmarks share: a local stack on free loopback ports (or the one this
shell points at), the deployments applied, candidates trained and registered here, and the
runs of ``merge-on-policy`` read back from Prefect."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpmerge.environment import QUIET, TELEMETRY_OFF

REPO = Path(__file__).resolve().parents[1]
SERVER_ENV = {**TELEMETRY_OFF, **QUIET}


@contextmanager
def local_stack(state_dir: str | None, reuse: bool) -> Iterator[str]:
    """The Prefect API URL of a stack: this shell's (``reuse``, after
    ``eval "$(dpmerge stack env)"``), or a new one on free ports, stopped (workers first) and
    removed afterwards unless ``state_dir`` keeps it."""
    os.environ.update(SERVER_ENV)
    if reuse:
        yield os.environ["PREFECT_API_URL"]
        return
    import devstack as stack

    scratch = Path(state_dir or tempfile.mkdtemp(prefix="dpmerge-bench-"))
    os.environ["DPMERGE_HOME"] = str(scratch / "home")
    config = stack.StackConfig.on_free_ports(scratch / "stack")
    start = time.perf_counter()
    stack.up(config)
    print(f"stack up in {time.perf_counter() - start:.1f} s ({config.state_dir})")
    try:
        os.environ.update(config.client_env())
        yield config.prefect_api_url
    finally:
        print("stopped:", ", ".join(stack.down(config)))
        if state_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def deploy(*names: str) -> None:
    """Apply the named deployments of deployments/prefect.yaml (``flow/deployment``)."""
    start = time.perf_counter()
    flags = [arg for name in names for arg in ("--name", name)]
    done = subprocess.run(
        [
            *(str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", *flags),
            *("--prefect-file", "deployments/prefect.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    print(f"deployed {', '.join(names)} in {time.perf_counter() - start:.1f} s")


def train_candidates(
    dataset: str, sigmas: list[float], epochs: int, delta: float, *, prime: bool = True
) -> tuple[str, list[float]]:
    """Train and register one logistic-regression candidate per σ in this process; the
    candidates' registered model and each training's seconds. Then (``prime``) fill the merge
    caches, as the train-candidates flow does once its candidates are registered."""
    import torch

    from dpmerge import policy_merge as pm
    from dpmerge.data import load_dataset
    from dpmerge.registry import Registry
    from dpmerge.training import TrainConfig, save_candidate, train_candidate

    torch.set_num_threads(1)
    data = load_dataset(dataset)
    registry = Registry(os.environ["MLFLOW_TRACKING_URI"])
    seconds, name = [], ""
    with tempfile.TemporaryDirectory(prefix="dpmerge-bench-cands-") as root:
        for sigma in sigmas:
            config = TrainConfig(
                dataset=dataset,
                model="logreg",
                noise_multiplier=sigma,
                epochs=epochs,
                name=f"{dataset}-logreg-s{sigma:g}",
                delta=delta,
            )
            start = time.perf_counter()
            result = train_candidate(config, data)
            seconds.append(time.perf_counter() - start)
            path = save_candidate(result, Path(root) / config.name, delta)
            registered = registry.register_candidate(path)
            name = registered.name
            print(
                f"  candidate σ = {sigma:g}: trained in {seconds[-1]:.1f} s, test accuracy "
                f"{result.metrics['test_accuracy']:.4f}, v{registered.version}"
            )
    if prime:
        start = time.perf_counter()
        pm.prime_caches(pm.Workspace.from_env(), dataset, "logreg")
        print(f"merge caches primed in {time.perf_counter() - start:.1f} s")
    return name, seconds


def policy_runs(url: str, since: Any = None) -> list[Any]:
    """Every ``merge-on-policy`` run (created after ``since``), oldest first."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    run_filter = (
        FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since))
        if since is not None
        else None
    )
    found: list[Any] = []
    with SyncPrefectClient(url, auth_string=os.environ.get("PREFECT_API_AUTH_STRING")) as client:
        while True:
            page = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["merge-on-policy"])),
                flow_run_filter=run_filter,
                sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                limit=200,
                offset=len(found),
            )
            found += page
            if len(page) < 200:
                return found
