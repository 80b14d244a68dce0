"""``dpmerge stack up|status|env|down`` starts the real services on loopback and stops them all."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from servers import free_ports

from dpmerge import stack
from dpmerge.cli import main


def _cli(capsys: Any, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def _get(url: str, method: str = "GET") -> Any:
    body = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read() or b"null") if "api" in url else response.status


@pytest.mark.integration
@pytest.mark.slow
def test_stack_up_health_down_leaves_nothing(tmp_path: Path, capsys: Any) -> None:
    state = tmp_path / "stack"
    ports = [str(p) for p in free_ports(3)]
    flags = ["--state-dir", str(state)]
    code, _ = _cli(
        capsys,
        *("stack", "up", *flags, "--s3-port", ports[0], "--mlflow-port", ports[1]),
        *("--prefect-port", ports[2], "--json"),
    )
    assert code == 0
    try:
        code, out = _cli(capsys, "stack", "status", *flags, "--json")
        services = {s["name"]: s for s in json.loads(out)}
        assert code == 0 and list(services) == [
            "s3",
            "mlflow",
            "prefect",
            "worker-cpu",
            "worker-gpu",
        ]
        assert all(s["healthy"] for s in services.values())
        config = stack.resolve_config(state)
        assert _get(f"{config.s3_url}/") == 200
        assert _get(f"{config.mlflow_url}/health") == 200
        assert _get(f"{config.prefect_api_url}/health") is True
        for pool in ("cpu", "gpu"):
            workers = _get(f"{config.prefect_api_url}/work_pools/{pool}/workers/filter", "POST")
            assert [w["status"] for w in workers] == ["ONLINE"]
        _, env = _cli(capsys, "stack", "env", *flags)
        assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports[1]}" in env
        assert f"export PREFECT_API_URL=http://127.0.0.1:{ports[2]}/api" in env
        assert "export MLFLOW_DISABLE_TELEMETRY=true" in env

        pids = {name: s["pid"] for name, s in services.items()}
        code, _ = _cli(capsys, "stack", "up", *flags)  # idempotent: nothing restarted
        assert code == 0
        again = {s.name: s.pid for s in stack.status(config)}
        assert again == pids
    finally:
        code, out = _cli(capsys, "stack", "down", *flags)
    assert code == 0
    assert out.startswith("stopped: worker-gpu, worker-cpu, prefect, mlflow, s3")
    for pid in pids.values():
        assert stack._group_members(pid) == [], f"process group {pid} still running"
    assert all(stack._port_free(int(p)) for p in ports)
    assert not list((state / "pids").iterdir())
    code, out = _cli(capsys, "stack", "status", *flags, "--json")
    assert code == 1 and not any(s["running"] for s in json.loads(out))


def test_config_round_trip_and_env(tmp_path: Path) -> None:
    config = stack.StackConfig(state_dir=tmp_path, s3_port=7001, mlflow_port=7000, prefect=False)
    assert stack.resolve_config(tmp_path) == stack.StackConfig(state_dir=tmp_path)  # nothing saved
    (tmp_path / stack.CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    assert stack.resolve_config(tmp_path) == config
    assert stack.resolve_config(tmp_path, mlflow_port=7002).mlflow_port == 7002
    lines = stack.export_lines(config)
    assert "export MLFLOW_TRACKING_URI=http://127.0.0.1:7000" in lines
    assert "export DPMERGE_S3_ENDPOINT_URL=http://127.0.0.1:7001" in lines
    assert not any("PREFECT_API_URL" in line for line in lines)
    with pytest.raises(stack.StackError, match="distinct"):
        stack.StackConfig(state_dir=tmp_path, s3_port=7000, mlflow_port=7000)


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (mlflow_port,) = free_ports(1)
        config = stack.StackConfig(
            state_dir=tmp_path, s3_port=port, mlflow_port=mlflow_port, prefect=False
        )
        with pytest.raises(stack.StackError, match=rf"port 127\.0\.0\.1:{port} is in use"):
            stack.up(config)
    assert not any(s.running for s in stack.status(config))


def test_stale_mlflow_database_is_moved_aside(tmp_path: Path) -> None:
    """moto's S3 is in memory: a registry left from a previous S3 must not survive it."""
    config = stack.StackConfig(state_dir=tmp_path, prefect=False)
    (tmp_path / "mlflow").mkdir()
    (tmp_path / "mlflow" / "mlflow.db").write_text("old")
    stack._retire_stale_mlflow(config)
    assert not (tmp_path / "mlflow").exists()
    (retired,) = tmp_path.glob("mlflow.stale-*")
    assert (retired / "mlflow.db").read_text() == "old"
