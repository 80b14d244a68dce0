"""The console script in a fresh process, as a user's shell runs it: an environment that
points at no registry, server or state of this session (nothing under ``tmp_path`` exists)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fresh_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without Prefect, MLflow tracking or dpmerge settings, with
    the repository importable, telemetry off, and the local stack's state directory and the
    embedded state under ``tmp_path`` (absent until a command creates them)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_TRACKING", "DPMERGE_"))
    }
    return env | {
        "PYTHONPATH": str(REPO),
        "DPMERGE_STACK_DIR": str(tmp_path / "no-stack"),
        "DPMERGE_HOME": str(tmp_path / "home"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
