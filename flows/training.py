"""Training flows: ``train-candidates`` fans out one candidate per noise level (or target ε);
``train-candidate`` trains and registers one (the deployment the ``gpu`` pool runs).

By default the candidates train concurrently in this process (a thread pool; torch uses
``torch_threads`` threads each). With ``deployment`` set (e.g. ``train-candidate/gpu``), each
candidate becomes a run of that deployment instead, so every host running
``prefect worker start --pool gpu`` takes candidates; the parent waits for all of them and
reads what they registered from the registry.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from dpmerge import policy_merge as pm
from dpmerge.training import TrainingConfigError
from flows.runtime import load_workflow_secret
from tasks import training as steps

TRAIN_FLOW = "train-candidates"
ONE_FLOW = "train-candidate"
GPU_DEPLOYMENT = f"{ONE_FLOW}/gpu"
CONCURRENCY_ENV = "DPMERGE_TRAIN_CONCURRENCY"


def candidate_name(dataset: str, model: str, level: str) -> str:
    return f"{dataset}-{model}-{level}-{secrets.token_hex(3)}"


def plan_candidates(
    dataset: str,
    model: str,
    noise_multipliers: Sequence[float] | None,
    target_epsilons: Sequence[float] | None,
    **options: Any,
) -> list[steps.CandidateSpec]:
    """One :class:`CandidateSpec` per noise level or target ε (exactly one list given)."""
    if (noise_multipliers is None) == (target_epsilons is None):
        raise TrainingConfigError("give exactly one of noise_multipliers and target_epsilons")
    levels = list(noise_multipliers or target_epsilons or [])
    if not levels:
        raise TrainingConfigError("no noise level or target ε given")
    specs = []
    for level in levels:
        if noise_multipliers is not None:
            label, fields = f"s{level:g}", {"noise_multiplier": float(level)}
        else:
            label, fields = f"e{level:g}", {"target_epsilon": float(level)}
        specs.append(
            steps.CandidateSpec(
                name=candidate_name(dataset, model, label),
                dataset=dataset,
                model=model,
                **fields,
                **options,
            )
        )
    return specs


@flow(name=ONE_FLOW, flow_run_name="train-{name}", persist_result=False)
def train_candidate(
    name: str,
    dataset: str,
    model: str,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    delta: float = 1e-5,
    epochs: int = 1,
    batch_size: int = 256,
    learning_rate: float | None = None,
    limit: int | None = None,
    data_root: str | None = None,
    device: str = "auto",
    torch_threads: int = 1,
) -> dict[str, Any]:
    """Train one candidate and register it (the ``gpu`` pool's unit of work)."""
    spec = steps.CandidateSpec(
        name=name,
        dataset=dataset,
        model=model,
        noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon,
        delta=delta,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        limit=limit,
        data_root=data_root,
        device=device,
        torch_threads=torch_threads,
    )
    load_workflow_secret()  # registration signs the candidate's record
    workspace = pm.Workspace.from_env()
    workspace.use_caches()  # the candidate's PLD, computed for its record, is kept for merges
    scratch = workspace.scratch()
    try:
        path = steps.train(spec, str(scratch))
        return steps.register(workspace, path)
    finally:
        pm.remove_tree(scratch)


@flow(
    name=TRAIN_FLOW,
    persist_result=False,
    task_runner=ThreadPoolTaskRunner(max_workers=int(os.environ.get(CONCURRENCY_ENV, "2"))),
)
def train_candidates(
    dataset: str = "fashion-mnist",
    model: str = "logreg",
    noise_multipliers: list[float] | None = None,
    target_epsilons: list[float] | None = None,
    delta: float = 1e-5,
    epochs: int = 1,
    batch_size: int = 256,
    learning_rate: float | None = None,
    limit: int | None = None,
    data_root: str | None = None,
    device: str = "auto",
    torch_threads: int = 1,
    deployment: str | None = None,
    deployment_timeout_s: float | None = None,
    prime_merge_caches: bool = True,
) -> list[dict[str, Any]]:
    """Train and register one candidate per noise level (or target ε). In-process and
    concurrent by default (``$DPMERGE_TRAIN_CONCURRENCY`` threads, default 2); with
    ``deployment`` (e.g. ``train-candidate/gpu``) as runs of that deployment. Then, with
    ``prime_merge_caches``, this host's merge caches are filled (candidates, evaluation split,
    PLDs) so the first policy event is as quick as later ones."""
    specs = plan_candidates(
        dataset,
        model,
        noise_multipliers,
        target_epsilons,
        delta=delta,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        limit=limit,
        data_root=data_root,
        device=device,
        torch_threads=torch_threads,
    )
    logger = get_run_logger()
    load_workflow_secret()
    workspace = pm.Workspace.from_env()
    workspace.use_caches()
    if deployment:
        logger.info("training %d candidates as runs of %s", len(specs), deployment)
        futures = [
            steps.run_training_deployment.submit(deployment, spec, deployment_timeout_s)
            for spec in specs
        ]
        names = [future.result() for future in futures]
        result = [steps.find_registered(workspace, name) for name in names]
    else:
        logger.info("training %d candidates in this process", len(specs))
        scratch = workspace.scratch()
        try:
            trained = [steps.train.submit(spec, str(scratch)) for spec in specs]
            registered = [steps.register.submit(workspace, path) for path in trained]
            result = [future.result() for future in registered]
        finally:
            pm.remove_tree(scratch)
    if prime_merge_caches:
        steps.prime_caches(workspace, dataset, model)
    return result
