#!/usr/bin/env bash
# The README's test command: set up (if needed), lint, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
# one thread per process: five workers and the stacks' runs share two cores, and a second
# BLAS/OpenMP thread only spins (the accounting tests used 6% more CPU for no time); freed
# arrays stay with the process instead of going back to the kernel and faulting in again
# (the same tests' system time fell from 29 s to 10 s). The suite's processes inherit both.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648
# the suite starts hundreds of Python processes and five workers rewrite the same test modules:
# let the first one cache the bytecode (an environment may have turned that off)
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# five workers on two cores: the stack tests mostly wait on their servers; tests/conftest.py
# keeps each module, and the modules sharing one session server, on one worker, and orders the
# groups (stack tests first); the slowest tests are listed at the end
.venv/bin/python -m pytest -n "${DPMERGE_TEST_WORKERS:-5}" --dist loadgroup --no-loadscope-reorder \
  --durations=25 "$@"
