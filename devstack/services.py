"""The processes of the local stack, in start order, and how to tell each one is healthy.

Stage 0 is S3 (SeaweedFS ``weed mini``: master, volume, filer and S3 gateway in one process,
objects on disk under ``STATE/s3``); stage 1 the MLflow server (sqlite registry, artifacts
proxied to ``s3://<bucket>/mlartifacts``) and the Prefect server, which need only S3 and
nothing of each other; stage 2 one Prefect worker per work pool. ``down`` stops the stages in
reverse.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from devstack.config import (
    CREDENTIALS,
    LOOPBACK,
    StackConfig,
    StackError,
    repo_root,
)
from dpmerge.environment import probe

HEALTH_TIMEOUT_S = 5.0
"""How long one health probe waits for an answer (a loaded 2-core machine answers slowly)."""


@dataclass(frozen=True)
class Service:
    """One supervised program: its command, environment, ports and health check."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    health: Callable[[], bool]
    stage: int
    ports: tuple[int, ...] = ()
    url: str | None = None
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 15.0
    cwd: Path | None = None


def executable(name: str) -> str:
    """``name`` next to this interpreter (the project's virtualenv), else on ``PATH``."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.is_file() else shutil.which(name)
    if found is None:
        raise StackError(f"{name!r} not found next to {sys.executable} or on PATH")
    return found


def worker_name(pool: str) -> str:
    return f"dpmerge-{pool}"


def worker_online(config: StackConfig, pool: str) -> bool:
    url = f"{config.prefect_api_url}/work_pools/{pool}/workers/filter"
    workers = probe(url, method="POST", body={}, timeout_s=HEALTH_TIMEOUT_S).body
    return isinstance(workers, list) and any(
        isinstance(w, dict) and w.get("name") == worker_name(pool) and w.get("status") == "ONLINE"
        for w in workers
    )


def store_ready(config: StackConfig) -> bool:
    """S3 answers, and SeaweedFS's master knows every volume its volume server loaded from disk.
    ``/healthz`` alone is not enough: until the volume server's first heartbeat reaches the
    master, reads fail with InternalError ("volume not found"; seen for 5 s after a restart)."""
    if not probe(f"{config.s3_url}/healthz", timeout_s=HEALTH_TIMEOUT_S).ok:
        return False
    ports = config.store_flags
    loaded = probe(f"http://{LOOPBACK}:{ports['volume.port']}/status", timeout_s=HEALTH_TIMEOUT_S)
    topology = probe(
        f"http://{LOOPBACK}:{ports['master.port']}/dir/status", timeout_s=HEALTH_TIMEOUT_S
    )
    try:
        nodes = [
            node
            for centre in topology.body["Topology"]["DataCenters"] or []
            for rack in centre["Racks"] or []
            for node in rack["DataNodes"] or []
        ]
        volumes = loaded.body["Volumes"] or []
        return bool(nodes) and sum(n["Volumes"] for n in nodes) >= len(volumes)
    except (TypeError, KeyError):
        return False


def services(config: StackConfig) -> list[Service]:
    """Every service of ``config`` in start order."""
    store_flags = [f"-{name}={port}" for name, port in config.store_flags.items()]
    result = [
        Service(
            name="s3",
            argv=(
                executable("weed"),
                "mini",
                f"-dir={config.s3_dir}",
                f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}",
                f"-s3.port={config.s3_port}",
                *store_flags,
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-webdav=false",
                "-admin.ui=false",
                "-master.telemetry=false",
                f"-s3.localSocket={config.state_dir / 's3.sock'}",
            ),
            # weed mini makes these credentials its one S3 identity: others are refused.
            env={**CREDENTIALS},
            health=lambda: store_ready(config),
            stage=0,
            ports=(config.s3_port, *config.store_flags.values()),
            url=config.s3_url,
            start_timeout_s=60.0,
        ),
        Service(
            name="mlflow",
            argv=(
                executable("mlflow"),
                "server",
                "--backend-store-uri",
                f"sqlite:///{config.mlflow_dir / 'mlflow.db'}",
                "--artifacts-destination",
                config.s3_config().mlflow_artifacts_uri,
                "--host",
                LOOPBACK,
                "--port",
                str(config.mlflow_port),
                "--workers",
                "1",
            ),
            env={
                **CREDENTIALS,
                "MLFLOW_S3_ENDPOINT_URL": config.s3_url,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
            health=lambda: probe(f"{config.mlflow_url}/health", timeout_s=HEALTH_TIMEOUT_S).ok,
            stage=1,
            ports=(config.mlflow_port,),
            url=config.mlflow_url,
        ),
    ]
    if not config.prefect:
        return result
    prefect_env = {"PREFECT_HOME": str(config.prefect_home)}
    result.append(
        Service(
            name="prefect",
            argv=(
                executable("prefect"),
                *("server", "start", "--host", LOOPBACK, "--port", str(config.prefect_port)),
            ),
            env={
                **prefect_env,
                "PREFECT_API_URL": config.prefect_api_url,
                "PREFECT_SERVER_API_HOST": LOOPBACK,
                "PREFECT_SERVER_API_PORT": str(config.prefect_port),
            },
            health=lambda: (
                probe(f"{config.prefect_api_url}/health", timeout_s=HEALTH_TIMEOUT_S).body is True
            ),
            stage=1,
            ports=(config.prefect_port,),
            url=config.prefect_api_url,
            stop_timeout_s=30.0,
        )
    )
    for pool in config.pools:
        worker_env = {
            **config.client_env(),
            **prefect_env,
            "PREFECT_WORKER_QUERY_SECONDS": str(config.worker_query_seconds),
        }
        if pool == "cpu":
            worker_env["CUDA_VISIBLE_DEVICES"] = ""
        result.append(
            Service(
                name=f"worker-{pool}",
                argv=(
                    executable("prefect"),
                    *("worker", "start", "--pool", pool, "--type", "process"),
                    *("--name", worker_name(pool)),
                ),
                env=worker_env,
                health=lambda pool=pool: worker_online(config, pool),
                stage=2,
                # A worker under load can need more than 20 s to stop after SIGTERM.
                stop_timeout_s=90.0,
                cwd=repo_root(),
            )
        )
    return result
