"""Keep the MLflow registry and the S3 store in step (docs/stack.md#registry-and-store).

The registry (MLflow's database in ``STATE/postgres``, or ``STATE/mlflow/mlflow.db`` with
``--database sqlite``) points at artifacts, and the workflow keeps its ledger and audit
records, in the store (``STATE/s3``). A registry is only usable with the store
it was written against. So the store carries a generation id, the object
``devstack/generation.json`` in the project bucket, written once when the store is new, and
``STATE/mlflow/store-generation`` records the generation the registry belongs to. ``up``
compares them after S3 is healthy and before MLflow starts, and refuses an out-of-step pair
with one line saying how to recover; it never moves or deletes either side itself.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from devstack.config import StackConfig, StackError
from dpmerge.storage import ObjectNotFoundError, S3Store
from dpmerge.vocabulary import StackDatabase

MARKER_KEY = "devstack/generation.json"
RECORD_FILE = "store-generation"


class Verdict(Enum):
    NEW = "new"  # neither side exists yet: a new generation is written to both
    ADOPT = "adopt"  # a store without a registry: the new registry adopts its generation
    IN_STEP = "in step"
    OUT_OF_STEP = "out of step"


@dataclass(frozen=True)
class StoreCheck:
    verdict: Verdict
    store_generation: str | None  # the marker in the bucket (None: no marker)
    registry_generation: str | None  # recorded beside the MLflow database (None: not recorded)
    registry_exists: bool


def judge(store: str | None, registry: str | None, registry_exists: bool) -> Verdict:
    if not registry_exists:
        return Verdict.NEW if store is None else Verdict.ADOPT
    if store is not None and registry == store:
        return Verdict.IN_STEP
    return Verdict.OUT_OF_STEP


def registry_exists(config: StackConfig) -> bool:
    """Whether MLflow's database holds a registry (PostgreSQL must be up)."""
    if config.database is StackDatabase.POSTGRES:
        from devstack import credentials, postgres

        return postgres.has_registry(config, credentials.require(config.state_dir))
    return (config.mlflow_dir / "mlflow.db").is_file()


def check(config: StackConfig, store: S3Store) -> StoreCheck:
    """Read both sides (S3, and PostgreSQL where it holds the registry, must be up)."""
    try:
        marker = store.get_json(MARKER_KEY)
        store_generation = str(marker["generation"])
    except ObjectNotFoundError:
        store_generation = None
    except (KeyError, TypeError, ValueError):
        raise StackError(
            f"s3://{store.config.bucket}/{MARKER_KEY} is not a store generation marker; "
            "restore it from a backup of the store"
        ) from None
    record = config.mlflow_dir / RECORD_FILE
    registry_generation = record.read_text().strip() if record.is_file() else None
    exists = registry_exists(config)
    return StoreCheck(
        judge(store_generation, registry_generation, exists),
        store_generation,
        registry_generation,
        exists,
    )


def reconcile(config: StackConfig, store: S3Store) -> StoreCheck:
    """Make a new or adopting registry record the store's generation; raise
    :class:`StackError` (one line, with the recovery) when the two are out of step."""
    found = check(config, store)
    if found.verdict is Verdict.OUT_OF_STEP:
        raise StackError(out_of_step_message(config, found))
    generation = found.store_generation
    if found.verdict is Verdict.NEW:
        generation = uuid.uuid4().hex
        store.put_json(
            MARKER_KEY,
            {"generation": generation, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            if_absent=True,
        )
    if found.verdict in (Verdict.NEW, Verdict.ADOPT):
        config.mlflow_dir.mkdir(parents=True, exist_ok=True)
        (config.mlflow_dir / RECORD_FILE).write_text(f"{generation}\n")
    return check(config, store)


def registry_paths(config: StackConfig) -> list[Path]:
    """What holds the registry: the database directory and the generation record."""
    if config.database is StackDatabase.POSTGRES:
        return [config.postgres_dir, config.mlflow_dir]
    return [config.mlflow_dir]


def out_of_step_message(config: StackConfig, found: StoreCheck) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = registry_paths(config)
    holds = (
        f"generation {found.store_generation}"
        if found.store_generation
        else "no generation (it is new or was wiped)"
    )
    moves = " && ".join(f"mv {p} {p.with_name(f'{p.name}.stale-{stamp}')}" for p in paths)
    databases = " (with Prefect's database)" if len(paths) > 1 else ""
    return (
        f"registry and S3 store out of step: the registry in {paths[0]} belongs to store "
        f"generation {found.registry_generation or '(none recorded)'} but the store in "
        f"{config.s3_dir} holds {holds}, so its artifacts, ledger and audit records are not "
        f"there; restore {config.s3_dir} and {' and '.join(map(str, paths))} from the same "
        f"backup, or start an empty registry{databases}: dpmerge stack down && {moves}"
    )
