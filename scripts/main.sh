#!/usr/bin/env bash
# The main job: set-up (idempotent), then the deception-probe eval on the shipped SmolLM2-135M-Instruct,
# on CPU, through `inspect eval --model vllm-lens/<model>` (extra args go to `inspect eval`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/env.sh
MODEL=$(.venv/bin/python -c "from vllm_worker.shipped_model import shipped_model_path; print(shipped_model_path())")
LOG_DIR=${LOG_DIR:-logs/deception_probe}
.venv/bin/inspect eval evals/deception_probe.py --model "vllm-lens/$MODEL" \
  -M dtype=float32 -M max_model_len=2048 --log-dir "$LOG_DIR" --display plain "$@"
echo
.venv/bin/python evals/summary.py "$LOG_DIR"
