#!/usr/bin/env bash
# The Inspect matrix (issue #44): the provider, solver and eval tests that need no GPU against a spread of
# inspect-ai releases, and the ControlArena / Petri integrations at a couple of their versions. Each row's
# packages are overlaid ahead of the venv on PYTHONPATH (the venv is not modified); rows run one after another.
# Not part of .ci/run (it downloads releases and takes a long while); its table goes in docs/compatibility.md.
#   scripts/inspect-matrix.sh                                      # the default rows
#   scripts/inspect-matrix.sh inspect-ai==0.3.270 'inspect-ai==0.3.280,control-arena==20.0.0'
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec .venv/bin/python scripts/inspect_matrix.py "$@"
