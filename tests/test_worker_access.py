"""The worker user reaches the code wherever the checkout is, and nothing of the admin's
(docs/stack.md#worker-user): recorded ACL grants above a 0700 directory, taken back exactly; a
reach check that fails in one line; its own key copy, no credential file; and, not as root,
``workers_not_separated``. No stack runs here; these need root (the CI runs as root)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from devstack import cli, credentials, grants, worker_user
from devstack.config import WORKER_USER, StackConfig, StackError
from devstack.stack import ServiceStatus
from dpmerge.vocabulary import FindingKind

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the worker user needs root")


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private ledger, for tests that grant only below their own ``tmp_path``. A test that
    grants passage to the checkout (``worker_user.ensure``) uses the host's ledger, as ``up``
    does: a private one would not know of the stacks other tests run beside it, so it would
    skip a directory one of them opened, and that stack's ``down`` would shut it mid-test."""
    path = tmp_path / "ledger" / "grants.json"
    monkeypatch.setattr(grants, "LEDGER", path)
    return path


def _stacks_in_host_ledger() -> set[str]:
    """The stacks the host's ledger lists a grant for."""
    if not grants.LEDGER.exists():
        return set()
    with grants._ledger() as entries:
        return {stack for entry in entries for stack in entry["stacks"]}


@pytest.fixture
def account() -> worker_user.WorkerAccount:
    """The worker user (created as ``up`` creates it)."""
    return worker_user._account(StackConfig(state_dir=Path(tempfile.gettempdir())))


def _acl(path: Path) -> str:
    return subprocess.run(["getfacl", "-p", str(path)], capture_output=True, text=True).stdout


def _read_as(uid: int, path: Path) -> int:
    """The exit status of ``cat path`` as ``uid``."""
    return subprocess.run(["cat", str(path)], user=uid, capture_output=True).returncode


def _checkout(root: Path) -> tuple[Path, Path]:
    """``root/private`` (0700, as ``mktemp -d`` makes it) holding a readable ``checkout/code``."""
    private = root / "private"
    private.mkdir(mode=0o700)
    (private / "checkout").mkdir(mode=0o755)
    code = private / "checkout" / "code.py"
    code.write_text("x = 1\n")
    code.chmod(0o644)
    return private, code


def test_grants_let_only_the_worker_through_and_are_taken_back_exactly(
    tmp_path: Path, ledger: Path, account: worker_user.WorkerAccount
) -> None:
    private, code = _checkout(tmp_path)
    before = {path: _acl(path) for path in grants.above([code])}
    modes = {path: path.stat().st_mode for path in before}
    assert _read_as(account.uid, code) != 0

    granted = grants.grant(tmp_path / "stack", account.uid, account.gid, [code])
    assert private in granted and code.parent not in granted  # 0755: nothing to grant
    assert _read_as(account.uid, code) == 0
    assert _read_as(pwd.getpwnam("nobody").pw_uid, code) != 0  # not opened to everyone
    assert f"user:{account.name}:--x" in _acl(private)
    assert private.stat().st_mode & 0o007 == 0
    recorded = json.loads(ledger.read_text())
    assert {entry["dir"] for entry in recorded} == set(map(str, granted))

    grants.revoke(tmp_path / "stack")
    assert {path: _acl(path) for path in before} == before
    assert {path: path.stat().st_mode for path in before} == modes
    assert _read_as(account.uid, code) != 0
    assert json.loads(ledger.read_text()) == []


def test_a_grant_two_stacks_need_stays_until_the_last_is_down(
    tmp_path: Path, ledger: Path, account: worker_user.WorkerAccount
) -> None:
    private, code = _checkout(tmp_path)
    before = _acl(private)
    for stack in ("one", "two"):
        assert private in grants.grant(tmp_path / stack, account.uid, account.gid, [code])
    grants.revoke(tmp_path / "one")
    assert _read_as(account.uid, code) == 0
    grants.revoke(tmp_path / "two")
    assert _read_as(account.uid, code) != 0
    assert _acl(private) == before


def test_stacks_starting_at_once_create_the_worker_user_once(
    tmp_path: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue (CI on a fresh machine): three stacks started at once, each ran ``useradd``, each
    was told it succeeded, and the user ended with a uid other than the one one stack had read;
    that stack's worker directory belonged to nobody it ran, and every worker start failed on
    Permission denied. Now one ``up`` creates the user and the others read what it made."""
    made: dict[str, pwd.struct_passwd] = {}
    calls: list[list[str]] = []

    def getpwnam(name: str) -> pwd.struct_passwd:
        if name not in made:
            raise KeyError(name)
        return made[name]

    def useradd(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        time.sleep(0.3)  # long enough for every thread to reach its own useradd
        made[argv[-1]] = pwd.struct_passwd((argv[-1], "x", 4242, 4242, "", "/", "/bin/false"))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(worker_user.pwd, "getpwnam", getpwnam)
    monkeypatch.setattr(worker_user.subprocess, "run", useradd)
    config = StackConfig(state_dir=tmp_path)
    accounts: list[worker_user.WorkerAccount] = []
    threads = [
        threading.Thread(target=lambda: accounts.append(worker_user._account(config)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [argv[0] for argv in calls] == ["useradd"]
    assert accounts == [worker_user.WorkerAccount(WORKER_USER, 4242, 4242)] * 3
    assert (ledger.parent / worker_user.ACCOUNT_LOCK).exists()  # beside the ledger, root's


def test_an_interpreter_out_of_reach_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, account: worker_user.WorkerAccount
) -> None:
    """The revert's failure: the worker user could not exec a venv's python in a 0700
    directory, and the reach check raised PermissionError."""
    private, _ = _checkout(tmp_path)
    python = private / "python"
    python.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(python))
    config = StackConfig(state_dir=tmp_path / "state")
    with pytest.raises(StackError) as refused:
        worker_user._check_reach(config, account)
    assert len(str(refused.value).splitlines()) == 1
    assert f"worker user {account.name!r} cannot run {python}" in str(refused.value)


def test_up_stopped_by_the_reach_check_leaves_no_grant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Passage granted, the interpreter still refuses the worker (0700): one line, and the
    grants this ``up`` made are taken back at once."""
    private, _ = _checkout(tmp_path)
    before = _acl(private)
    python = private / "checkout" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o700)
    monkeypatch.setattr(sys, "executable", str(python))
    config = StackConfig(state_dir=tmp_path / "state")
    with pytest.raises(StackError) as refused:
        worker_user.ensure(config, "0" * 64)
    assert len(str(refused.value).splitlines()) == 1
    assert str(config.state_dir) not in _stacks_in_host_ledger()
    assert _acl(private) == before


def test_the_worker_reads_its_own_key_copy_and_no_admin_credential(tmp_path: Path) -> None:
    config = StackConfig(state_dir=tmp_path / "state", worker_user=WORKER_USER)
    config.state_dir.mkdir(mode=0o700)
    credentials.ensure(config.state_dir)
    key = credentials.workflow_key(config.state_dir)
    try:
        account = worker_user.ensure(config, key)
        assert account.uid != 0
        copy = worker_user.worker_key_file(config)
        found = copy.stat()
        assert (found.st_uid, found.st_mode & 0o777) == (account.uid, 0o400)
        secret_files = sorted(credentials.secrets_dir(config.state_dir).iterdir())
        assert credentials.CREDENTIALS_FILE in {path.name for path in secret_files}
        # even with passage down to them (more than `up` grants), their modes refuse the worker
        grants.grant(tmp_path / "probe", account.uid, account.gid, secret_files)
        probe = (
            "import json, sys\n"
            "def read(path):\n"
            "    try:\n"
            "        return open(path).read().strip()\n"
            "    except PermissionError:\n"
            "        return 'PermissionError'\n"
            "print(json.dumps([read(path) for path in sys.argv[1:]]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe, str(copy), *map(str, secret_files)],
            user=account.uid,
            group=account.gid,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(done.stdout) == [key] + ["PermissionError"] * len(secret_files)
    finally:
        grants.revoke(tmp_path / "probe")
        worker_user.remove(config)
    assert not worker_user.worker_dir(config).exists()
    assert str(config.state_dir) not in _stacks_in_host_ledger()


def test_a_worker_running_as_the_admin_is_the_finding_workers_not_separated(
    tmp_path: Path, account: worker_user.WorkerAccount, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not as root, ``up`` runs the workers as the state directory's owner: ``status``
    reports it (this process stands in for such a worker); a worker user's process is not."""
    config = StackConfig(state_dir=tmp_path)
    line = worker_user.separation(config, "worker-cpu", os.getpid())
    assert line is not None
    assert line.startswith(f"{FindingKind.WORKERS_NOT_SEPARATED.value}: worker-cpu: runs as uid")
    confined = subprocess.Popen(["sleep", "30"], user=account.uid, group=account.gid)
    try:
        assert worker_user.separation(config, "worker-cpu", confined.pid) is None
    finally:
        confined.kill()
        confined.wait()
    assert worker_user.separation(config, "worker-cpu", None) is None

    shown = ServiceStatus("worker-cpu", "RUNNING", 1, True, True, None, tmp_path, finding=line)
    assert cli._print_status([shown], False, "header") == 0
    assert f"  {line}\n" in capsys.readouterr().out  # one line; the worker stays healthy


def test_without_the_acl_tools_up_stops_in_one_line_and_records_nothing(
    tmp_path: Path,
    ledger: Path,
    account: worker_user.WorkerAccount,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, code = _checkout(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(StackError) as refused:
        grants.grant(tmp_path / "stack", account.uid, account.gid, [code])
    assert len(str(refused.value).splitlines()) == 1
    assert "install the Debian package acl" in str(refused.value)
    assert json.loads(ledger.read_text()) == []
