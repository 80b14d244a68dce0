"""Training flows: ``train-candidates`` fans out one candidate per noise level (or target ε);
``train-candidate`` trains and registers one (the deployment the ``gpu`` pool runs).

By default the candidates train concurrently in this process (a thread pool; torch uses
``torch_threads`` threads each). With ``deployment`` set (e.g. ``train-candidate/gpu``), each
candidate becomes a run of that deployment instead, so every host running
``prefect worker start --pool gpu`` takes candidates; the parent waits for all of them and
reads what they registered from the registry.

Then the flow says what it spent: the registry it registered into, and each candidate's σ and ε
under PLD and RDP at δ (candidates' accuracies are internal, docs/design.md#rs-secrecy: they go
to the DEBUG log and the flow's result only, which is not persisted). And it runs
``pareto-report``, so a fresh stack has its privacy–utility frontier at once instead of after
the nightly schedule.
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
from dpmerge.accounting.delta import check_delta_against
from dpmerge.formatting import epsilon_text, number_text
from dpmerge.locate import Located
from dpmerge.training import RunOptions, TrainConfig, TrainingConfigError, declared_parameters
from tasks import imports as import_steps
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
    return f"{dataset}-{model.replace(':', '-')}-{level}-{secrets.token_hex(3)}"


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
def train_candidate(keep_last_epochs: int = 1, **parameters: Any) -> list[dict[str, Any]]:
    """Train one run and register the candidates it keeps (the ``gpu`` pool's unit of work):
    its final weights, or with ``keep_last_epochs`` N > 1 its weights at the end of each of its
    last N epochs (checkpoints of one run, which a merge counts once)."""
    spec = steps.CandidateSpec.from_parameters({**parameters, steps.KEEP: keep_last_epochs})
    workspace = pm.Workspace.from_env()
    workspace.use_caches()  # the candidate's PLD, computed for its record, is kept for merges
    scratch = workspace.scratch()
    try:
        return [steps.register(workspace, path) for path in steps.train(spec, str(scratch))]
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
    frontier_report: bool = True,
    keep_last_epochs: int = 1,
    imports: list[dict[str, str]] | None = None,
    **parameters: Any,
) -> dict[str, Any]:
    """Train and register one run per noise level (or target ε), each kept as one candidate
    or, with ``keep_last_epochs`` N > 1, as its last N epochs' checkpoints. In-process and
    concurrent by default (``$DPMERGE_TRAIN_CONCURRENCY`` threads, default 2); with
    ``deployment`` (e.g. ``train-candidate/gpu``) as runs of that deployment. Then, with
    ``prime_merge_caches``, this host's merge caches are filled (candidates, evaluation split,
    PLDs) so the first policy event is as quick as later ones, and with ``frontier_report``
    the ``pareto-report`` flow logs the frontier at the candidates' δ. Every other parameter is
    a training parameter that all candidates share. ``imports`` lists DP models trained
    elsewhere (``{"name", "weights", "profile", "attested_by"}`` each,
    docs/design.md#imported-candidates), imported for the same dataset and model and registered
    beside the trained ones. Returns the registry, each candidate's
    registration and privacy, and the frontier report (``None`` if it was not run or failed)."""
    dataset, model = parameters.pop("dataset"), parameters.pop("model")
    specs = plan_candidates(
        dataset,
        model,
        noise_multipliers,
        target_epsilons,
        **{**parameters, steps.KEEP: keep_last_epochs},
    )
    imported = [import_steps.ImportSpec.from_entry(entry) for entry in imports or []]
    logger = get_run_logger()
    workspace = pm.Workspace.from_env()
    workspace.use_caches()
    if deployment:
        logger.info("training %d candidates as runs of %s", len(specs), deployment)
        futures = [
            steps.run_training_deployment.submit(deployment, spec, deployment_timeout_s)
            for spec in specs
        ]
        names = [name for future in futures for name in future.result()]
        result = [steps.find_registered(workspace, name) for name in names]
    else:
        logger.info("training %d candidates in this process", len(specs))
        scratch = workspace.scratch()
        try:
            trained = [steps.train.submit(spec, str(scratch)) for spec in specs]
            paths = [path for future in trained for path in future.result()]
            registered = [steps.register.submit(workspace, path) for path in paths]
            result = [future.result() for future in registered]
        finally:
            pm.remove_tree(scratch)
    if imported:
        result += _imports(workspace, imported, str(dataset), str(model), specs[0], logger)
    if prime_merge_caches:
        steps.prime_caches(workspace, str(dataset), str(model), specs[0].options.data_root)
    located, delta = workspace.located(), specs[0].config.delta
    _log_summary(logger, located, result, delta)
    frontier = (
        _frontier(logger, str(dataset), str(model), delta, specs[0].options.data_root)
        if frontier_report
        else None
    )
    return {"registry": located.to_dict(), "candidates": result, "frontier": frontier}


def _imports(
    workspace: pm.Workspace,
    imported: list[import_steps.ImportSpec],
    dataset: str,
    model: str,
    spec: steps.CandidateSpec,
    logger: Any,
) -> list[dict[str, Any]]:
    """Import and register each entry of ``imports`` (docs/design.md#imported-candidates)."""
    logger.info("importing %d candidates trained elsewhere", len(imported))
    scratch = workspace.scratch()
    try:
        paths = [
            import_steps.import_one(
                entry,
                workspace,
                dataset=dataset,
                model=model,
                data_root=spec.options.data_root,
                limit=spec.options.limit,
                out_root=str(scratch),
                delta=spec.config.delta,
                model_path=spec.config.model_path,
                fix_model=spec.config.fix_model,
            )
            for entry in imported
        ]
        return [steps.register(workspace, path) for path in paths]
    finally:
        pm.remove_tree(scratch)


def _log_summary(logger: Any, located: Located, result: list[dict[str, Any]], delta: float) -> None:
    """What the candidates spent, one line each; their accuracies at DEBUG only (internal)."""
    logger.info("%d candidates registered; %s", len(result), located.describe())
    for c in sorted(result, key=lambda c: -(c["noise_multiplier"] or 0)):
        logger.info(
            "%s (%s v%s): σ = %.4g, ε = %s (PLD), %s (RDP) at δ = %g",
            c["name"],
            c["registered_model"],
            c["version"],
            c["noise_multiplier"] or float("nan"),
            epsilon_text(c.get("epsilon_pld")),
            epsilon_text(c.get("epsilon_rdp")),
            delta,
        )
        logger.debug(
            "%s: validation accuracy %s, test accuracy %s",
            c["name"],
            number_text(c.get("validation_accuracy")),
            number_text(c.get("test_accuracy")),
        )
    sizes = [c["dataset_size"] for c in result if c.get("dataset_size")]
    warning = check_delta_against(delta, min(sizes) if sizes else None).warning
    if warning:
        logger.warning(warning)


def _frontier(
    logger: Any, dataset: str, model: str, delta: float, data_root: str | None
) -> dict[str, Any] | None:
    """The ``pareto-report`` flow for the candidates just registered; its result, or ``None``
    (logged) if it failed: the candidates stay registered either way."""
    from flows.report import pareto_report

    state = pareto_report(
        dataset=dataset, model=model, delta=delta, data_root=data_root, return_state=True
    )
    if not state.is_completed():
        logger.warning(
            "the frontier report failed (%s); run the pareto-report deployment to retry",
            state.message,
        )
        return None
    report = state.result()
    logger.info("frontier logged to MLflow run %s (experiment dpmerge-reports)", report["run_id"])
    return report
