"""``pareto-report``: recompute the privacy–utility frontier of the registered candidates
(RS and LC merges calibrated at a grid of targets, beside the candidates) and log the plot,
CSV and Markdown table to MLflow (experiment ``dpmerge-reports``). Scheduled nightly in
deployments/prefect.yaml. Internal: it shows every candidate's accuracy."""

from __future__ import annotations

import math
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from dpmerge import policy_merge as pm
from dpmerge.accounting.candidate import candidate_bound
from dpmerge.studies.frontier import LC_GENERIC, LC_STRUCTURED, RS
from tasks import policy as policy_steps
from tasks import reports as steps

FLOW_NAME = "pareto-report"
DEFAULT_METHODS = (RS, LC_GENERIC)


def default_targets(epsilons: list[float], count: int = 6) -> list[float]:
    """A geometric grid from the most private candidate's ε to twice the least private's."""
    low, high = min(epsilons), 2 * max(epsilons)
    if count < 2 or high <= low:
        return [low]
    ratio = (high / low) ** (1 / (count - 1))
    return [low * 1.001 * ratio**i for i in range(count)]


@flow(name=FLOW_NAME, persist_result=False)
def pareto_report(
    dataset: str = "fashion-mnist",
    model: str = "logreg",
    targets: list[float] | None = None,
    delta: float = 1e-5,
    structured: bool = False,
    data_root: str | None = None,
) -> dict[str, Any]:
    """Frontier at ``targets`` (default: 6 points from the most private candidate's ε to twice
    the least private's) for RS and generic LC (and structured LC with ``structured``), on the
    held-out rows read from ``data_root`` (as in training)."""
    workspace = pm.Workspace.from_env()
    workspace.use_caches()
    workdir = workspace.scratch()
    try:
        pool = policy_steps.find_candidates(workspace, dataset, model)
        candidates = policy_steps.load_candidates(workspace, pool, str(workdir))
        first = candidates[0].model_dir.record
        data = policy_steps.load_evaluation_data(  # by the internal fingerprint
            workspace, first.dataset, getattr(first, "dataset_size", None), data_root
        )
        if not targets:
            epsilons = [candidate_bound(c.model_dir.record, delta).epsilon for c in candidates]
            targets = default_targets([e for e in epsilons if math.isfinite(e)])
        methods = (*DEFAULT_METHODS, *((LC_STRUCTURED,) if structured else ()))
        table = steps.compute_frontier(candidates, data, targets, delta, methods)
        title = f"{pool.registered_model}: accuracy vs certified ε (δ = {delta:g})"
        logged = steps.log_frontier(workspace, pool, table, title)
        create_markdown_artifact(
            markdown=f"# {title}\n\nMLflow run `{logged['run_id']}`\n\n"
            + steps.markdown_table(table),
            key="pareto-report",
            description="dpmerge privacy–utility frontier",
        )
        return {**logged, "targets": list(targets), "registered_model": pool.registered_model}
    finally:
        pm.remove_tree(workdir)
