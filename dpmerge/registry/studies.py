"""Logging a study to MLflow (docs/design.md#studies, #registry): experiment
``dpmerge-studies``, one run per study invocation, ε and accuracy as metrics (one series per
method, the step is the point's index), the study's files as artifacts."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from dpmerge.registry.connection import MlflowConnection
from dpmerge.registry.errors import RegistryError

STUDIES_EXPERIMENT = "dpmerge-studies"
_BATCH = 900  # MLflow accepts at most 1000 metrics per log_batch call


def log_study(
    tracking_uri: str,
    study: str,
    params: Mapping[str, Any],
    metrics: Sequence[tuple[str, float, int]],
    files: Sequence[Path],
) -> str:
    """Create one finished run of ``study`` holding ``params``, ``metrics`` (key, value, step)
    and ``files``; returns the run id. A failure marks the run failed and raises
    :class:`RegistryError`."""
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    connection = MlflowConnection(tracking_uri, None)
    client = connection._client  # the registry package is the one door to MLflow
    run_id = None
    try:
        experiment = connection._experiment(STUDIES_EXPERIMENT, "studies")
        run = client.create_run(experiment, run_name=study, tags={"dp.study": study})
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        client.log_batch(
            run_id, params=[Param(str(k), str(v)[:6000]) for k, v in sorted(params.items())]
        )
        entries = [Metric(key, float(value), now, int(step)) for key, value, step in metrics]
        for start in range(0, len(entries), _BATCH):
            client.log_batch(run_id, metrics=entries[start : start + _BATCH])
        for path in files:
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
    except MlflowException as error:
        if run_id is not None:
            connection._end_run(run_id, "FAILED")
        raise RegistryError(f"logging study {study} to {tracking_uri}: {error.message}") from None
    return run_id
