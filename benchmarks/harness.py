"""What the workflow benchmarks share: a local stack on free loopback ports (PostgreSQL), the
deployments applied, candidates trained and registered here, policy versions stored as an
operator stores them, and the state the workflow leaves (dispatch records, outcomes, serving
pointers, MLflow aliases, flow runs) read back."""

from __future__ import annotations

import math
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
LOCKED = "database is locked"


@contextmanager
def local_stack(state_dir: str | None, env: dict[str, str]) -> Iterator[Any]:
    """A new stack on free ports (its services and workers get ``env`` too), this process the
    workflow role (the key read from its file, as the workers read it); stopped
    (workers first) and removed afterwards unless ``state_dir`` keeps it."""
    import devstack as stack

    os.environ.update({**SERVER_ENV, **env})
    os.environ.pop("DPMERGE_SECRET_KEY", None)  # the stack's key, from its file
    scratch = Path(state_dir or tempfile.mkdtemp(prefix="dpmerge-bench-"))
    os.environ["DPMERGE_HOME"] = str(scratch / "home")
    config = stack.StackConfig.on_free_ports(scratch / "stack")
    start = time.perf_counter()
    stack.up(config)
    print(f"stack up in {time.perf_counter() - start:.1f} s ({config.state_dir}); {load()}")
    try:
        os.environ.update(config.client_env())
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        # Prefect read its settings when it was imported: point them at this stack
        auth = os.environ["PREFECT_API_AUTH_STRING"]
        with temporary_settings(
            {PREFECT_API_URL: config.prefect_api_url, PREFECT_API_AUTH_STRING: auth}
        ):
            yield config
    finally:
        print("stopped:", ", ".join(stack.down(config)))
        if state_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


def load() -> str:
    """The load averages, as the figures print them."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min, {os.cpu_count()} cores)"


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
    dataset: str, sigmas: list[float], epochs: int, delta: float
) -> tuple[str, list[float]]:
    """Train and register one logistic-regression candidate per σ in this process, then fill
    the merge caches (the workers share ``$DPMERGE_HOME``), as the train-candidates flow does
    once its candidates are registered. The candidates' registered model and each training's
    seconds."""
    import torch

    from dpmerge import policy_merge as pm
    from dpmerge.data import load_dataset
    from dpmerge.training import TrainConfig, save_candidate, train_candidate

    torch.set_num_threads(1)
    data = load_dataset(dataset)
    registry = pm.Workspace.from_env().registry()
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
            registered = registry.register_candidate(
                save_candidate(result, Path(root) / config.name, delta)
            )
            name = registered.name
            print(
                f"  candidate σ = {sigma:g}: trained in {seconds[-1]:.1f} s, v{registered.version}"
            )
    start = time.perf_counter()
    pm.prime_caches(pm.Workspace.from_env(), dataset, "logreg")
    print(f"merge caches primed in {time.perf_counter() - start:.1f} s")
    return name, seconds


def operator_store(config: Any) -> Any:
    """The release-state store as the operator role reaches it (its own S3 key, no workflow
    key): where ``dpmerge policy set`` stores policy versions."""
    from devstack import credentials
    from devstack.roles import s3_config_for
    from dpmerge.state import StateStore
    from dpmerge.state.backend import S3Backend
    from dpmerge.storage import S3Store

    creds = credentials.require(config.state_dir)
    return StateStore(S3Backend(S3Store(s3_config_for(config, creds, "operator"))))


def workflow_store() -> Any:
    """The release-state store with the workflow's key (signed documents verified)."""
    from dpmerge import policy_merge as pm

    return pm.Workspace.from_env().state()


def store_version(store: Any, name: str, fields: dict[str, Any]) -> int:
    """Store a new version of policy ``name`` as ``dpmerge policy set`` does on a stack (a new
    version even when the fields equal the stored ones: each call is a change to apply): a
    request in the operator's inbox, recorded by the workflow's dispatcher, which the call
    waits for (the operator may write nothing else: dpmerge/state/inbox.py). The version's
    number."""
    from dpmerge.state import inbox

    key = inbox.submit_policy(store, name, fields, source="benchmark", rerun=True)
    handled = inbox.wait(store, key)
    if handled.get("status") != "applied":
        raise RuntimeError(f"request {key} was not applied: {handled}")
    return int(handled["version"])


def policy_fields(dataset: str, target: float, delta: float) -> dict[str, Any]:
    return {
        "target_epsilon": target,
        "target_delta": delta,
        "dataset": dataset,
        "model": "logreg",
    }


def pointer(store: Any, model: str, alias: str) -> Any:
    """The serving pointer of ``model@alias`` (``None``: none yet)."""
    from dpmerge.state import serving

    for dataset in serving.datasets(store):
        found = serving.read_state(store, dataset).alias(model, alias)
        if found is not None:
            return found
    return None


def releases_model(candidates_model: str) -> str:
    from dpmerge.registry.names import CANDIDATES_SUFFIX, RELEASES_SUFFIX

    return candidates_model.removesuffix(f"-{CANDIDATES_SUFFIX}") + f"-{RELEASES_SUFFIX}"


def flow_runs(config: Any, ids: list[str]) -> dict[str, Any]:
    """The flow runs with these ids."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    found: dict[str, Any] = {}
    with SyncPrefectClient(config.prefect_api_url, auth_string=auth) as client:
        for start in range(0, len(ids), 200):
            page = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[start : start + 200])),
                limit=200,
            )
            found |= {str(run.id): run for run in page}
    return found


def locked_lines(config: Any) -> int:
    """Lines saying ``database is locked`` in every log of the stack."""
    return sum(
        path.read_text(errors="replace").count(LOCKED)
        for path in config.logs_dir.glob("*.log*")
        if path.is_file()
    )


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in 0–1)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]
