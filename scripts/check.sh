#!/usr/bin/env bash
# The gate that runs before the tests (.ci/run, `make check`, pre-commit): lint, format and types, as
# configured in pyproject.toml. Fails on any finding. Set-up first if needed (seconds when done).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
