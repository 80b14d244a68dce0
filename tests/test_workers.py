"""Workers that share nothing with the operator's checkout (docs/workflow.md#worker-hosts).

The stack runs without workers of its own; three worker hosts stand in for separate machines:
two on the ``gpu`` pool, one on the ``cpu`` pool. Each host is an empty directory with its own
``HOME`` and an environment made of the workflow role's variables (``dpmerge stack env --role
workflow``: service URLs and credentials) and ``PATH`` only, plus two tuning knobs (the worker
poll, the fan-out's runs at once) and a process mark that lets the test end what the host
started. Its ``python`` is one environment
built for the hosts in a temporary directory: dpmerge is installed there, not editable, from a
wheel built from a clone of the "remote" (a bare repository holding this checkout's commit); the
third-party packages, the same pinned versions a host would install, are taken read-only from
this checkout's ``.venv`` (a ``.pth`` line), which saves minutes of installing torch, MLflow and
Prefect. The deployments are applied from an operator's clone of the remote with ``pull:
*pull_from_git``, so every flow run clones the deployed commit; the workflow key comes from the
file the workflow's environment names (the stack's, on this one machine). The worker side runs
the committed code: uncommitted changes in this checkout are not on the hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from servers import RUN_TIMEOUT_S, Shell, environment, prefect_client, running_stack, wait_run

import devstack
from devstack import credentials, processes, provision
from devstack.config import POOLS
from dpmerge.registry.tags import PUBLISHED_RECORD_TAG
from dpmerge.vocabulary import StackRole

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
HOSTS = {"gpu-host-1": "gpu", "gpu-host-2": "gpu", "cpu-host": "cpu"}
NOISE = [1.0, 1.3, 1.6, 2.2, 3.0]
GPU_LIMIT = 3
"""Runs a gpu host takes at once: the five candidates start together, over both hosts."""


def _git(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _remote(root: Path) -> tuple[Path, str]:
    """A bare repository holding this checkout's commit as ``main`` (the remote), and the commit."""
    bare = root / "remote.git"
    _git("init", "-q", "--bare", str(bare))
    _git("fetch", "-q", str(REPO), "HEAD", cwd=bare)
    commit = _git("rev-parse", "FETCH_HEAD", cwd=bare)
    _git("update-ref", "refs/heads/main", commit, cwd=bare)
    _git("symbolic-ref", "HEAD", "refs/heads/main", cwd=bare)
    return bare, commit


def _host_python(root: Path, remote: Path) -> Path:
    """The hosts' environment: dpmerge installed (not editable) from a wheel of the remote's
    commit; third-party packages read from this interpreter's site-packages."""
    source = root / "source"
    _git("clone", "-q", remote.as_uri(), str(source))
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheels"), source],
        check=True,
    )
    venv = root / "host-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(sysconfig.get_paths()["purelib"])
    (venv / "lib" / site.parent.name / "site-packages" / "libraries.pth").write_text(f"{site}\n")
    (wheel,) = (root / "wheels").glob("dpmerge-*.whl")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", wheel], check=True)
    return python


def _deploy(root: Path, remote: Path, config: devstack.StackConfig) -> None:
    """Apply deployments/prefect.yaml from an operator's clone of the remote, with the pull step
    that clones the deployed commit (the file's documented choice for such hosts)."""
    clone = root / "operator"
    _git("clone", "-q", remote.as_uri(), str(clone))
    project = clone / "deployments" / "prefect.yaml"
    text = project.read_text()
    assert text.count("pull: *pull_from_checkout\n") == 1
    project.write_text(text.replace("pull: *pull_from_checkout\n", "pull: *pull_from_git\n"))
    prefect = Path(sys.executable).parent / "prefect"
    deployed = subprocess.run(
        [prefect, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"],
        cwd=clone,
        env={**os.environ, **config.client_env(StackRole.WORKFLOW)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]


@dataclass(frozen=True)
class Hosts:
    config: devstack.StackConfig
    root: Path
    python: Path
    commit: str
    remote: Path

    def env(self, name: str) -> dict[str, str]:
        """A host's whole environment: the workflow role's, its own HOME and PATH, two tuning
        knobs and the mark the test ends its processes by."""
        home = self.root / name / "home"
        return {
            **self.config.client_env(StackRole.WORKFLOW),
            "HOME": str(home),
            "PATH": os.pathsep.join([str(self.python.parent), "/usr/bin", "/bin"]),
            # tuning, not sharing: the poll, and the fan-out's runs at once (default 2)
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "DPMERGE_TRAIN_CONCURRENCY": str(len(NOISE)),
            processes.MARK: processes.mark(self.root, name),
        }


def _start_workers(hosts: Hosts) -> None:
    for name, pool in HOSTS.items():
        directory = hosts.root / name
        (directory / "home").mkdir(parents=True)
        log = (directory / "worker.log").open("wb")
        subprocess.Popen(
            [
                *(hosts.python, "-m", "prefect", "worker", "start", "--type", "process"),
                *("--pool", pool, "--name", name),
                *("--limit", str(GPU_LIMIT if pool == "gpu" else 8)),
            ],
            cwd=directory,
            env=hosts.env(name),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    """The stack (no workers of its own; the locked pools), the deployments applied from the
    remote, and the three hosts' workers; afterwards every process of the hosts is ended."""
    root = tmp_path_factory.mktemp("hosts")
    remote, commit = _remote(root)
    python = _host_python(root, remote)
    # the stack keeps its state outside the checkout; it reads the key from its file
    with (
        environment({"DPMERGE_HOME": str(root / "stack-home")}),
        running_stack(root / "stack", prefect=True, pools=()) as config,
    ):
        creds = credentials.require(config.state_dir)
        provision.ensure_pools(replace(config, pools=POOLS), creds)
        _deploy(root, remote, config)
        found = Hosts(config, root, python, commit, remote)
        _start_workers(found)
        try:
            yield found
        finally:
            processes.end(processes.marked(root))


def _worker(run: Any) -> str | None:
    return run.labels.get("prefect.worker.name")


def _logs(config: devstack.StackConfig, run_id: Any) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with prefect_client(config) as client:
        found = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return "\n".join(log.message for log in found)


def test_hosts_import_only_their_own_install(hosts: Hosts) -> None:
    """A host's ``python`` finds dpmerge in its own environment, and the pools' commands name
    no path at all (the host's first ``python`` on PATH)."""
    code = "import dpmerge, flows, tasks, devstack; print(dpmerge.__file__, flows.__file__, "
    code += "tasks.__file__, devstack.__file__)"
    name = "cpu-host"
    found = subprocess.run(
        ["python", "-c", code],
        cwd=hosts.root / name,
        env=hosts.env(name),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(found) == 4
    assert all(Path(f).is_relative_to(hosts.python.parents[1]) for f in found), found
    for pool in POOLS:
        assert str(REPO) not in provision.locked_template(pool)["job_configuration"]["command"]


def test_training_spreads_over_gpu_hosts_and_the_merge_runs_on_the_cpu_host(
    hosts: Hosts,
) -> None:
    from mlflow import MlflowClient

    config = hosts.config
    with prefect_client(config) as client:
        deployment = client.read_deployment_by_name("train-candidates/train-candidates")
        assert deployment.pull_steps == [
            {
                "prefect.deployments.steps.git_clone": {
                    "repository": hosts.remote.as_uri(),
                    "commit_sha": hosts.commit,
                }
            }
        ]
        parent = client.create_flow_run_from_deployment(
            deployment.id,
            parameters={
                "dataset": "digits",
                "noise_multipliers": NOISE,
                "epochs": 3,
                "batch_size": 64,
                "learning_rate": 1.0,
                "frontier_report": False,
                "prime_merge_caches": False,
                "deployment": "train-candidate/train-candidate-gpu",
                "keep_last_epochs": 2,  # each run registers its last two epochs' checkpoints
            },
        )
    finished = wait_run(config, parent.id)
    assert finished.state.is_completed(), finished.state.message
    assert _worker(finished) == "cpu-host"
    with prefect_client(config) as client:
        training = [r for r in client.read_flow_runs() if r.name.startswith("train-digits-")]
    assert len(training) == len(NOISE) and all(r.state.is_completed() for r in training)
    workers = [_worker(r) for r in training]
    assert set(workers) == {"gpu-host-1", "gpu-host-2"}, workers  # both hosts trained
    assert "git_clone" in _logs(config, training[0].id)  # the code came by the pull step

    mlflow = MlflowClient(config.mlflow_url)
    with environment(config.client_env(StackRole.WORKFLOW)):
        found = mlflow.search_model_versions("tags.`dp.role` = 'candidate'")
    assert len(found) == 2 * len(NOISE) and {v.tags["dp.status"] for v in found} == {"ready"}
    runs: dict[str, set[int]] = {}  # a run's checkpoints: one run id, epochs 2 and 3
    for version in found:
        record = json.loads(version.tags[PUBLISHED_RECORD_TAG])
        runs.setdefault(record["run_id"], set()).add(int(version.tags["dp.steps"]))
    assert len(runs) == len(NOISE) and all(len(steps) == 2 for steps in runs.values()), runs
    target = sorted(float(v.tags["dp.epsilon"]) for v in found)[2]

    # an operator stores a policy version from its own shell; the stack's dispatcher makes it
    # a run
    operator = Shell.of(config, StackRole.OPERATOR, hosts.root / "operator-shell")
    applied = operator.dpmerge(
        "policy", "set", "--name", "hosts", "--target-epsilon", f"{target:.6g}",
        "--delta", "1e-5", "--dataset", "digits", "--model", "logreg",
        "--wait", str(RUN_TIMEOUT_S), "--json", timeout=RUN_TIMEOUT_S + 60,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stdout[-2000:] + applied.stderr[-2000:]
    outcome = json.loads(applied.stdout.strip().splitlines()[-1])
    assert outcome["status"] == "promoted"
    merge = wait_run(config, outcome["run"])  # the outcome is stored before the run ends
    assert merge.state.is_completed() and _worker(merge) == "cpu-host"
    # it started from the cpu host's warm process, which lives under the host's own HOME
    warm = list((hosts.root / "cpu-host" / "home" / ".dpmerge" / "run").glob("engine-*.sock"))
    assert warm, "no warm flow-run process on the cpu host"
    with environment(config.client_env(StackRole.WORKFLOW)):
        served = mlflow.get_registered_model(outcome["merged_model"]).aliases
    assert served.get("policy-hosts") == str(outcome["version"])

    # nothing of the hosts runs in, or from, the operator's checkout; a process that ended
    # since the listing (a flow run finishing) is passed over, the hosts' workers never end
    checked = set()
    for pid in processes.marked(hosts.root):
        try:
            cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        assert not cwd.is_relative_to(REPO), (pid, cwd)
        assert str(REPO) not in command, (pid, command)
        checked.add(cwd.name)
    assert checked >= set(HOSTS), checked
