#!/usr/bin/env bash
# Peers for the device's `gpu-peers` plan, fetched HERE (the device has no network) and carried to it:
#   bench/.deps/nnsight312  nnsight 0.8.1 for the device's Python 3.12 (system `nnsight-vllm`): its own wheel is
#                           cp312 (a C extension), so it cannot share bench/.deps/nnsight (this machine's 3.11)
#   bench/.deps/vllm_lens   the original vllm-lens 1.3.0 (system `vllm-lens`; pure Python), if missing
# Only what a device image with torch, transformers and vLLM lacks: nnsight's vLLM path imports torch, vllm,
# transformers, pydantic, yaml and cloudpickle (all vLLM's own dependencies) and greenlet (compiled, added);
# websocket-client / httpx / zstandard are imported only for NDIF remote calls (websocket-client added, tiny).
#   bash bench/peers_deps.sh        then carry bench/.deps/nnsight312 and bench/.deps/vllm_lens
# NNSIGHT_WHEELS=<folder> takes wheels from there first (default /tmp/nn, if it exists).
set -euo pipefail
cd "$(dirname "$0")/.."
D=bench/.deps
PIP=(.venv/bin/pip --disable-pip-version-check -q)
WHEELS=${NNSIGHT_WHEELS:-/tmp/nn}
FIND=()
[ -d "$WHEELS" ] && FIND=(--find-links "$WHEELS")
TARGET312=(--no-deps --target "$D/nnsight312" --python-version 3.12 --implementation cp --abi cp312
  --only-binary=:all: --platform manylinux_2_28_x86_64)

if [ ! -f "$D/nnsight312/.stamp-v1" ]; then
  rm -rf "$D/nnsight312"
  "${PIP[@]}" install "${TARGET312[@]}" "${FIND[@]}" "nnsight==0.8.1" "greenlet==3.5.6" "websocket-client==1.9.2"
  rm -rf "$D/nnsight312/bin" "$D/nnsight312/include"  # console scripts (name this machine's Python), C headers
  find "$D/nnsight312" -name __pycache__ -prune -exec rm -rf {} +
  ls "$D"/nnsight312/nnsight/_c/*cpython-312-x86_64-linux-gnu.so >/dev/null  # the 3.12 build, not this machine's
  touch "$D/nnsight312/.stamp-v1"
fi

if [ ! -d "$D/vllm_lens/vllm_lens" ]; then  # as bench/setup.sh makes it (the original needs Python >= 3.12 on paper)
  mkdir -p "$D/wheels"
  "${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 "vllm-lens==1.3.0" -d "$D/wheels"
  "${PIP[@]}" install --no-deps --ignore-requires-python --target "$D/vllm_lens" \
    "$D/wheels/vllm_lens-1.3.0-py3-none-any.whl" "jaxtyping==0.3.11" wadler_lindig
  find "$D/vllm_lens" -name __pycache__ -prune -exec rm -rf {} +
fi

du -sh "$D/nnsight312" "$D/vllm_lens"
du -sch "$D/nnsight312" "$D/vllm_lens" | tail -1 | sed 's/total$/total to carry (limit 64 MiB with everything else)/'
