#!/usr/bin/env bash
# Benchmark-only dependencies, kept out of the project's venv where they could interfere:
# the original vllm-lens (needs Python >= 3.12 on paper; its pure-Python code runs here), nnsight and
# TransformerLens go to bench/.deps/<name> and are put on PYTHONPATH only for their own process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
D=bench/.deps
STAMP=$D/.stamp-v1
[ -f "$STAMP" ] && exit 0
PIP=".venv/bin/pip install -q --disable-pip-version-check"
$PIP "matplotlib==3.11.2"
mkdir -p $D/wheels
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 "vllm-lens==1.3.0" -d $D/wheels
$PIP --no-deps --ignore-requires-python --target $D/vllm_lens $D/wheels/vllm_lens-1.3.0-py3-none-any.whl \
  "jaxtyping==0.3.11" wadler_lindig
$PIP --no-deps --target $D/nnsight "nnsight==0.8.1" greenlet websocket-client
$PIP --no-deps --target $D/transformer_lens "transformer-lens==4.3.0" beartype einops fancy-einsum \
  "jaxtyping==0.3.11" wadler_lindig typeguard transformers-stream-generator
$PIP --target $D/tl_extra datasets wandb 2>/dev/null || true
# keep only what the project venv lacks (no second numpy / pydantic / huggingface_hub shadowing it)
SP=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
for d in $D/tl_extra/*; do [ -e "$SP/$(basename "$d")" ] && rm -rf "$d"; done
for d in $D/tl_extra/numpy*; do rm -rf "$d"; done
touch "$STAMP"
