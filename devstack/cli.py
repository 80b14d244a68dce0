"""``dpmerge stack up|down|status|env``: the local S3 + MLflow + Prefect stack on loopback.

Routed by the console script (``flows/cli.py``); the library's command table does not know it.
"""

from __future__ import annotations

import argparse
import json
import time

import devstack as stack
from devstack import store
from devstack.config import ADMIN_GRPC_OFFSET, DEFAULT_STORE_PORTS, STORE_PORT_NAMES
from dpmerge.storage import S3Store, StorageError
from dpmerge.vocabulary import StackDatabase, StackRole, values


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stack",
        help="start/stop the local stack (S3, PostgreSQL, MLflow, Prefect, workers) on 127.0.0.1",
        description=(
            "Run the local stack on loopback under supervisord. State (S3 objects, databases, "
            "credentials, logs, supervisord's configuration and socket) lives in --state-dir "
            "(default $DPMERGE_STACK_DIR or .stack/ in the repository); the ports and database "
            "given to 'up' are saved there (stack.json) and reused by down, status and env."
        ),
    )
    actions = parser.add_subparsers(dest="stack_command", required=True)
    for name, text in (
        ("up", "start every service not already running (idempotent)"),
        ("down", "stop workers, then servers, then supervisord"),
        ("status", "show what runs and whether the registry and the S3 store are in step"),
        ("env", 'print one role\'s export lines: eval "$(dpmerge stack env --role operator)"'),
    ):
        sub = actions.add_parser(name, help=text, description=text)
        sub.add_argument("--state-dir", default=None, help="state directory (pids, logs, data)")
        if name == "up":
            for service, port in stack.DEFAULT_PORTS.items():
                sub.add_argument(
                    f"--{service}-port", type=int, default=None, help=f"default {port}"
                )
            sub.add_argument(
                "--store-port-base",
                type=int,
                default=None,
                help=f"first of the {len(STORE_PORT_NAMES)} consecutive ports SeaweedFS uses "
                f"inside, and the last + {ADMIN_GRPC_OFFSET} (default {DEFAULT_STORE_PORTS[0]})",
            )
            sub.add_argument(
                "--database",
                choices=values(StackDatabase),
                default=None,
                help="what backs the Prefect server and MLflow's store (default postgres; "
                "saved in stack.json)",
            )
            sub.add_argument(
                "--no-prefect",
                dest="prefect",
                action="store_false",
                default=None,
                help="start only S3 and MLflow",
            )
        if name in ("up", "status"):
            sub.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "env":
            sub.add_argument(
                "--role",
                choices=values(StackRole),
                default=StackRole.WORKFLOW.value,
                help="whose credentials (default workflow; each role gets its own only)",
            )
        sub.set_defaults(handler=_handle)


def _handle(args: argparse.Namespace) -> int:
    if args.stack_command == "up":
        config = stack.resolve_config(
            args.state_dir,
            s3_port=args.s3_port,
            mlflow_port=args.mlflow_port,
            prefect_port=args.prefect_port,
            postgres_port=args.postgres_port,
            database=args.database,
            prefect=args.prefect,
            store_ports=None
            if args.store_port_base is None
            else tuple(range(args.store_port_base, args.store_port_base + len(STORE_PORT_NAMES))),
        )
        start = time.monotonic()
        statuses = stack.up(config)
        return _print_status(statuses, args.json, f"stack up in {time.monotonic() - start:.1f} s")
    config = stack.resolve_config(args.state_dir)
    if args.stack_command == "down":
        stopped = stack.down(config)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    if args.stack_command == "env":
        print("\n".join(stack.export_lines(config, StackRole(args.role))))
        return 0
    statuses = stack.status(config)
    if any(s.name == "s3" and s.healthy for s in statuses):
        in_step = _store_line(config, args.json)
    else:
        in_step = False
        if not args.json:
            print("registry/store: unknown (S3 is not running)")
    header = f"state directory {config.state_dir}; database {config.database.value}"
    _print_status(statuses, args.json, header)
    return 0 if in_step and all(s.healthy for s in statuses) else 1


def _store_line(config: stack.StackConfig, as_json: bool) -> bool:
    """Print whether the registry and the S3 store are in step (not with ``--json``, whose
    output stays the list of services); False when they are not, or S3 cannot be read."""
    try:
        found = store.check(config, S3Store(config.s3_config()))
    except (StorageError, stack.StackError) as error:
        line, in_step = f"registry/store: unknown ({error})", False
    else:
        in_step = found.verdict is not store.Verdict.OUT_OF_STEP
        line = f"registry/store: {found.verdict.value} (store generation {found.store_generation})"
        if not in_step:
            line = "registry/store: " + store.out_of_step_message(config, found)
    if not as_json:
        print(line)
    return in_step


def _print_status(statuses: list[stack.ServiceStatus], as_json: bool, header: str) -> int:
    if as_json:
        print(json.dumps([s.to_dict() for s in statuses], indent=2))
        return 0
    print(header)
    rows = [
        (
            s.name,
            "healthy" if s.healthy else ("running, unhealthy" if s.running else s.state.lower()),
            f"pid {s.pid}" if s.pid else "",
            s.url or "",
            f"log {s.log}",
        )
        for s in statuses
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, [*widths, 0], strict=True)))
    for s in statuses:
        if s.reason:
            print(f"  {s.name}: unhealthy: {s.reason}")
        if s.finding:
            print(f"  {s.finding}")
        if s.orphans:
            pids = ", ".join(map(str, s.orphans))
            print(f"  {s.name}: orphaned processes of an earlier instance: {pids}")
    return 0
