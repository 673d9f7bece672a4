#!/usr/bin/env bash
# The benchmark on this machine (CPU): set-up if needed, then bench/run.py (args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bench/setup.sh
source scripts/env.sh
.venv/bin/python bench/make_model.py >/dev/null
exec .venv/bin/python bench/run.py "$@"
