"""The local stack (``devstack``): ``dpmerge stack up|status|env|down`` starts the real services
on loopback under supervisord and stops them all, PostgreSQL included; a service killed with
SIGKILL is reported, comes back and leaves no orphan; a crashed S3 comes back with its objects;
a registry and a store that are out of step are refused. Roles: tests/test_stack_roles.py."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from mlflow import MlflowClient
from servers import (
    credentials_env,
    environment,
    flow_source,
    running_stack,
    seed_secrets,
    workflow_prefect,
)

import devstack
from devstack import credentials, processes, store, worker_user
from devstack import services as stack_services
from devstack.supervisor import Supervisor
from dpmerge.cli import main as library_main
from dpmerge.environment import probe
from dpmerge.registry.readers import configured_readers
from dpmerge.storage import S3Store
from dpmerge.vocabulary import StackRole
from flows.cli import main


def _cli(capsys: Any, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _objects(s3: S3Store) -> dict[str, list[str]]:
    return {b: s3.list_keys(bucket=b) for b in (s3.config.bucket, s3.config.audit_bucket)}


SLEEPY_FLOW = """
import time
from prefect import flow

@flow
def sleepy(seconds: float = 600.0) -> None:
    time.sleep(seconds)
"""


def _deploy_sleepy(config: devstack.StackConfig) -> str:
    """Deploy a flow that sleeps to the ``cpu`` pool and start one run (on the warm process)."""
    from prefect import flow
    from prefect.deployments import run_deployment

    directory = flow_source("sleepy.py", SLEEPY_FLOW)
    with workflow_prefect(config):
        source = flow.from_source(source=str(directory), entrypoint="sleepy.py:sleepy")
        source.deploy(name="sleepy", work_pool_name="cpu", print_next_steps=False)
        run = run_deployment("sleepy/sleepy", timeout=0)
    return str(run.id)


def _run_state(config: devstack.StackConfig, run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with workflow_prefect(config), get_client(sync_client=True) as prefect_api:
        state = prefect_api.read_flow_run(UUID(run_id)).state
    return state.type.value if state else "NONE"


def _by_name(capsys: Any, flags: list[str]) -> dict[str, dict[str, Any]]:
    _, out = _cli(capsys, "stack", "status", *flags, "--json")
    return {s["name"]: s for s in json.loads(out)}


def _stack_processes(config: devstack.StackConfig) -> set[tuple[int, float | None]]:
    """Every live process of the stack, marked ones and what descends from supervisord, as
    (pid, start time): a pid reused later by another program is not the same process."""
    supervisord = Supervisor(config).pid()
    below = processes.descendants(supervisord) if supervisord else set()
    return {
        (pid, processes.started_at(pid)) for pid in set(processes.marked(config.state_dir)) | below
    }


@pytest.mark.integration
@pytest.mark.slow
def test_stack_up_kill_every_service_recover_down_leaves_nothing(
    tmp_path: Path, capsys: Any
) -> None:
    """issue (red team): after ``kill -9`` of a supervised service its children kept the port,
    supervisord restart-looped, ``status`` said healthy and ``down`` left the orphans. Now
    every service (the flow runs of a worker and its warm process included) is killed with
    SIGKILL: ``status`` reports it, the stack recovers, and ``down`` leaves nothing."""
    state = tmp_path / "stack"
    planned = devstack.StackConfig.on_free_ports(state, prefect=True)
    planned.save()  # the store's internal ports come from stack.json, the others from flags
    seed_secrets(state)
    ports = [str(p) for p in (planned.s3_port, planned.mlflow_port, planned.prefect_port)]
    flags = ["--state-dir", str(state)]
    code = main(
        [
            *("stack", "up", *flags, "--s3-port", ports[0], "--mlflow-port", ports[1]),
            *("--prefect-port", ports[2], "--postgres-port", str(planned.postgres_port), "--json"),
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err  # up says why in one line
    seen: set[tuple[int, float | None]] = set()
    try:
        services = _by_name(capsys, flags)
        assert list(services) == [
            *("s3", "postgres", "mlflow", "prefect", "dispatcher", "worker-cpu", "worker-gpu")
        ]
        assert all(s["healthy"] and s["state"] == "RUNNING" for s in services.values())
        config = devstack.resolve_config(state)
        assert config == planned and config.database == "postgres"
        code, out = _cli(capsys, "stack", "status", *flags)
        assert code == 0 and "registry/store: in step" in out and "database postgres" in out
        secrets_dir = state / "secrets"
        assert secrets_dir.stat().st_mode & 0o777 == 0o700
        for path in [*secrets_dir.iterdir(), state / "supervisord.conf"]:
            assert path.stat().st_mode & 0o777 == 0o600, path
        _, env = _cli(capsys, "stack", "env", *flags)
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports[1]}" in env
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[2]}/api" in env
        assert "export MLFLOW_TRACKING_USERNAME=workflow" in env
        assert f"export DPMERGE_SECRET_KEY_FILE={secrets_dir / 'workflow.key'}" in env
        assert "DPMERGE_SECRET_BLOCK" not in env and "unset DPMERGE_SECRET_KEY_FILE" not in env
        assert "export MLFLOW_DISABLE_TELEMETRY=true" in env
        key = (secrets_dir / "workflow.key").read_text().strip()
        assert key not in env and "export DPMERGE_SECRET_KEY=" not in env
        assert "unset DPMERGE_SECRET_KEY\n" in env  # a shell that had it loses it
        creds = credentials.require(state)
        every_secret = [
            creds.postgres_superuser,
            creds.mlflow_admin,
            creds.prefect_auth.split(":", 1)[1],
            *creds.database.values(),
            *creds.mlflow_users.values(),
            *(key.secret_access_key for key in creds.s3.values()),
            key,
        ]
        logs = "".join(path.read_text(errors="replace") for path in (state / "logs").iterdir())
        assert not [secret for secret in every_secret if secret in logs]
        rules = [
            line.split()
            for line in (state / "postgres" / "pg_hba.conf").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
        assert rules and all(rule[-1] == "scram-sha-256" for rule in rules)

        run_id = _deploy_sleepy(config)
        capsys.readouterr()  # Prefect's advice on deploying to a process pool
        deadline = time.monotonic() + 180
        while _run_state(config, run_id) != "RUNNING":
            assert time.monotonic() < deadline, "the flow run did not start on the cpu worker"
            time.sleep(1)
        # the worker, the warm client it started, the warm server and the run forked from it
        assert len(processes.marked(state, "worker-cpu")) >= 4

        for name in ("worker-cpu", "worker-gpu", "mlflow", "prefect", "postgres", "s3"):
            before = _by_name(capsys, flags)[name]
            own = processes.descendants(before["pid"]) | set(processes.marked(state, name))
            seen |= _stack_processes(config)
            os.kill(before["pid"], signal.SIGKILL)  # the pid supervisord supervises
            now = _by_name(capsys, flags)[name]
            assert not (now["pid"] == before["pid"] and now["healthy"]), now
            if name in ("worker-cpu", "mlflow"):  # children that outlive their parent
                assert now["orphans"] or now["pid"] != before["pid"], now
            deadline = time.monotonic() + 180
            while True:
                now = _by_name(capsys, flags)[name]
                if now["healthy"] and now["pid"] != before["pid"] and not now["orphans"]:
                    break
                assert time.monotonic() < deadline, f"{name} did not recover: {now}"
                time.sleep(1)
            assert not any(processes.alive(p) for p in own - {now["pid"]}), name
        # the dispatcher beats only after a poll that reached S3 and Prefect: it is unhealthy
        # while they are down and comes back on its own once its retries reach them again
        deadline = time.monotonic() + 180
        while (status := _cli(capsys, "stack", "status", *flags))[0] != 0:
            assert time.monotonic() < deadline, status[1]
            time.sleep(1)
        log = (state / "logs" / "worker-cpu.log").read_text()
        assert "ended" in log and "leftover process(es) of worker-cpu" in log
        code, _ = _cli(capsys, "stack", "up", *flags)  # idempotent: nothing restarted
        pids = {s.name: s.pid for s in devstack.status(config)}
        assert code == 0 and {s.name: s.pid for s in devstack.status(config)} == pids
        seen |= _stack_processes(config)
    finally:
        code, out = _cli(capsys, "stack", "down", *flags)
    assert code == 0
    assert out.strip() == (
        "stopped: worker-gpu, worker-cpu, dispatcher, prefect, mlflow, postgres, s3"
    )
    left = [(p, t) for p, t in seen if processes.alive(p) and processes.started_at(p) == t]
    assert not left, f"processes of the stack still running: {left}"
    assert not processes.marked(state)
    assert not Supervisor(config).running()
    assert all(devstack.port_free(p) for p in config.ports)
    assert not list((state / "pids").iterdir())
    code, out = _cli(capsys, "stack", "status", *flags, "--json")
    assert code == 1 and not any(s["running"] for s in json.loads(out))


@pytest.mark.integration
def test_sqlite_smoke(tmp_path: Path, capsys: Any) -> None:
    """The one stack on SQLite (``--database sqlite``): up, healthy, authenticated, down."""
    with running_stack(tmp_path / "stack", prefect=False, database="sqlite") as config:
        assert json.loads((config.state_dir / devstack.CONFIG_FILE).read_text())["database"] == (
            "sqlite"
        )
        assert [s.name for s in devstack.status(config)] == ["s3", "mlflow"]
        assert all(s.healthy for s in devstack.status(config))
        assert (config.mlflow_dir / "mlflow.db").is_file()
        assert not config.postgres_dir.exists()
        assert probe(f"{config.mlflow_url}/api/2.0/mlflow/experiments/search").status == 401
        with environment(credentials_env(config, StackRole.WORKFLOW)):
            experiment = MlflowClient(config.mlflow_url).create_experiment("smoke")
        code, out = _cli(capsys, "stack", "status", "--state-dir", str(config.state_dir))
        assert code == 0 and "database sqlite" in out
    assert experiment
    assert not processes.marked(config.state_dir)


@pytest.mark.integration
def test_s3_restarts_under_a_running_mlflow_and_keeps_every_object(tmp_path: Path) -> None:
    """issue 9: after the S3 server died under a running MLflow, 648 objects became 17. Now
    supervisord restarts it and the objects, which live on disk, are all there."""
    with (
        running_stack(tmp_path / "stack", prefect=False) as config,
        environment(credentials_env(config, StackRole.WORKFLOW)),
    ):
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
        secrets_before = (config.state_dir / "secrets" / "credentials.json").read_text()
        devstack.down(config)
        devstack.up(config)  # down/up keeps the database, the objects and the credentials
        assert client.get_run(run.info.run_id).info.experiment_id == run.info.experiment_id
        (tmp_path / "again").mkdir()
        again = client.download_artifacts(
            run.info.run_id, "model/notes.txt", str(tmp_path / "again")
        )
        assert Path(again).read_text() == "the model"
        assert (config.state_dir / "secrets" / "credentials.json").read_text() == secrets_before
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
    assert "\n" not in message
    assert f"mv {config.postgres_dir} " in message and f"mv {config.mlflow_dir} " in message
    assert not any(s.running for s in devstack.status(config))
    assert not Supervisor(config).running()
    assert not processes.marked(config.state_dir)
    assert (config.postgres_dir / "PG_VERSION").is_file()  # nothing moved or deleted

    for move in message.split("&& ")[1:]:  # the recovery it names
        _, source, target = move.split()
        shutil.move(source, target)
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


def test_config_round_trip_and_role_env(tmp_path: Path) -> None:
    config = devstack.StackConfig(state_dir=tmp_path, s3_port=7001, mlflow_port=7000, prefect=False)
    assert devstack.resolve_config(tmp_path) == devstack.StackConfig(state_dir=tmp_path)
    config.save()
    saved = json.loads((tmp_path / devstack.CONFIG_FILE).read_text())
    assert saved["mlflow_port"] == 7000 and saved["database"] == "postgres"
    assert devstack.resolve_config(tmp_path) == config
    assert devstack.resolve_config(tmp_path, mlflow_port=7002).mlflow_port == 7002
    assert devstack.resolve_config(tmp_path, database="sqlite").database == "sqlite"
    with pytest.raises(devstack.StackError, match="no stack credentials"):
        devstack.export_lines(config)  # none before the first `up`
    creds = credentials.ensure(tmp_path)
    assert (tmp_path / "secrets" / "credentials.json").stat().st_mode & 0o777 == 0o600
    assert credentials.ensure(tmp_path) == creds  # generated once
    lines = devstack.export_lines(config)
    assert "export MLFLOW_TRACKING_URI=http://127.0.0.1:7000" in lines
    assert "export DPMERGE_S3_ENDPOINT_URL=http://127.0.0.1:7001" in lines
    assert not any("PREFECT_API_URL" in line for line in lines)
    env = {r: config.client_env(r) for r in StackRole}
    assert {r: e["MLFLOW_TRACKING_USERNAME"] for r, e in env.items()} == {r: r.value for r in env}
    assert len({e["MLFLOW_TRACKING_PASSWORD"] for e in env.values()}) == 3
    assert env[StackRole.WORKFLOW]["AWS_ACCESS_KEY_ID"] == creds.s3["workflow"].access_key_id
    assert env[StackRole.OPERATOR]["AWS_ACCESS_KEY_ID"] == creds.s3["operator"].access_key_id
    assert not any(k.startswith("AWS_") or "S3" in k for k in env[StackRole.CONSUMER])
    with_prefect = replace(config, prefect=True)
    assert "PREFECT_API_AUTH_STRING" in with_prefect.client_env(StackRole.WORKFLOW)
    for role in (StackRole.OPERATOR, StackRole.CONSUMER):
        assert not any(k.startswith("PREFECT_API") for k in with_prefect.client_env(role))
    # switching roles in one shell leaves no credential of the role it leaves
    consumer = devstack.export_lines(with_prefect, StackRole.CONSUMER)
    for name in ("AWS_SECRET_ACCESS_KEY", "PREFECT_API_AUTH_STRING", "DPMERGE_SECRET_KEY"):
        assert f"unset {name}" in consumer
    # every role verifies releases with the same public key (the workflow key's public half)
    keys = {e["DPMERGE_RELEASE_PUBLIC_KEY"] for e in env.values()}
    assert len(keys) == 1 and len(keys.pop()) == 64
    pems = {e["DPMERGE_MODEL_SIGNING_PUBLIC_KEY"] for e in env.values()}  # model_signing's
    assert len(pems) == 1 and base64.b64decode(pems.pop()).startswith(b"-----BEGIN PUBLIC KEY")
    assert configured_readers(env[StackRole.WORKFLOW]) == {
        "dpmerge-candidates": ("operator",),
        "dpmerge-releases": ("operator", "consumer"),
        "dpmerge-reports": ("operator",),
        "dpmerge-studies": ("operator",),
    }
    with pytest.raises(devstack.StackError, match="one of 'postgres', 'sqlite'"):
        devstack.StackConfig(state_dir=tmp_path, database="mysql")
    with pytest.raises(devstack.StackError, match="distinct"):
        devstack.StackConfig(state_dir=tmp_path, s3_port=7000, mlflow_port=7000)
    with pytest.raises(devstack.StackError, match="integers"):
        devstack.StackConfig(state_dir=tmp_path, s3_port=True)  # a boolean is not a port
    (tmp_path / devstack.CONFIG_FILE).write_text('{"s3_port": 1, "colour": "red"}')
    with pytest.raises(devstack.StackError, match="not a stack configuration"):
        devstack.resolve_config(tmp_path)


def test_postgres_as_root_without_unshare_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from devstack import postgres

    monkeypatch.setattr(postgres.os, "geteuid", lambda: 0)
    monkeypatch.setattr(postgres.shutil, "which", lambda name: None)
    with pytest.raises(devstack.StackError, match="refuses to run as root") as refused:
        postgres.as_server_user(["postgres"])
    assert "\n" not in str(refused.value) and "--database sqlite" in str(refused.value)
    monkeypatch.setattr(postgres.os, "geteuid", lambda: 1000)
    assert postgres.as_server_user(["postgres", "-D", "x"]) == ["postgres", "-D", "x"]


def test_stack_is_not_a_library_command(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        library_main(["stack", "status"])
    assert "unknown command 'stack'" in capsys.readouterr().err


@pytest.mark.integration
def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    """A failed ``up`` leaves nothing behind: no service, no supervisord, no worker directory
    (its copy of the workflow key)."""
    config = devstack.StackConfig.on_free_ports(tmp_path / "stack", prefect=True)
    seed_secrets(config.state_dir)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", config.store_ports[0]))
        busy.listen()
        with pytest.raises(
            devstack.config.PortInUseError,
            match=rf"s3: port 127\.0\.0\.1:{config.store_ports[0]} is in use",
        ):
            devstack.up(config)
    assert not any(s.running for s in devstack.status(config))
    assert not Supervisor(config).running()
    assert not worker_user.worker_dir(config).exists()


def test_an_unhealthy_service_says_why(tmp_path: Path) -> None:
    """What ``up``'s timeout and ``stack status`` say of a service that is not healthy: no
    process, a port nobody listens on, a port another process holds as well, and the store's
    own check (nothing answers its S3 gateway here)."""
    config = devstack.StackConfig.on_free_ports(tmp_path / "stack", prefect=False)
    seed_secrets(config.state_dir)
    (s3,) = [s for s in stack_services.services(config) if s.name == "s3"]
    assert s3.unhealthy_because(None) == "its process is not running"
    assert s3.unhealthy_because(os.getpid()) == f"nothing listens on port {min(s3.ports)}"
    assert stack_services.store_problem(config).startswith(
        "its S3 gateway does not answer /healthz ("
    )

    other = subprocess.Popen(["sleep", "60"])
    try:
        with socket.socket() as held:
            held.bind(("127.0.0.1", config.s3_port))
            held.listen()
            assert processes.ports_problem(os.getpid(), [config.s3_port]) is None
            assert processes.ports_problem(other.pid, [config.s3_port]).startswith(
                f"port {config.s3_port} is also held by pid {os.getpid()} ("
            )
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (devstack.config.ServiceStartError("s3 not healthy after 120 s (…)"), "s3 not healthy"),
        (devstack.config.PortInUseError("s3: port 127.0.0.1:25991 is in use by…"), "s3: port"),
    ],
)
def test_a_test_stack_that_did_not_start_is_started_once_more_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, said: str
) -> None:
    """The test fixtures' one retry (tests/servers.py), for a service not healthy in time and
    for a port taken after it was picked: new ports and state, a warning that carries the first
    error; a second failure is the test's error, and any other error is not retried."""
    tried: list[devstack.StackConfig] = []

    def up(config: devstack.StackConfig) -> None:
        tried.append(config)
        if len(tried) != 2:
            raise error

    monkeypatch.setattr(devstack, "up", up)
    monkeypatch.setattr(devstack, "down", lambda config: [])
    with (
        pytest.warns(UserWarning, match=rf"started again on new ports: {re.escape(said)}"),
        running_stack(tmp_path / "stack", prefect=False) as config,
    ):
        assert config is tried[1] and config.state_dir == tmp_path / "stack-again"
        assert config.ports != tried[0].ports
    with (
        pytest.raises(type(error)),
        pytest.warns(UserWarning),
        running_stack(tmp_path / "other", prefect=False),
    ):
        pass
    tried.clear()
    monkeypatch.setattr(devstack, "up", lambda config: tried.append(config) or 1 / 0)
    with pytest.raises(ZeroDivisionError), running_stack(tmp_path / "third", prefect=False):
        pass
    assert len(tried) == 1
