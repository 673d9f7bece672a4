#!/usr/bin/env bash
# The main job: set-up (idempotent), then the real run on the shipped SmolLM2-135M-Instruct on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
exec .venv/bin/python examples/capture_and_steer.py "$@"
