"""Who may read what the workflow creates in MLflow (docs/design.md#registry).

With MLflow's auth app the creator of an experiment or registered model gets MANAGE and nobody
else anything. ``$DPMERGE_MLFLOW_READERS`` names, per experiment, the users who get READ on it
when the registry creates it, and on the registered models whose versions' runs live in it
(candidates: ``dpmerge-candidates``; releases: ``dpmerge-releases``), as
``EXPERIMENT=USER,USER;EXPERIMENT=USER``, e.g.
``dpmerge-releases=operator,consumer;dpmerge-candidates=operator``. Unset
(the embedded registry, a server without auth) nothing is granted. The local stack's workflow
environment sets it (``devstack.roles``). This module imports no MLflow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dpmerge.documents import shorten
from dpmerge.registry.errors import RegistryError

READERS_ENV = "DPMERGE_MLFLOW_READERS"


def configured_readers(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """Experiment name -> the users to grant READ; ``{}`` when not configured."""
    raw = (os.environ if environ is None else environ).get(READERS_ENV, "").strip()
    readers: dict[str, tuple[str, ...]] = {}
    for entry in filter(None, (part.strip() for part in raw.split(";"))):
        experiment, _, users = entry.partition("=")
        names = tuple(u.strip() for u in users.split(","))
        if not experiment.strip() or not all(names):
            raise RegistryError(
                f"${READERS_ENV} must be EXPERIMENT=USER,USER;…, got {shorten(raw)} "
                f"(at {shorten(entry)})"
            )
        readers[experiment.strip()] = names
    return readers


def format_readers(readers: Mapping[str, Sequence[str]]) -> str:
    """The value of ``$DPMERGE_MLFLOW_READERS`` that :func:`configured_readers` reads back."""
    return ";".join(f"{experiment}={','.join(users)}" for experiment, users in readers.items())
