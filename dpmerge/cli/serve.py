"""``dpmerge serve MODEL_URI``: verify a release and serve exactly the verified files
(docs/design.md#security, "what is served is what was verified").

Runs ``dpmerge verify --download`` into a private temporary directory (mode 0700, removed when
the server stops) — the alias resolved once, its serving statement, signature, files and card
checked — and then ``mlflow models serve -m DIR --env-manager local`` on exactly that directory,
on 127.0.0.1. A refused release starts nothing: exit 2 with one line. After a policy change,
stop the server and serve again.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from dpmerge.cli.verify import release_parser, serve_command, verified
from dpmerge.errors import InputError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = release_parser(
        subparsers, "serve", "verify a release, then serve exactly the verified files", __doc__
    )
    parser.add_argument("--port", type=int, default=8090, help="port on 127.0.0.1 (8090)")
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port}: not a TCP port (1–65535)")
    with tempfile.TemporaryDirectory(prefix="dpmerge-serve-") as private:  # mode 0700
        target = Path(private) / "model"
        document = verified(args.model_uri, args.public_key, args.tracking_uri, target)
        command = serve_command(target, args.port)
        print(
            f"serving {document['model_uri']} = {document['name']} v{document['version']} "
            f"(verified, key {document['key']}) from {target}: {shlex.join(command)}",
            flush=True,
        )
        bin_dir = str(Path(sys.executable).parent)  # mlflow starts uvicorn from PATH
        env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        return subprocess.call(command, env=env)
