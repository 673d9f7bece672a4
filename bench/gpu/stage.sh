#!/usr/bin/env bash
# Prepare, on a CPU machine, everything a vLLM run on the lent H200 needs, as parts the device tool can carry
# (each <= 58 MiB; a call carries <= 64 MiB with the checkout).
#
#   bench/gpu/stage.sh 0.33.0 [OUTDIR]   # default OUTDIR: .gpu/v33 (for 0.33.x)
#   bench/gpu/stage.sh 0.26.0 [OUTDIR]   # the image's own torch (2.11): the first recipe, bench/gpu/stage-026.sh
#
# For 0.33 the image's torch (2.11) cannot serve: vLLM 0.33's kernels are built against torch 2.14. So one
# install prefix is built here (torch 2.14, triton 3.8, torchvision 0.29, NCCL, vLLM, the pure-Python and
# small binary dependencies the image lacks), slimmed to what a Hopper LLM run loads (fatbin_slim.py zeroes the
# other GPU architectures' kernels; tests, headers and AMD backends go), packed as one tar.xz and split.
# The device joins the parts with bench/gpu/join.sh (one part per call, in /root/stage, which survives only
# while the machine stays warm) and sources OUTDIR/env.sh. CUDA libraries the image already holds in a
# compatible version are linked, not carried (see join.sh). Needs pip, unzip, xz and python3.
set -euo pipefail
VER=${1:?usage: stage.sh VERSION [OUTDIR]}
HERE="$(cd "$(dirname "$0")" && pwd)"
case "$VER" in
  0.26.*) exec bash "$HERE/stage-026.sh" "${2:-.gpu}" ;;
  0.33.*) ;;
  *) echo "stage.sh: no recipe for vLLM $VER (0.26.x, 0.33.x)" >&2; exit 2 ;;
esac
MAJMIN=$(echo "$VER" | awk -F. '{print $1 $2}')
OUTDIR=$(mkdir -p "${2:-.gpu/v$MAJMIN}" && cd "${2:-.gpu/v$MAJMIN}" && pwd)
DL=${STAGE_CACHE:-$OUTDIR/../dl}; mkdir -p "$DL"; DL=$(cd "$DL" && pwd)
TREE=${STAGE_TREE:-/tmp/stage-v$MAJMIN}
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"

# 1. Wheels. torch 2.14 pins NCCL 2.30.7 (not in the registry here; 2.32.6 is, same ABI major) and calls NCCL
#    functions the image's 2.28 lacks (ncclAlltoAll, ncclCommGrow, ...: an undefined symbol at `import torch`),
#    so NCCL travels. cuDNN (image 9.19 vs 9.24), cuSPARSELt (0.8.0 vs 0.8.1), NVSHMEM (3.4.5, same) and the
#    CUDA 13.0 toolkit libraries (13.0.2 vs 13.0.3) are the image's: no symbol torch needs is missing from them
#    (checked with nm when this recipe was made; cuDNN loads its engines lazily, and only convolutions use it).
#    The rest: what vLLM 0.33 pins or needs at start that the image lacks, plus `vllm serve`'s own needs.
GPU_WHEELS="torch==2.14.0 triton==3.8.0 torchvision==0.29.0 nvidia-nccl-cu13==2.32.6 vllm==$VER"
DEPS="cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 starlette==1.10.0 openai==2.54.0 jiter==0.19.0
  distro==1.9.0 sniffio==1.3.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing_extensions==4.16.0 msgspec==0.22.0 partial-json-parser==0.2.1.1.post7
  pybase64==1.5.1 pyzmq==27.3.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1 zstandard==0.25.0 setproctitle==1.3.8
  blake3==1.0.11 llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 oss-harmony==0.0.11 orjson==3.13.0
  compressed-tensors==0.17.0 loguru==0.7.3"
# (compressed-tensors: 0.33 imports it while loading any model, through its online-quantization check)
SERVE_DEPS="anthropic==0.125.0 dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0 httptools==0.9.0
  httpx-sse==0.4.3 ijson==3.6.0 interegular==0.3.3 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 lark==1.2.2 lm-format-enforcer==0.11.3 mistral-common==1.13.1
  model-hosting-container-standards==0.1.16 outlines-core==0.2.14 prometheus-fastapi-instrumentator==8.1.0
  pycountry==26.2.16 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pyjwt==2.15.1 python-dotenv==1.2.4
  python-json-logger==4.2.0 python-multipart==0.0.34 referencing==0.37.0 rpds-py==2026.9.1 sse-starlette==3.7.0
  supervisor==4.3.0 uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4"
mkdir -p "$DL/gpu" "$DL/deps"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$DL/gpu" $GPU_WHEELS
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$DL/deps" $DEPS $SERVE_DEPS

# 2. One prefix, as pip would lay it out for Python 3.12 (installed here without running anything of it).
#    STAGE_REUSE_TREE=1 packs an already slimmed tree again (step 4 only).
if [ "${STAGE_REUSE_TREE:-0}" = 1 ] && [ -d "$TREE/vllm" ]; then cd "$TREE"; else
rm -rf "$TREE" && mkdir -p "$TREE"
for w in "$DL"/gpu/*.whl "$DL"/deps/*.whl; do
  case "$(basename "$w")" in
    torch-2.14.0-*|triton-3.8.0-*|torchvision-0.29.0-*|nvidia_nccl_cu13-2.32.6-*|vllm-"$VER"-*) ;;
    torch-*|triton-*|torchvision-*|nvidia_nccl*|vllm-*) continue ;;  # other versions kept in the cache
  esac
  (cd "$TREE" && unzip -q -o "$w")
done

# 3. Slim: what a Hopper LLM run (dense models, FlashAttention 3, no MoE) never loads.
cd "$TREE"
# torch/bin keeps torch_shm_manager (`import torch` refuses to start without it); only protoc goes
rm -rf torch/include torch/share torch/bin/protoc* torch/lib/*.a \
  triton/backends/amd triton/instrumentation triton/_C/libproton.so \
  triton/backends/nvidia/lib/cupti triton/backends/nvidia/lib/cupti-blackwell \
  triton/backends/nvidia/bin/ptxas-blackwell triton/backends/nvidia/bin/nvdisasm triton/backends/nvidia/bin/cuobjdump \
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/_qutlass_C.abi3.so \
  vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/_flashkda_C.abi3.so vllm/_deepselect_C.abi3.so \
  vllm/third_party/fmha_sm100 nvidia/nccl/include
find . -name '__pycache__' -prune -exec rm -rf {} +
python3 "$HERE/fatbin_slim.py" 90 $(find . -name '*.so*' -type f -size +1M)
# the prefix is loaded with `nvidia/` of the image linked beside our NCCL (join.sh): no __init__ may hide it
rm -f nvidia/__init__.py
# triton finds its backends through its entry points: drop the AMD one with its folder
sed -i '/^amd = /d' triton-*.dist-info/entry_points.txt
fi

# 4. Pack and split. zstd -12 (not xz -9: 2.3 GB under xz -9 took > 1 h on the shared 2-core machine; zstd
#    packs it in minutes, ~10 % larger). The device may lack the zstd CLI: the first call also carries
#    tools/ (python's zstandard wheel; join.sh installs it to /root/zst). The checksum is checked there.
rm -rf "$OUTDIR"/p[0-9]* "$OUTDIR"/part.* "$OUTDIR"/prefix.sha256 "$OUTDIR"/tools
tar -cf - --sort=name . | zstd -q -12 -T2 --long=27 | (cd "$OUTDIR" && split -b 58M -d -a 2 - part.)
(cd "$OUTDIR" && cat part.* | sha256sum | cut -d' ' -f1 > prefix.sha256 && cat part.* | zstd -q -t --long=27)
for p in "$OUTDIR"/part.*; do n=$(basename "$p"); mkdir -p "$OUTDIR/p${n#part.}" && mv "$p" "$OUTDIR/p${n#part.}/"; done
mkdir -p "$OUTDIR/tools" && cp "$DL"/deps/zstandard-*.whl "$OUTDIR/tools/"
cp "$HERE/join.sh" "$OUTDIR/"
echo "vLLM $VER staged in $OUTDIR: $(ls -d "$OUTDIR"/p[0-9]* | wc -l) parts"; du -sh "$OUTDIR"/p[0-9]* "$OUTDIR/tools"
