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

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat .venv/.dpmerge-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "setup: installing Python packages into .venv (torch CPU wheel first)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$stamp" > .venv/.dpmerge-stamp
fi
