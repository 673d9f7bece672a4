#!/usr/bin/env bash
# ON THE LENT H200 (see ../shared/gpu/README.md; vLLM 0.26.0 in /root/site via .gpu/dev/setup.sh, or another
# vLLM staged by bench/gpu/stage.sh: GPU_ENV=/root/v33/env.sh; GPU_MODEL: the model folder, default .gpu/model):
# plain vLLM eager + CUDA graphs, this project and the original vllm-lens 1.3.0, side by side on the
# 8B-shaped random-weight model. Writes the results table to $OUT (or bench/results).
set -euo pipefail
source "${GPU_ENV:-.gpu/dev/env.sh}"
# this project, installed (entry points) without network or build isolation
[ -d /root/lens ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens . >/dev/null
# A/B (plan gpu-ab): BENCH_LENS_BEFORE_SRC=<tree of an older commit> installs it to /root/lens-before
if [ -n "${BENCH_LENS_BEFORE_SRC:-}" ] && [ ! -d /root/lens-before ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens-before "$BENCH_LENS_BEFORE_SRC" >/dev/null
fi
export PYTHONPATH=/root/lens:$PYTHONPATH
export VLLM_LENS_MAX_STORED_GB=${VLLM_LENS_MAX_STORED_GB:-48} BENCH_LOAD_FORMAT=dummy BENCH_MP=${BENCH_MP:-1} BENCH_W2_CHUNK=64 BENCH_VLLM_LENS_PATH=$PWD/bench/.deps/vllm_lens
# W6-W8 (inner hook points) need the inner taps, off by default since 97a4f22: plan gpu-points2 runs them on the
# system lens-points (BENCH_LENS_POINTS, default attn_out,mlp_out,z) beside the default engine; or VLLM_LENS_POINTS=all
export VLLM_LENS_POINTS=${VLLM_LENS_POINTS:-}
python3 bench/run.py --device cuda --dtype bfloat16 --models "gpu=${GPU_MODEL:-$PWD/.gpu/model}" --n 256 --prompt-len 30 --new 128 \
  --repeats ${REPEATS:-3} --machine h200 --no-bulk --out "${OUT:-bench/results}" "$@"
