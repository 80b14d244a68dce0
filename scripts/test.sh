#!/usr/bin/env bash
# The README's test command: set up (if needed), lint, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# three workers on two cores: the stack tests mostly wait on their servers; tests/conftest.py
# keeps each module, and the modules sharing one session server, on one worker, and orders the
# groups (stack tests first); the slowest tests are listed at the end
.venv/bin/python -m pytest -n "${DPMERGE_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder \
  --durations=25 "$@"
