#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite on real vLLM engines on CPU. Three pytest
# processes (in-process engines; TP/PP engines; HTTP servers) so each group's engines are freed before
# the next starts — together they would not fit in memory. Arguments, if any, go to one pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
"${PYTEST[@]}" -m "not parallel and not http"
"${PYTEST[@]}" -m parallel
"${PYTEST[@]}" -m http
