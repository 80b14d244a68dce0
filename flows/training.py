"""Training flows: ``train-candidates`` fans out one candidate per noise level (or target ε);
``train-candidate`` trains and registers one (the deployment the ``gpu`` pool runs).

By default the candidates train concurrently in this process (a thread pool; torch uses
``torch_threads`` threads each). With ``deployment`` set (e.g. ``train-candidate/gpu``), each
candidate becomes a run of that deployment instead, so every host running
``prefect worker start --pool gpu`` takes candidates; the parent waits for all of them and
reads what they registered from the registry.
"""

from __future__ import annotations

import inspect
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from dpmerge import policy_merge as pm
from dpmerge.training import RunOptions, TrainConfig, TrainingConfigError, declared_parameters
from flows.runtime import load_workflow_secret
from tasks import training as steps

TRAIN_FLOW = "train-candidates"
ONE_FLOW = "train-candidate"
GPU_DEPLOYMENT = f"{ONE_FLOW}/gpu"
CONCURRENCY_ENV = "DPMERGE_TRAIN_CONCURRENCY"


FLOW_DEFAULTS: dict[str, Any] = {"device": "auto"}
"""Where the flows' defaults differ from the declaration's: CUDA when the host has it."""
FAN_OUT_DEFAULTS: dict[str, Any] = {
    **FLOW_DEFAULTS,
    "dataset": "fashion-mnist",
    "model": "logreg",
}


def training_parameters(
    *,
    defaults: Mapping[str, Any],
    required: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a flow whose body takes ``**parameters`` the declared training parameters
    (``dpmerge.training.declared_parameters``) as keyword-only parameters after its own, with
    their types, defaults and help text, so Prefect validates, documents and shows them."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD]
        declared = [
            *declared_parameters(TrainConfig),
            *declared_parameters(RunOptions),
        ]
        added = []
        for p in declared:
            if p.name in exclude:
                continue
            default = defaults.get(p.name, p.default)
            if p.name in required or default is MISSING:
                default = inspect.Parameter.empty
            added.append(
                inspect.Parameter(
                    p.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=p.annotation
                )
            )
        fn.__signature__ = inspect.Signature([*own, *added])  # type: ignore[attr-defined]
        lines = [f"    {p.name}: {p.help}" for p in declared if p.name not in exclude]
        fn.__doc__ = f"{fn.__doc__}\n\nArgs:\n" + "\n".join(lines)
        return fn

    return wrap


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
        name = candidate_name(dataset, model, label)
        parameters = {"name": name, "dataset": dataset, "model": model, **fields, **options}
        specs.append(steps.CandidateSpec.from_parameters(parameters))
    return specs


@flow(name=ONE_FLOW, flow_run_name="train-{name}", persist_result=False)
@training_parameters(defaults=FLOW_DEFAULTS, required=("name",))
def train_candidate(**parameters: Any) -> dict[str, Any]:
    """Train one candidate and register it (the ``gpu`` pool's unit of work)."""
    spec = steps.CandidateSpec.from_parameters(parameters)
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
@training_parameters(
    defaults=FAN_OUT_DEFAULTS, exclude=("name", "noise_multiplier", "target_epsilon")
)
def train_candidates(
    noise_multipliers: list[float] | None = None,
    target_epsilons: list[float] | None = None,
    deployment: str | None = None,
    deployment_timeout_s: float | None = None,
    prime_merge_caches: bool = True,
    **parameters: Any,
) -> list[dict[str, Any]]:
    """Train and register one candidate per noise level (or target ε). In-process and
    concurrent by default (``$DPMERGE_TRAIN_CONCURRENCY`` threads, default 2); with
    ``deployment`` (e.g. ``train-candidate/gpu``) as runs of that deployment. Then, with
    ``prime_merge_caches``, this host's merge caches are filled (candidates, evaluation split,
    PLDs) so the first policy event is as quick as later ones. Every other parameter is a
    training parameter that all candidates share."""
    dataset, model = parameters.pop("dataset"), parameters.pop("model")
    specs = plan_candidates(dataset, model, noise_multipliers, target_epsilons, **parameters)
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
        steps.prime_caches(workspace, str(dataset), str(model))
    return result
