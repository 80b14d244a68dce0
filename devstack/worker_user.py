"""The account the workers, their flow runs and the dispatcher run as (docs/stack.md#worker-user).

As root, ``up`` creates the system user :data:`WORKER_USER` once (``useradd --system
--no-create-home``) unless ``StackConfig.worker_user`` names another existing user, and
supervisord starts those programs as it: a command that a changed pool template runs can read
neither ``STATE/secrets/`` (root, 0700) nor another service's environment. Not root, everything
runs as the invoking user, and there is no such separation.

The worker's own directory (:func:`worker_dir`, 0700, its owner) lies outside the state
directory, whose parents need not be open to it: ``$HOME``, ``$PREFECT_HOME``, ``$DPMERGE_HOME``
(the warm server's ``run/``), the dispatcher's heartbeat, and its copy of the workflow key
(0400), written at every ``up`` from ``STATE/secrets/workflow.key`` and removed with the
directory at ``down``. It reaches the interpreter and the checkout wherever they are: ``up``
grants it passage through the directories above them that it cannot traverse
(:mod:`devstack.grants`), checks as that user that it runs the interpreter and reads the code,
and ``down`` takes the grants back. Not root, ``status`` reports each worker and the dispatcher
as a ``workers_not_separated`` finding; the stack works as before.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import dpmerge
from devstack import grants
from devstack.config import WORKER_USER, StackConfig, StackError, repo_root
from dpmerge.findings import Finding
from dpmerge.vocabulary import FindingKind

REACH_TIMEOUT_S = 120.0
ACCOUNT_LOCK = "worker-user.lock"
"""The host lock (:func:`devstack.grants.host_lock`) under which ``up`` creates the user."""


@dataclass(frozen=True)
class WorkerAccount:
    """Who the workers run as: ``name`` ``None`` for the invoking user (not root)."""

    name: str | None
    uid: int
    gid: int


def worker_dir(config: StackConfig) -> Path:
    """The worker's directory: ``$TMPDIR/dpmerge-worker-<digest of the state directory>``."""
    digest = hashlib.sha256(str(config.state_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"dpmerge-worker-{digest}"


def worker_key_file(config: StackConfig) -> Path:
    return worker_dir(config) / "workflow.key"


def heartbeat_file(config: StackConfig) -> Path:
    return worker_dir(config) / "dispatcher.heartbeat"


def supervised_user(config: StackConfig) -> str | None:
    """The ``user`` supervisord gives the worker programs: the worker user as root, else none."""
    return config.worker_user if os.geteuid() == 0 else None


def _account(config: StackConfig) -> WorkerAccount:
    name = supervised_user(config)
    if name is None:
        return WorkerAccount(None, os.getuid(), os.getgid())
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if name != WORKER_USER:
            raise StackError(f"worker user {name!r} does not exist; create it first") from None
        entry = _create(name)
    if entry.pw_uid == 0:
        raise StackError(f"worker user {name!r} is root: the workers must not run as root")
    return WorkerAccount(name, entry.pw_uid, entry.pw_gid)


def _create(name: str) -> pwd.struct_passwd:
    """The user ``name``, created by one ``up`` at a time on this host. Concurrent ``useradd``
    runs (three stacks starting at once on a fresh machine) each reported success and left the
    user with a uid other than the one some of them had read: those stacks' worker directories
    belonged to no process they ran, and every worker start failed on Permission denied."""
    with grants.host_lock(ACCOUNT_LOCK):
        try:
            return pwd.getpwnam(name)  # made by another ``up`` while this one waited
        except KeyError:
            pass
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise StackError(f"useradd {name} failed: {made.stderr.strip()}") from None
        return pwd.getpwnam(name)


def _own_dir(path: Path, account: WorkerAccount) -> None:
    """``path`` a directory of ``account`` only (0700), created here or found so."""
    try:
        path.mkdir(mode=0o700)
        os.chown(path, account.uid, account.gid)
    except FileExistsError:
        pass
    found = path.lstat()
    if (
        not stat.S_ISDIR(found.st_mode)
        or found.st_uid != account.uid
        or stat.S_IMODE(found.st_mode) != 0o700
    ):
        raise StackError(
            f"{path} is not a 0700 directory of uid {account.uid}; remove it and run `up` again"
        )


def _write_key(path: Path, key: str, account: WorkerAccount) -> None:
    """The key copy, 0400, the worker's: written through a new file (never a link the worker
    placed) and renamed over the old one."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    with os.fdopen(descriptor, "w") as sink:
        os.fchown(descriptor, account.uid, account.gid)
        sink.write(key + "\n")
    temporary.replace(path)


def separation(config: StackConfig, name: str, pid: int | None) -> str | None:
    """A ``workers_not_separated`` finding's line for the service ``name`` when its process
    runs as the state directory's owner (``up`` not as root), else ``None``."""
    try:
        uid = Path(f"/proc/{pid}").stat().st_uid
        admin = config.state_dir.stat().st_uid
    except OSError:
        return None
    if uid != admin:
        return None
    detail = (
        f"runs as uid {uid}, the state directory's owner, so a flow run or a changed pool "
        "template reads STATE/secrets/; run `dpmerge stack up` as root to separate them"
    )
    return Finding(FindingKind.WORKERS_NOT_SEPARATED, name, detail).line()


def reach_targets(config: StackConfig) -> list[Path]:
    """What the worker user runs and reads: this interpreter (its link and what it names), the
    checkout, the code this process imported, ``$PYTHONPATH`` and its own directory."""
    executable = Path(sys.executable)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return [
        executable,
        executable.resolve(),
        repo_root() / "pyproject.toml",
        Path(dpmerge.__file__).parent,
        *(Path(path) / "." for path in paths if path),
        worker_dir(config),
    ]


def _check_reach(config: StackConfig, account: WorkerAccount) -> None:
    """The worker user runs this interpreter and reads the code, or ``up`` stops here with
    one line."""
    probe = repo_root() / "pyproject.toml"
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"open({str(probe)!r}).close(); import flows"],
            user=account.uid,
            group=account.gid,
            extra_groups=[],
            cwd=repo_root(),
            env={"PATH": os.defpath},
            capture_output=True,
            text=True,
            timeout=REACH_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as error:
        last = str(error)
    else:
        if done.returncode == 0:
            return
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise StackError(
        f"worker user {account.name!r} cannot run {sys.executable} or read {probe} "
        f"(the checkout and the environment must be readable by it): {last}"
    )


def ensure(config: StackConfig, key: str) -> WorkerAccount:
    """The worker account (created as root if missing), its directory, its key copy and its
    way to the code (:func:`devstack.grants.grant`, checked as that user)."""
    account = _account(config)
    _own_dir(worker_dir(config), account)
    _write_key(worker_key_file(config), key, account)
    if account.name is not None:
        grants.grant(config.state_dir, account.uid, account.gid, reach_targets(config))
        try:
            _check_reach(config, account)
        except StackError:
            grants.revoke(config.state_dir)  # no passage left for a stack that did not start
            raise
    return account


def remove(config: StackConfig) -> None:
    """The worker's directory gone (``down``, its processes ended): no key copy is left; the
    grants no other stack needs are taken back."""
    shutil.rmtree(worker_dir(config), ignore_errors=True)
    if os.geteuid() == 0:
        grants.revoke(config.state_dir)
