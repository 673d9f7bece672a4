#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite on real vLLM engines on CPU (.ci/run runs
# the gate, scripts/check.sh, first). Each folder of tests/ is a group; groups run in pytest processes of
# their own so each group's engines are freed before the next starts (together they would not fit in memory):
#   unit + core + engine (in-process engines, eager) | core again on engines in vLLM's default compiled
#   mode | parallel (TP/PP engines) | http + inspect (real servers, real `inspect eval`).
# Arguments, if any, go to one pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# the example pages are tested in a real headless browser: Debian's chromium (Playwright drives it)
if ! command -v chromium >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
source scripts/env.sh
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi
"${PYTEST[@]}" tests/unit tests/core tests/engine
LENS_TEST_COMPILED=1 "${PYTEST[@]}" tests/core
"${PYTEST[@]}" tests/parallel
"${PYTEST[@]}" tests/http tests/inspect
