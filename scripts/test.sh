#!/usr/bin/env bash
# The test command: set-up (idempotent), then the whole suite on a real vLLM engine on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python -m pytest -q "$@"
