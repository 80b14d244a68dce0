"""Which processes belong to a stack service, and the launcher that leaves no orphan behind
(docs/stack.md#no-orphans-honest-health).

supervisord makes each program the leader of its own process group, but a group is not the whole
story: after ``kill -9`` of a supervised pid its children live on (MLflow's uvicorn still holding
the port, a worker's flow runs and ``flows/warm.py``), Prefect's process worker starts a flow run
without a command in a new session, and PostgreSQL's children each lead their own group.
So every program is started through :func:`launch` (this file run as a script: the standard
library only, no package import), which

1. marks the service in the environment (``DEVSTACK_SERVICE=<state dir>::<service>``), which
   every descendant inherits, whatever group or session it moves to;
2. ends what is left of an earlier instance of the same service (marked processes other than
   itself: SIGTERM, then SIGKILL), so a restarted service never finds its port held by an orphan;
3. execs the service, so the pid supervisord supervises and signals is the service itself.

:func:`marked` finds a service's (or a whole stack's) processes by that mark in
``/proc/<pid>/environ`` (the environment a process was started with, which a process changing its
own variables does not rewrite); :func:`listeners` finds who holds a listening port.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

MARK = "DEVSTACK_SERVICE"
TERM_GRACE_S = 5.0


def mark(state_dir: str | Path, service: str) -> str:
    return f"{Path(state_dir).absolute()}::{service}"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, …), or
    None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def marked(state_dir: str | Path, service: str | None = None) -> list[int]:
    """Live processes marked as ``service`` of the stack in ``state_dir`` (any of its services
    when ``service`` is None)."""
    prefix = f"{MARK}={mark(state_dir, service or '')}".encode()
    found = []
    for pid in _pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        entries = environ.split(b"\0")
        hit = (
            any(e == prefix for e in entries)
            if service
            else any(e.startswith(prefix) for e in entries)
        )
        if hit and alive(pid):
            found.append(pid)
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (supervisord makes each program a group)."""
    members = []
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(pid)
    return members


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for candidate in _pids():
        up = parent(candidate)
        if up is not None:
            children.setdefault(up, []).append(candidate)
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found and alive(current):
            found.add(current)
            todo.extend(children.get(current, []))
    return found


def started_at(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), or None when it is gone."""
    fields = _stat(pid)
    try:
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration):
        return None
    if fields is None:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def listeners(ports: list[int] | tuple[int, ...]) -> dict[int, set[int]]:
    """For each TCP port, the pids holding a socket that listens on it (IPv4 or IPv6)."""
    wanted = set(ports)
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if fields[3] == "0A" and port in wanted:  # 0A: LISTEN
                inodes[f"socket:[{fields[9]}]"] = port
    holders: dict[int, set[int]] = {port: set() for port in wanted}
    if not inodes:
        return holders
    for pid in _pids():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                port = inodes.get(os.readlink(fd))
            except OSError:
                continue
            if port is not None:
                holders[port].add(pid)
    return holders


def ports_problem(pid: int, ports: list[int] | tuple[int, ...]) -> str | None:
    """Which of ``ports`` is not listened on, or is listened on by a process other than
    ``pid`` and its descendants (``None``: ``pid``'s own, every one)."""
    own = descendants(pid)
    for port, held in sorted(listeners(ports).items()):
        if not held:
            return f"nothing listens on port {port}"
        others = sorted(held - own)
        if others:
            return f"port {port} is also held by {', '.join(map(_described, others))}"
    return None


def _described(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} ({' '.join(a.decode(errors='replace') for a in argv if a)[:80]})"


def owns_ports(pid: int | None, ports: list[int] | tuple[int, ...]) -> bool:
    """Whether every one of ``ports`` is listened on, and only by ``pid`` or its descendants:
    the service supervisord started answers there, not an orphan of an earlier one."""
    if pid is None or not alive(pid):
        return False
    return not ports or ports_problem(pid, ports) is None


def end(pids: list[int], grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM ``pids``, SIGKILL those still alive after ``grace_s``; returns the pids that
    were alive when called."""
    live = [p for p in pids if alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in live:
            try:
                os.kill(pid, sig)
            except OSError:
                continue
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while any(alive(p) for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(alive(p) for p in live):
            break
    return live


def launch(state_dir: str, service: str, argv: list[str]) -> None:
    """End what is left of an earlier ``service`` of this stack, then become ``argv``."""
    own = mark(state_dir, service)
    if os.environ.get(MARK) != own:
        os.environ[MARK] = own  # supervisord sets it; set it for a launch by hand too
        os.execv(sys.executable, [sys.executable, __file__, state_dir, service, *argv])
    leftovers = [p for p in marked(state_dir, service) if p != os.getpid()]
    ended = end(leftovers)
    if ended:
        print(
            f"devstack: ended {len(ended)} leftover process(es) of {service}: {ended}", flush=True
        )
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    launch(sys.argv[1], sys.argv[2], sys.argv[3:])
