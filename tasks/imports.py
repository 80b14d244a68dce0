"""The import task: a DP model trained elsewhere becomes a candidate directory, attested and
signed by the workflow identity (docs/design.md#imported-candidates); the flow registers it
like a trained one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from dpmerge import policy_merge as pm
from dpmerge.errors import InputError
from dpmerge.importing import import_candidate, importer_key
from dpmerge.models import model_spec
from tasks.common import LOCAL
from tasks.training import data_splits


@dataclass(frozen=True)
class ImportSpec:
    """One entry of the ``imports`` flow parameter: the files and who attests the profile."""

    name: str
    weights: str
    profile: str
    attested_by: str

    @classmethod
    def from_entry(cls, entry: Any) -> ImportSpec:
        """Strictly: a mapping with exactly these keys, each a non-empty string."""
        names = [f.name for f in fields(cls)]
        if not isinstance(entry, Mapping) or sorted(entry) != sorted(names):
            raise InputError(f"an imports entry must be an object with keys {', '.join(names)}")
        bad = next((k for k in names if not isinstance(entry[k], str) or not entry[k]), None)
        if bad is not None:
            raise InputError(f"imports entry {bad!r} must be a non-empty string")
        return cls(**{k: entry[k] for k in names})


@task(name="import-candidate", task_run_name="import-{spec.name}", **LOCAL)
def import_one(
    spec: ImportSpec,
    workspace: pm.Workspace,
    *,
    dataset: str,
    model: str,
    data_root: str | None,
    limit: int | None,
    out_root: str,
    delta: float,
    model_path: str | None = None,
    fix_model: bool = False,
) -> str:
    """Check and write one import as a candidate directory (a factory ``model`` found under
    ``model_path``, as in training); returns its path."""
    data = data_splits(dataset, data_root, limit)
    result = import_candidate(
        spec.weights,
        spec.profile,
        spec=model_spec(model, data, model_path=model_path, fix=fix_model),
        data=data,
        name=spec.name,
        attested_by=spec.attested_by,
        key=importer_key(workspace),
        out_dir=Path(out_root) / spec.name,
        delta=delta,
    )
    get_run_logger().info(
        "imported %s (%s weights, %s profile), attested by %s",
        spec.name,
        result.weights_format.value,
        result.profile.value,
        spec.attested_by,
    )
    return str(result.path)
