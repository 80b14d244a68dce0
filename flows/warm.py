"""Start each flow run from a warm process instead of a fresh interpreter
(docs/workflow.md#time-to-policy).

A fresh ``python -m prefect.engine`` spends seconds importing Prefect, torch, MLflow and
dp-accounting before the flow's first line; on a loaded two-core host that was most of the
time from a policy event to the alias. The ``cpu`` pool's command (devstack/provision.py) is
``python -m flows.warm`` instead, run by the process worker like the engine would be, with the
worker host's own interpreter and installed package (docs/workflow.md#worker-hosts):

* **client** (the default): connect to the warm server of this code and hand it the run —
  its environment, working directory and the worker's stdin/stdout/stderr (passed as file
  descriptors, so logs stream to the worker as before) — then wait and exit with the run's
  exit code. With no server yet it starts one and waits for it to be ready (it costs the same
  imports the cold start would); whatever fails, it falls back to ``python -m prefect.engine``.
* **server** (``--serve SOCKET``): imports Prefect's engine and the flows once (and has the
  registry and storage prepare what each run would pay once per process), then for each run forks
  a child that takes the run's environment and file descriptors, refreshes Prefect's settings and
  runs the engine's ``__main__``. The server runs no torch operation, opens no client connection
  and starts no thread, so forking it is safe. When a client goes away (the worker cancelled or
  killed the run), its child gets SIGTERM, and SIGKILL if it still runs :data:`TERM_GRACE_S`
  later (Prefect's SIGTERM handler raises an exception wherever the child is; raised inside an
  interpreter callback it is only printed, and the child ran on, blocked). A child that ends by a
  signal cannot report its run, so a short-lived fork of the server marks the run ``Crashed``
  unless it is final already: a killed run never stays ``Running``.

Safety: the socket lives in a 0700 directory ``run/`` under ``$DPMERGE_HOME`` (default
``.dpmerge/`` of the checkout this module is in, or ``~/.dpmerge`` where the package is installed)
and its name includes a digest of the interpreter, the code's location and the mtimes of its
Python files, so changed code gets a new server (an idle server exits after
:data:`IDLE_EXIT_S`). The server is started in the worker's process group, so stopping the
worker (``dpmerge stack down`` signals the group) stops it too. Each child reseeds Python's and
NumPy's generators (the RS draw uses the OS's generator anyway).

Only the standard library is imported until a process knows which role it has.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
"""The checkout this module is in, or the site-packages directory it is installed in."""
MODULE = "flows.warm"
CODE_DIRS = ("dpmerge", "flows", "tasks")
PRELOAD = (
    "prefect.engine",
    "prefect.flow_engine",
    "prefect._internal.metrics",
    "flows.merge",
    "flows.training",
    "flows.report",
    "flows.verify",
    # what the first torch.export of a run imports (≈ 1.3 s): the registry saves pt2 models.
    # Imports only: no torch operation runs and no thread starts before the fork.
    "torch.export",
    "torch._dynamo",
    "torch._export.non_strict_utils",
    "torch._functorch.aot_autograd",
    "torch.fx.experimental.symbolic_shapes",
)
IDLE_EXIT_S = 1800.0
TERM_GRACE_S = 20.0
"""Seconds a run's child has to stop after SIGTERM before it is killed."""
MAX_RUNS_ENV = "DPMERGE_WARM_MAX_RUNS"
MAX_RUNS = 4
"""Runs started at once; later ones wait in the server (their clients wait too). A burst of 50
runs starting together made the local stack's sqlite-backed Prefect server time out."""
READY_TIMEOUT_S = 120.0
MAX_MESSAGE = 1 << 20
SOCKET_PATH_LIMIT = 100
"""AF_UNIX addresses are limited to 107 bytes on Linux; a longer socket path is reached
through its directory's descriptor (:func:`_address`)."""


def run_dir() -> Path:
    default = REPO if (REPO / "pyproject.toml").is_file() else Path.home()
    return Path(os.environ.get("DPMERGE_HOME") or default / ".dpmerge") / "run"


def code_stamp() -> str:
    """A digest of the interpreter, the code's location and its Python files' mtimes."""
    digest = hashlib.sha256(f"{sys.executable}\0{REPO}".encode())
    for folder in CODE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(f"{path}\0{path.stat().st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def socket_path() -> Path:
    return run_dir() / f"engine-{code_stamp()}.sock"


def _send(sock: socket.socket, document: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(document).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def _receive(sock: socket.socket, fds: int = 0) -> tuple[dict | None, list[int]]:
    if fds:
        data, received, _, _ = socket.recv_fds(sock, MAX_MESSAGE, fds)
    else:
        data, received = sock.recv(MAX_MESSAGE), []
    return (json.loads(data) if data else None), list(received)


# --- client --------------------------------------------------------------------------------


def client() -> int:
    path = socket_path()
    sock = _connect(path) or _start_server(path)
    if sock is not None:
        return _hand_over(sock)
    os.execv(sys.executable, [sys.executable, "-m", MODULE, "--run"])
    return 1  # not reached


@contextlib.contextmanager
def _address(path: Path) -> Iterator[str]:
    """``path`` as an AF_UNIX address: itself, or where it is longer than
    :data:`SOCKET_PATH_LIMIT` (a deep ``$HOME``), ``/proc/self/fd/N/NAME`` through a descriptor
    of its directory, which names the same file behind the same 0700 directory."""
    if len(str(path)) <= SOCKET_PATH_LIMIT:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with _address(path) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_server(path: Path) -> socket.socket | None:
    """Start the server for ``path`` (unless another client just did) and wait until it
    accepts; ``None`` when it does not come up in time."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    with open(directory / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(path)
        if sock is not None:
            return sock
        log = open(directory / f"{path.stem}.log", "ab")  # noqa: SIM115 (the server owns it)
        server = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--serve", str(path)],
            cwd=directory,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={k: v for k, v in os.environ.items() if not k.startswith("PREFECT__")},
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and server.poll() is None:
            sock = _connect(path)
            if sock is not None:
                return sock
            time.sleep(0.1)
        return _connect(path)  # None: it failed to start (see its log); this run starts cold


def _hand_over(sock: socket.socket) -> int:
    request = {"env": dict(os.environ), "cwd": os.getcwd()}
    try:
        _send(sock, request, [0, 1, 2])
        while True:
            reply, _ = _receive(sock)
            if reply is None:  # the server went away mid-run
                return 1
            if "exit" in reply:
                return int(reply["exit"])
    finally:
        sock.close()


# --- server --------------------------------------------------------------------------------


def serve(path: Path) -> int:
    sys.path.insert(0, str(REPO))
    for module in PRELOAD:
        __import__(module)
    from dpmerge import storage
    from dpmerge.registry import prepare_process

    prepare_process()
    storage.prepare_process()
    listener = _bind(path)
    if listener is None:
        return 0  # another server holds the path
    limit = int(os.environ.get(MAX_RUNS_ENV) or MAX_RUNS)
    children: dict[int, _Child] = {}
    waiting: list[tuple[socket.socket, dict, list[int]]] = []  # runs beyond the limit, in order
    last_activity = time.monotonic()
    try:
        while children or waiting or time.monotonic() - last_activity < IDLE_EXIT_S:
            clients = [c.client for c in children.values() if c.client is not None]
            watched = [listener, *clients, *(c for c, _, _ in waiting)]
            readable, _, _ = select.select(watched, [], [], 0.5)
            for sock in readable:
                if sock is listener:
                    connection, _ = listener.accept()
                    request, fds = _receive(connection, fds=3)
                    if request is None or len(fds) != 3:
                        _close(connection, fds)
                        continue
                    waiting.append((connection, request, fds))
                    last_activity = time.monotonic()
                elif not sock.recv(MAX_MESSAGE):  # a client hung up: stop or drop its run
                    _hung_up(sock, children, waiting)
            _reap(children, listener)
            _kill_stragglers(children)
            while waiting and len(children) < limit:
                connection, request, fds = waiting.pop(0)
                pid = _fork(connection, request, fds, listener)
                children[pid] = _Child(connection, dict(request["env"]))
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    return 0


def _close(connection: socket.socket, fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    connection.close()


@dataclass
class _Child:
    """A forked run: its client (``None`` once gone), the run's environment and, once it was
    sent SIGTERM, when it is killed unless it has stopped (:data:`TERM_GRACE_S`)."""

    client: socket.socket | None
    env: dict[str, str]
    kill_at: float | None = None


def _hung_up(
    sock: socket.socket,
    children: dict[int, _Child],
    waiting: list[tuple[socket.socket, dict, list[int]]],
) -> None:
    """The worker cancelled or killed a run's client: SIGTERM its child, or drop it unstarted."""
    for pid, child in children.items():
        if child.client is sock:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: reaped later
                os.kill(pid, signal.SIGTERM)
            child.client, child.kill_at = None, time.monotonic() + TERM_GRACE_S
    for entry in [w for w in waiting if w[0] is sock]:
        waiting.remove(entry)
        _close(entry[0], entry[2])
    sock.close()


def _bind(path: Path) -> socket.socket | None:
    with open(path.parent / "bind.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _connect(path) is not None:
            return None
        path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with _address(path) as address:
            listener.bind(address)
        path.chmod(0o600)
        listener.listen(64)
    return listener


def _kill_stragglers(children: dict[int, _Child]) -> None:
    """SIGKILL each child still running :data:`TERM_GRACE_S` after its SIGTERM."""
    now = time.monotonic()
    for pid, child in children.items():
        if child.kill_at is not None and now >= child.kill_at:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            child.kill_at = None


def _reap(children: dict[int, _Child], listener: socket.socket) -> None:
    """Tell each finished child's client its exit code; a child ended by a signal has its run
    marked ``Crashed`` (:func:`_report_crash`). Reporters are reaped here too."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        child = children.pop(pid, None)
        if child is None:  # a reporter
            continue
        if os.WIFSIGNALED(status):
            _report_crash(child.env, os.WTERMSIG(status), listener)
        if child.client is not None:
            with contextlib.suppress(OSError):  # the client may be gone
                _send(child.client, {"exit": os.waitstatus_to_exitcode(status)})
            child.client.close()


def _report_crash(env: dict[str, str], signum: int, listener: socket.socket) -> None:
    """In a fork of the server (which holds no client and starts no thread): mark the run of
    ``env`` ``Crashed`` unless it is final already (its child was killed by ``signum`` and
    could not report it)."""
    if os.fork():
        return
    code = 1
    try:
        listener.close()
        os.environ.clear()
        os.environ.update(env)
        from prefect.client.orchestration import get_client
        from prefect.context import refresh_global_settings_context
        from prefect.states import Crashed

        refresh_global_settings_context()
        run_id = env["PREFECT__FLOW_RUN_ID"]
        with get_client(sync_client=True) as client:
            if not client.read_flow_run(run_id).state.is_final():
                message = f"the run's process ended by signal {signal.Signals(signum).name}"
                client.set_flow_run_state(run_id, Crashed(message=message))
        code = 0
    except BaseException:  # the server's log is where this process writes
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _fork(connection: socket.socket, request: dict, fds: list[int], listener: socket.socket) -> int:
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    code = 1
    try:
        listener.close()
        connection.close()
        code = _run_child(request, fds)
    finally:
        os._exit(code)


def _run_child(request: dict, fds: list[int]) -> int:
    """In the forked child: become the flow run's process and run Prefect's engine."""
    import random

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    sys.argv = [str(Path(__file__).resolve()), "--run"]
    code = 1
    try:
        code = run_engine()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def run_engine() -> int:
    """What ``python -m prefect.engine`` does for ``$PREFECT__FLOW_RUN_ID``, except that the
    run's final state is kept, not turned back into an exception: a flow that ends in a named
    state it chose (``Rejected``, ``Superseded``) is an outcome, and must not leave a traceback
    in the run's logs. Exit 1 only for a plain ``Failed`` or ``Crashed`` run."""
    from uuid import UUID

    sys.path.insert(0, str(REPO))
    from prefect._internal.control_listener import configure_from_env
    from prefect._internal.metrics import RunMetrics
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow, load_flow_run, run_flow

    flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])
    configure_from_env()
    with handle_engine_signals(flow_run_id):
        flow_run = load_flow_run(flow_run_id=flow_run_id)
        logger = flow_run_logger(flow_run=flow_run)
        flow = load_flow(flow_run)
        with RunMetrics(flow_run, flow):
            state = run_flow(flow, flow_run=flow_run, error_logger=logger, return_type="state")
    return 1 if state.name in ("Failed", "Crashed") else 0


def main(argv: list[str]) -> int:
    if argv[1:2] == ["--serve"] and len(argv) == 3:
        return serve(Path(argv[2]))
    if argv[1:] == ["--run"]:  # the cold start: this process runs the flow itself
        return run_engine()
    return client()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
