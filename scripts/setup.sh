#!/usr/bin/env bash
# Set up a fresh machine for dpmerge (idempotent; a second run takes seconds):
#   * Debian package dataset-fashion-mnist (real data, installed under /usr/share/datasets),
#   * Debian package postgresql (the local stack's database; `dpmerge stack up` runs its own
#     cluster in the state directory, never the system's),
#   * Debian package acl (setfacl: as root, `stack up` lets the worker user through the
#     directories above the checkout; docs/stack.md#worker-user),
#   * a virtual environment at .venv with torch's CPU wheel and dpmerge (+ test extras).
set -euo pipefail
cd "$(dirname "$0")/.."

export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_install() {  # $1: the package; tries without `apt-get update` first
  echo "setup: installing Debian package $1"
  $SUDO apt-get install -y -q "$1" >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "$1" >/dev/null; }
}
[ -d /usr/share/datasets/fashion-mnist ] || apt_install dataset-fashion-mnist
ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || apt_install postgresql
command -v setfacl >/dev/null || apt_install acl

compile_tree() {  # byte-compile in parallel (four processes at least: on a busy machine each
  # runnable process gets its share of the cores), skipping the packages' own test suites,
  # which nothing imports; like pip, pass over files that do not compile under this Python
  # (a few are 3.12-only)
  .venv/bin/python -c 'import compileall, os, re, sys
for tree in sys.argv[1:]:
    tests = re.compile(re.escape(os.path.abspath(tree)) + r".*/tests?/")
    compileall.compile_dir(
        os.path.abspath(tree), quiet=2, rx=tests, workers=max(4, os.cpu_count() or 1)
    )' "$@"
}

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat .venv/.dpmerge-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "setup: installing Python packages into .venv (torch CPU wheel first)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: an unpinned torch pulls a multi-GB CUDA build. pip byte-compiles one
  # file at a time (45 of its 72 CPU-seconds here); compile_tree below uses every core.
  .venv/bin/python -m pip install -q --no-compile torch==2.13.0
  .venv/bin/python -m pip install -q --no-compile -e '.[test]'
  compile_tree "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$stamp" > .venv/.dpmerge-stamp
fi
# this checkout's packages too (the editable install is not compiled; up-to-date files are
# skipped), so no process compiles them again where Python writes no bytecode
compile_tree dpmerge flows tasks devstack
