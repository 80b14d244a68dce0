"""supervisord runs the stack's processes; this module writes its configuration and talks to it.

One supervisord per state directory, configured by ``STATE/supervisord.conf`` (written from
:func:`devstack.services.services`) and controlled over the XML-RPC socket
``STATE/supervisor.sock``. Every program has ``autostart=false`` (``up`` starts them stage by
stage after health waits), ``autorestart=true`` (a crashed service comes back), and
``stopasgroup``/``killasgroup`` (MLflow's uvicorn child and a worker's flow-run subprocesses
stop with their parent); ``stopwaitsecs`` is the service's stop timeout, after which supervisord
sends SIGKILL. Each program starts through :func:`devstack.processes.launch`, which marks it and
ends what an earlier instance of it left behind. The configuration holds the services'
passwords: it is written 0600. Logs: ``STATE/logs/<service>.log`` and
``STATE/logs/supervisord.log``; pid file ``STATE/pids/supervisord.pid`` (a service's pid:
:meth:`Supervisor.info`).
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor.xmlrpc import Faults, SupervisorTransport

from devstack import processes
from devstack.config import StackConfig, StackError, repo_root
from devstack.credentials import write_private
from devstack.services import Service, executable
from dpmerge.environment import TELEMETRY_OFF

MAX_SOCKET_PATH = 100  # a unix socket path must fit in 108 bytes
START_TIMEOUT_S = 30.0
ACTIVE_STATES = frozenset({"STARTING", "RUNNING", "BACKOFF", "STOPPING"})


@dataclass(frozen=True)
class ProcessInfo:
    """supervisord's view of one program (``state``: STOPPED, STARTING, RUNNING, BACKOFF,
    STOPPING, EXITED, FATAL or UNKNOWN)."""

    name: str
    state: str
    pid: int | None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def log_tail(path: Path) -> str:
    """The last non-empty line of a service's log, for a one-line error (the log names the
    rest)."""
    try:
        text = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    found = [line for line in text if line]
    return found[-1][-300:] if found else "(empty log)"


def _escape(value: str) -> str:
    """A value as supervisord reads it: ``%`` doubled (its interpolation), double-quoted."""
    if '"' in value or "\n" in value:
        raise StackError(f"the stack cannot pass {value!r} to supervisord (quote or newline)")
    return '"' + value.replace("%", "%%") + '"'


def _program(config: StackConfig, service: Service, log: Path) -> str:
    """One ``[program:…]``: the service started through the launcher
    (:func:`devstack.processes.launch`), which marks it and ends what an earlier instance left."""
    env: Mapping[str, str] = {
        **TELEMETRY_OFF,
        **service.env,
        processes.MARK: processes.mark(config.state_dir, service.name),
    }
    launcher = (sys.executable, processes.__file__, str(config.state_dir), service.name)
    lines = [
        f"[program:{service.name}]",
        "command = " + shlex.join((*launcher, *service.argv)).replace("%", "%%"),
        "environment = " + ",".join(f"{k}={_escape(v)}" for k, v in env.items()),
        f"directory = {service.cwd or repo_root()}",
        f"priority = {100 * (service.stage + 1)}",
        "autostart = false",
        "autorestart = true",
        "startsecs = 1",
        "startretries = 5",
        f"stopsignal = {service.stop_signal}",
        f"stopwaitsecs = {service.stop_timeout_s:.0f}",
        "stopasgroup = true",
        "killasgroup = true",
        "redirect_stderr = true",
        f"stdout_logfile = {log}",
        "stdout_logfile_maxbytes = 20MB",
        "stdout_logfile_backups = 2",
    ]
    if service.user is not None:
        lines.append(f"user = {service.user}")
    return "\n".join(lines) + "\n"


class Supervisor:
    """The supervisord of one state directory."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.conf_path = config.state_dir / "supervisord.conf"
        self.socket_path = config.state_dir / "supervisor.sock"
        self.pid_path = config.state_dir / "pids" / "supervisord.pid"
        self.log_path = config.logs_dir / "supervisord.log"

    def log_of(self, name: str) -> Path:
        return self.config.logs_dir / f"{name}.log"

    def render(self, services: Iterable[Service]) -> str:
        head = f"""; written by `dpmerge stack up` (devstack/supervisor.py); edits are overwritten
[unix_http_server]
file = {self.socket_path}
chmod = 0700

[supervisord]
logfile = {self.log_path}
logfile_maxbytes = 5MB
logfile_backups = 2
pidfile = {self.pid_path}
childlogdir = {self.config.logs_dir}
directory = {repo_root()}
identifier = devstack

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl = unix://{self.socket_path}
"""
        programs = (_program(self.config, s, self.log_of(s.name)) for s in services)
        return "\n".join([head, *programs])

    # --- the daemon --------------------------------------------------------------------

    def _rpc(self) -> xmlrpc.client.ServerProxy:
        transport = SupervisorTransport(None, None, f"unix://{self.socket_path}")
        return xmlrpc.client.ServerProxy("http://localhost", transport=transport)

    def running(self) -> bool:
        if not self.socket_path.exists():
            return False
        try:
            return self._rpc().supervisor.getState()["statename"] == "RUNNING"
        except (OSError, xmlrpc.client.Error):
            return False

    def pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None

    def ensure_running(self, services: list[Service]) -> bool:
        """Write the configuration and start supervisord unless it runs already (then the
        configuration must be the one it runs with). True if this call started it."""
        text = self.render(services)
        if self.running():
            if not self.conf_path.is_file() or self.conf_path.read_text() != text:
                raise StackError(
                    f"the stack in {self.config.state_dir} runs with other settings; "
                    "stop it first (`dpmerge stack down`)"
                )
            return False
        if len(str(self.socket_path)) > MAX_SOCKET_PATH:
            raise StackError(
                f"state directory {self.config.state_dir} is too long a path for supervisord's "
                f"socket (at most {MAX_SOCKET_PATH - 16} characters): choose a shorter --state-dir"
            )
        for directory in (self.config.logs_dir, self.pid_path.parent):
            directory.mkdir(parents=True, exist_ok=True)
        write_private(self.conf_path, text)  # it holds the services' passwords
        out = self.config.logs_dir / "supervisord.out"
        with out.open("ab") as sink:
            # supervisord daemonizes: this returns once it has forked into its own session.
            code = subprocess.call(
                [executable("supervisord"), "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while code == 0 and time.monotonic() < deadline:
            if self.running():
                return True
            time.sleep(0.1)
        raise StackError(
            f"supervisord did not start (exit code {code}); last log line: "
            f"{log_tail(out)}; log {out}"
        )

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop supervisord (after its programs) and wait until its process is gone."""
        pid = self.pid()
        with contextlib.suppress(OSError, xmlrpc.client.Error):  # already stopping or gone
            self._rpc().supervisor.shutdown()
        deadline = time.monotonic() + timeout_s
        while pid is not None and processes.alive(pid):
            if time.monotonic() > deadline:
                raise StackError(f"supervisord (pid {pid}) still running; log {self.log_path}")
            time.sleep(0.1)

    # --- programs ----------------------------------------------------------------------

    def info(self, name: str) -> ProcessInfo:
        if not self.running():
            return ProcessInfo(name, "STOPPED", None)
        try:
            raw = self._rpc().supervisor.getProcessInfo(name)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode == Faults.BAD_NAME:
                return ProcessInfo(name, "STOPPED", None)
            raise
        return ProcessInfo(name, raw["statename"], raw["pid"] or None)

    def start(self, name: str) -> None:
        """Ask supervisord to start ``name`` and return at once (the caller waits for health)."""
        try:
            self._rpc().supervisor.startProcess(name, False)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode != Faults.ALREADY_STARTED:
                raise StackError(
                    f"supervisord could not start {name}: {fault.faultString}; "
                    f"log {self.log_of(name)}"
                ) from None

    def stop(self, name: str) -> None:
        """Ask supervisord to stop ``name`` (SIGTERM to its group, SIGKILL after its
        ``stopwaitsecs``) and return at once."""
        try:
            self._rpc().supervisor.stopProcess(name, False)
        except xmlrpc.client.Fault as fault:
            if fault.faultCode not in (Faults.NOT_RUNNING, Faults.BAD_NAME):
                raise
