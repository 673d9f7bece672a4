#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite on real vLLM engines on CPU. Four pytest
# processes (in-process engines; the capture/steering/hook tests again on engines in vLLM's default
# compiled mode; TP/PP engines; HTTP servers) so each group's engines are freed before the next starts —
# together they would not fit in memory. Arguments, if any, go to one pytest run.
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
"${PYTEST[@]}" -m "not parallel and not http"
# test_compiled.py first: its plugin-free run must compile into the cache before our engines start
LENS_TEST_COMPILED=1 "${PYTEST[@]}" -m "not parallel and not http" tests/test_compiled.py tests/test_adapter.py \
  tests/test_capture.py tests/test_steering.py tests/test_cache_and_chunking.py tests/test_hooks.py tests/test_graph_path.py
"${PYTEST[@]}" -m parallel
"${PYTEST[@]}" -m http
