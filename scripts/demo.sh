#!/usr/bin/env bash
# The README's main job: set up (if needed), then run `dpmerge demo` on embedded defaults
# (Prefect's temporary API, MLflow on .dpmerge/mlflow.db with local artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/dpmerge demo "$@"
