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
directory at ``down``.
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

from devstack.config import WORKER_USER, StackConfig, StackError, repo_root

REACH_TIMEOUT_S = 120.0


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
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise StackError(f"useradd {name} failed: {made.stderr.strip()}") from None
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        raise StackError(f"worker user {name!r} is root: the workers must not run as root")
    return WorkerAccount(name, entry.pw_uid, entry.pw_gid)


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


def _check_reach(config: StackConfig, account: WorkerAccount) -> None:
    """The worker user runs this interpreter and reads the code, or ``up`` stops here."""
    if account.name is None:
        return
    probe = repo_root() / "pyproject.toml"
    done = subprocess.run(
        [sys.executable, "-c", f"open({str(probe)!r}).close()"],
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        cwd=worker_dir(config),
        env={"PATH": os.defpath},
        capture_output=True,
        text=True,
        timeout=REACH_TIMEOUT_S,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StackError(
            f"worker user {account.name!r} cannot run {sys.executable} or read {probe} "
            f"(every parent directory needs o+x): {last}"
        )


def ensure(config: StackConfig, key: str) -> WorkerAccount:
    """The worker account (created as root if missing), its directory and its key copy."""
    account = _account(config)
    _own_dir(worker_dir(config), account)
    _write_key(worker_key_file(config), key, account)
    _check_reach(config, account)
    return account


def remove(config: StackConfig) -> None:
    """The worker's directory gone (``down``, its processes ended): no key copy is left."""
    shutil.rmtree(worker_dir(config), ignore_errors=True)
