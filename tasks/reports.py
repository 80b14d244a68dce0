"""Report tasks: the privacy–utility frontier of the registered candidates, logged to MLflow."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from dpmerge import policy_merge as pm
from dpmerge.formatting import epsilon_text
from dpmerge.registry import RegisteredCandidate
from tasks.common import LOCAL, REMOTE

REPORT_EXPERIMENT = "dpmerge-reports"


def markdown_table(table: Any) -> str:
    """A Markdown table of a DataFrame (no optional dependency)."""

    def cell(column: str, value: Any) -> str:
        if column == "epsilon":  # a certified ε: rounded up, like everywhere else
            return epsilon_text(value)
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    columns = list(table.columns)
    rows = [columns] + [
        [cell(c, v) for c, v in zip(columns, row, strict=True)] for row in table.itertuples(False)
    ]
    lines = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(table.columns))
    return "\n".join(lines)


@task(name="compute-frontier", **LOCAL)
def compute_frontier(
    candidates: Sequence[RegisteredCandidate],
    data: pm.EvaluationData,
    targets: Sequence[float],
    delta: float,
    methods: Sequence[tuple[str, str]],
) -> Any:
    from dpmerge.studies.frontier import frontier

    start = time.perf_counter()
    table = frontier([c.model_dir for c in candidates], data, targets, delta, methods)
    get_run_logger().info(
        "frontier: %d rows over %d targets in %.1f s",
        len(table),
        len(targets),
        time.perf_counter() - start,
    )
    return table


@task(name="log-frontier", **REMOTE)
def log_frontier(
    workspace: pm.Workspace, pool: pm.CandidatePool, table: Any, title: str
) -> dict[str, Any]:
    """Plot the frontier and log PNG, CSV and Markdown to an MLflow run of
    ``dpmerge-reports``; returns the run id and the artifact names."""
    from dpmerge.studies.frontier import plot_frontier

    with tempfile.TemporaryDirectory(prefix="dpmerge-report-") as scratch:
        files = [
            plot_frontier(table, Path(scratch) / "frontier.png", title),
            Path(scratch) / "frontier.csv",
            Path(scratch) / "frontier.md",
        ]
        table.to_csv(files[1], index=False)
        files[2].write_text(f"# {title}\n\n{markdown_table(table)}\n")
        run_id = workspace.registry().log_report(
            REPORT_EXPERIMENT,
            run_name=f"pareto-{pool.registered_model}",
            tags={"dp.report": "pareto", "dp.dataset": pool.dataset, "dp.model": pool.model},
            params={"candidates": ",".join(pool.versions)},
            files=files,
        )
    get_run_logger().info("frontier logged to MLflow run %s", run_id)
    return {"run_id": run_id, "artifacts": [p.name for p in files], "rows": len(table)}
