"""The local stack (``devstack``): ``dpmerge stack up|status|env|down`` starts the real services
on loopback under supervisord and stops them all; a crashed S3 comes back with its objects; a
registry and a store that are out of step are refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from servers import running_stack

import devstack
from devstack import store
from devstack.supervisor import Supervisor
from dpmerge.cli import main as library_main
from dpmerge.environment import probe
from dpmerge.storage import S3Store
from flows.cli import main


def _cli(capsys: Any, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _objects(s3: S3Store) -> dict[str, list[str]]:
    return {b: s3.list_keys(bucket=b) for b in (s3.config.bucket, s3.config.audit_bucket)}


@pytest.mark.integration
@pytest.mark.slow
def test_stack_up_health_down_leaves_nothing(tmp_path: Path, capsys: Any) -> None:
    state = tmp_path / "stack"
    planned = devstack.StackConfig.on_free_ports(state, prefect=True)
    planned.save()  # the store's internal ports come from stack.json, the others from flags
    ports = [str(p) for p in (planned.s3_port, planned.mlflow_port, planned.prefect_port)]
    flags = ["--state-dir", str(state)]
    code, _ = _cli(
        capsys,
        *("stack", "up", *flags, "--s3-port", ports[0], "--mlflow-port", ports[1]),
        *("--prefect-port", ports[2], "--json"),
    )
    assert code == 0
    pids: dict[str, int] = {}
    try:
        code, out = _cli(capsys, "stack", "status", *flags, "--json")
        services = {s["name"]: s for s in json.loads(out)}
        assert code == 0
        assert list(services) == ["s3", "mlflow", "prefect", "worker-cpu", "worker-gpu"]
        assert all(s["healthy"] and s["state"] == "RUNNING" for s in services.values())
        pids = {name: s["pid"] for name, s in services.items()}
        config = devstack.resolve_config(state)
        assert config == planned
        assert probe(f"{config.s3_url}/healthz", timeout_s=10).status == 200
        assert probe(f"{config.mlflow_url}/health", timeout_s=10).status == 200
        assert probe(f"{config.prefect_api_url}/health", timeout_s=10).body is True
        for pool in ("cpu", "gpu"):
            url = f"{config.prefect_api_url}/work_pools/{pool}/workers/filter"
            workers = probe(url, method="POST", body={}, timeout_s=10).body
            assert [w["status"] for w in workers] == ["ONLINE"]
        _, env = _cli(capsys, "stack", "env", *flags)
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports[1]}" in env
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[2]}/api" in env
        assert "export MLFLOW_DISABLE_TELEMETRY=true" in env
        code, out = _cli(capsys, "stack", "status", *flags)
        assert code == 0 and "registry/store: in step" in out

        code, _ = _cli(capsys, "stack", "up", *flags)  # idempotent: nothing restarted
        assert code == 0
        assert {s.name: s.pid for s in devstack.status(config)} == pids
    finally:
        code, out = _cli(capsys, "stack", "down", *flags)
    assert code == 0
    assert out.strip() == "stopped: worker-gpu, worker-cpu, prefect, mlflow, s3"
    for pid in pids.values():
        assert devstack.group_members(pid) == [], f"process group {pid} still running"
    assert not Supervisor(config).running()
    assert all(devstack.port_free(p) for p in config.ports)
    assert not list((state / "pids").iterdir())
    code, out = _cli(capsys, "stack", "status", *flags, "--json")
    assert code == 1 and not any(s["running"] for s in json.loads(out))


@pytest.mark.integration
def test_s3_restarts_under_a_running_mlflow_and_keeps_every_object(tmp_path: Path) -> None:
    """issue 9: after the S3 server died under a running MLflow, 648 objects became 17. Now
    supervisord restarts it and the objects, which live on disk, are all there."""
    with running_stack(tmp_path / "stack", prefect=False) as config:
        s3 = S3Store(config.s3_config())
        client = MlflowClient(config.mlflow_url)
        run = client.create_run(client.create_experiment("restart"))
        client.log_text(run.info.run_id, "the model", "model/notes.txt")
        s3.put_json("ledger/releases.json", {"releases": [1, 2, 3]})
        s3.put_json("releases/r1.json", {"drawn_index": 2}, bucket=config.audit_bucket)
        before = _objects(s3)
        assert "ledger/releases.json" in before[config.bucket]
        assert any(k.endswith("model/notes.txt") for k in before[config.bucket])
        (s3_before, mlflow_before) = (
            next(s for s in devstack.status(config) if s.name == name) for name in ("s3", "mlflow")
        )

        os.kill(s3_before.pid, signal.SIGKILL)  # the pid supervisord recorded
        deadline = time.monotonic() + 60
        while True:
            now = {s.name: s for s in devstack.status(config)}
            if now["s3"].pid not in (None, s3_before.pid) and now["s3"].healthy:
                break
            assert time.monotonic() < deadline, f"S3 not back: {now['s3']}"
            time.sleep(0.5)

        assert now["mlflow"].pid == mlflow_before.pid and now["mlflow"].healthy
        assert _objects(s3) == before
        assert s3.get_json("ledger/releases.json") == {"releases": [1, 2, 3]}
        assert s3.get_json("releases/r1.json", bucket=config.audit_bucket) == {"drawn_index": 2}
        notes = client.download_artifacts(run.info.run_id, "model/notes.txt", str(tmp_path))
        assert Path(notes).read_text() == "the model"
        devstack.up(config)  # the registry and the store are still in step
        assert store.check(config, s3).verdict is store.Verdict.IN_STEP
        saved = (config.state_dir / devstack.CONFIG_FILE).read_text()
        with pytest.raises(devstack.StackError, match="runs with other settings"):
            devstack.up(replace(config, mlflow_port=devstack.free_ports(1)[0]))
        assert (config.state_dir / devstack.CONFIG_FILE).read_text() == saved


@pytest.mark.integration
def test_a_registry_without_its_store_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "stack"
    with running_stack(state, prefect=False) as config:
        pass
    shutil.move(config.s3_dir, tmp_path / "lost-store")  # the store is gone, the registry not
    with pytest.raises(devstack.StackError, match="out of step") as refused:
        devstack.up(config)
    message = str(refused.value)
    assert "\n" not in message and f"mv {config.mlflow_dir} " in message
    assert not any(s.running for s in devstack.status(config))
    assert not Supervisor(config).running()
    assert (config.mlflow_dir / "mlflow.db").is_file()  # nothing moved or deleted

    shutil.move(config.mlflow_dir, message.rsplit(" ", 1)[1])  # the recovery it names
    try:
        devstack.up(config)
        assert store.check(config, S3Store(config.s3_config())).verdict is store.Verdict.IN_STEP
    finally:
        devstack.down(config)


def test_registry_and_store_verdicts() -> None:
    judge, v = store.judge, store.Verdict
    assert judge(None, None, registry_exists=False) is v.NEW
    assert judge("g1", None, registry_exists=False) is v.ADOPT
    assert judge("g1", "g1", registry_exists=True) is v.IN_STEP
    assert judge("g2", "g1", registry_exists=True) is v.OUT_OF_STEP
    assert judge(None, "g1", registry_exists=True) is v.OUT_OF_STEP  # the store was wiped
    assert judge("g1", None, registry_exists=True) is v.OUT_OF_STEP  # a registry of old


def test_config_round_trip_and_env(tmp_path: Path) -> None:
    config = devstack.StackConfig(state_dir=tmp_path, s3_port=7001, mlflow_port=7000, prefect=False)
    assert devstack.resolve_config(tmp_path) == devstack.StackConfig(state_dir=tmp_path)
    config.save()
    assert json.loads((tmp_path / devstack.CONFIG_FILE).read_text())["mlflow_port"] == 7000
    assert devstack.resolve_config(tmp_path) == config
    assert devstack.resolve_config(tmp_path, mlflow_port=7002).mlflow_port == 7002
    lines = devstack.export_lines(config)
    assert "export MLFLOW_TRACKING_URI=http://127.0.0.1:7000" in lines
    assert "export DPMERGE_S3_ENDPOINT_URL=http://127.0.0.1:7001" in lines
    assert not any("PREFECT_API_URL" in line for line in lines)
    with pytest.raises(devstack.StackError, match="distinct"):
        devstack.StackConfig(state_dir=tmp_path, s3_port=7000, mlflow_port=7000)
    with pytest.raises(devstack.StackError, match="integers"):
        devstack.StackConfig(state_dir=tmp_path, s3_port=True)  # a boolean is not a port
    (tmp_path / devstack.CONFIG_FILE).write_text('{"s3_port": 1, "colour": "red"}')
    with pytest.raises(devstack.StackError, match="not a stack configuration"):
        devstack.resolve_config(tmp_path)


def test_stack_is_not_a_library_command(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        library_main(["stack", "status"])
    assert "invalid choice: 'stack'" in capsys.readouterr().err


@pytest.mark.integration
def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    config = devstack.StackConfig.on_free_ports(tmp_path / "stack", prefect=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", config.store_ports[0]))
        busy.listen()
        with pytest.raises(
            devstack.StackError, match=rf"s3: port 127\.0\.0\.1:{config.store_ports[0]} is in use"
        ):
            devstack.up(config)
    assert not any(s.running for s in devstack.status(config))
    assert not Supervisor(config).running()
