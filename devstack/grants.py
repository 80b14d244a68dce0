"""Traverse grants for the worker user above the checkout and the interpreter
(docs/stack.md#worker-user).

The worker user runs this checkout's virtual environment and code, wherever the checkout is:
a clone in a ``mktemp -d`` directory (0700, root's) is out of its reach. For each directory
above those paths that the worker user cannot traverse, :func:`grant` adds one POSIX ACL entry
``u:<worker uid>:x`` (``setfacl``, package ``acl``): that user may pass through, nobody else
gains anything, and it lists nothing. Each grant is recorded in :data:`LEDGER` (root's, 0600,
in a 0700 directory) with the entry it replaced and the stacks that need it; :func:`revoke`
(``down``) takes a stack's name off and, once no stack needs a grant, restores exactly what it
replaced. Every failure is a :class:`~devstack.config.StackError` of one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from devstack.config import StackError

LEDGER = Path("/var/lib/dpmerge/worker-grants.json")
"""The grants of every stack on this host (root's; a module attribute tests point elsewhere)."""
TIMEOUT_S = 30.0


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    except (OSError, subprocess.SubprocessError) as error:
        raise StackError(f"{argv[0]} failed: {error}") from None


def _acl(argv: list[str]) -> str:
    """Run ``setfacl``/``getfacl``; its output, or one line naming what failed."""
    if shutil.which(argv[0]) is None:
        raise StackError(
            f"{argv[0]} not found: install the Debian package acl (scripts/setup.sh) so the "
            "worker user can reach the checkout"
        )
    done = _run(argv)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StackError(f"{' '.join(argv)} failed: {last}")
    return done.stdout


def above(targets: Iterable[Path]) -> list[Path]:
    """Every directory above ``targets`` (their directories resolved, so a link's own
    directory counts), each once, parents before children."""
    found: dict[Path, None] = {}
    for target in targets:
        for directory in reversed((target.parent.resolve() / target.name).parents):
            found.setdefault(directory)
    return list(found)


def traversable(directory: Path, uid: int, gid: int) -> bool:
    """Whether ``uid`` passes through ``directory`` (asked as that user: ACLs count)."""
    done = _run(
        ["test", "-x", str(directory)], user=uid, group=gid, extra_groups=[], env={}, cwd="/"
    )
    return done.returncode == 0


def _entries(directory: Path) -> list[str]:
    text = _acl(["getfacl", "--numeric", "--absolute-names", "--omit-header", str(directory)])
    return [line.split("#")[0].strip() for line in text.splitlines() if line.strip()]


def _extended(entries: list[str]) -> bool:
    """Whether an ACL holds more than the mode bits: a named entry, a mask or a default."""
    for entry in entries:
        kind, who = entry.split(":")[:2]
        if kind in ("default", "mask") or (kind in ("user", "group") and who):
            return True
    return False


def _user_entry(entries: list[str], uid: int) -> str | None:
    """The permissions of ``uid``'s named entry (``r-x``), ``None`` without one."""
    for entry in entries:
        parts = entry.split(":")
        if parts[:2] == ["user", str(uid)]:
            return parts[2]
    return None


@contextmanager
def host_lock(name: str) -> Iterator[IO[str]]:
    """An exclusive lock shared by every stack on this host: the file ``name`` in the ledger's
    directory (this user's only, 0700; created here), opened and held until the block ends."""
    LEDGER.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    found = LEDGER.parent.lstat()
    if found.st_uid != os.geteuid() or found.st_mode & 0o077:
        raise StackError(f"{LEDGER.parent} is not a private directory of uid {os.geteuid()}")
    path = LEDGER.parent / name
    with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle


@contextmanager
def _ledger() -> Iterator[list[dict[str, Any]]]:
    """The ledger's grants, locked; written back when the block ends, also after a failure (a
    grant is listed once ``setfacl`` made it)."""
    with host_lock(LEDGER.name) as handle:
        text = handle.read()
        try:
            entries = json.loads(text) if text else []
        except json.JSONDecodeError as error:
            raise StackError(f"{LEDGER} is not a grant ledger ({error})") from None
        try:
            yield entries
        finally:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(entries, indent=1))


def grant(stack: Path, uid: int, gid: int, targets: Iterable[Path]) -> list[Path]:
    """Let ``uid`` pass through every directory above ``targets``, recorded for ``stack``
    (its state directory); the directories that needed a grant."""
    granted = []
    with _ledger() as entries:
        for directory in above(targets):
            found = [e for e in entries if e["dir"] == str(directory) and e["uid"] == uid]
            if found:
                entry = found[0]
            elif traversable(directory, uid, gid):
                continue
            else:
                acl = _entries(directory)
                entry = {"dir": str(directory), "uid": uid, "prior": _user_entry(acl, uid)}
                entry |= {"extended": _extended(acl), "stacks": []}
            perms = (entry["prior"] or "---")[:2] + "x"
            _acl(["setfacl", "-m", f"u:{uid}:{perms}", str(directory)])
            if not found:
                entries.append(entry)
            if str(stack) not in entry["stacks"]:
                entry["stacks"].append(str(stack))
            granted.append(directory)
    return granted


def _restore(entry: dict[str, Any]) -> None:
    directory = entry["dir"]
    if not Path(directory).is_dir():
        return
    if entry["prior"] is not None:
        _acl(["setfacl", "-m", f"u:{entry['uid']}:{entry['prior']}", directory])
        return
    _acl(["setfacl", "-x", f"u:{entry['uid']}", directory])
    if not entry["extended"] and not _extended(
        [e for e in _entries(Path(directory)) if not e.startswith("mask:")]
    ):
        _acl(["setfacl", "-b", directory])  # the mask setfacl -m added goes too


def revoke(stack: Path) -> None:
    """Take ``stack`` off every grant; restore each grant no other stack needs (a grant whose
    restore failed stays listed, so the next ``down`` tries again)."""
    if not LEDGER.exists():
        return
    with _ledger() as entries:
        for entry in list(entries):
            if str(stack) not in entry["stacks"]:
                continue
            others = [each for each in entry["stacks"] if each != str(stack)]
            if not others:
                _restore(entry)
                entries.remove(entry)
            entry["stacks"] = others
