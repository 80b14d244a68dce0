"""Retry and caching settings shared by the tasks."""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from dpmerge.errors import is_transient

RETRY_DELAYS = [1, 3, 10]


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only what the adapters raised as transient
    (``dpmerge.errors.is_transient``), never a refusal, a bad input or anything else."""
    try:
        state.result()
    except Exception as error:
        return is_transient(error)
    return False


REMOTE = {
    "retries": len(RETRY_DELAYS),
    "retry_delay_seconds": RETRY_DELAYS,
    "retry_condition_fn": retry_transient,
    "cache_policy": NO_CACHE,
    "persist_result": False,
}
"""Options of a task that talks to MLflow or S3: transient errors retried, nothing cached."""

LOCAL = {"cache_policy": NO_CACHE, "persist_result": False}
"""Options of a local computation: no retries (a retried RS merge would draw again)."""
