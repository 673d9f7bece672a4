#!/usr/bin/env bash
# The first GPU recipe: vLLM 0.26.0 on the image's own torch 2.11 (no torch travels). Called by
# `bench/gpu/stage.sh 0.26.0 [OUTDIR]`; writes OUTDIR (default .gpu) as ../shared/gpu/README.md describes:
# p1/, p2/ (vLLM stripped, xz, two parts), whl/ (runtime deps), srvwhl/ (`vllm serve` deps), moe/ (optional MoE
# kernels), model/ (an 8B-shaped config for load_format="dummy"), dev/{setup.sh,env.sh} (the device side:
# bench/gpu/setup-026.sh and env-026.sh). Optional env TOKENIZER_DIR: tokenizer files copied into model/.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
G=$(mkdir -p "${1:-.gpu}" && cd "${1:-.gpu}" && pwd)
mkdir -p "$G/dev" && cd "$G"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
WHL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
# shellcheck disable=SC2086
[ -f "$WHL" ] || python3 -m pip download -q --no-deps $PLAT -d . vllm==0.26.0
# vLLM without what Hopper never loads (FA2, Rust router, MoE, FP4/MLA kernels, deep_gemm of other Pythons)
if [ ! -f vllm026s.sha256 ]; then
  T=$(mktemp -d)
  (cd "$T" && unzip -q "$G/$WHL" && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs \
    vllm/_moe_C_stable_libtorch.abi3.so vllm/_qutlass_C.abi3.so vllm/_flashmla_C.abi3.so \
    vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so &&
    tar -cf - vllm vllm-0.26.0.dist-info | xz -9e -T2 > "$G/vllm026s.tar.xz")
  rm -rf "$T" p1 p2 && sha256sum vllm026s.tar.xz > vllm026s.sha256 && mkdir p1 p2
  split -b 58M -d -a 2 vllm026s.tar.xz vpart. && mv vpart.00 p1/ && mv vpart.01 p2/
fi
# MoE kernels as an optional part (every MoE model fails at start without them)
[ -f moe/_moe_C_stable_libtorch.abi3.so ] || { mkdir -p moe && unzip -q -o -j "$WHL" \
  vllm/_moe_C_stable_libtorch.abi3.so -d moe; }
# runtime deps the image lacks; xgrammar 0.2.7 (0.2.8 needs a newer apache-tvm-ffi than 0.26 pins)
# shellcheck disable=SC2086
[ -d whl ] || { mkdir whl && python3 -m pip download -q --no-deps $PLAT -d whl \
  cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 starlette==1.10.0 openai==2.54.0 jiter==0.19.0 distro==1.9.0 \
  sniffio==1.3.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 msgspec==0.22.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 \
  pybase64==1.5.1 pyzmq==27.3.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1 zstandard==0.25.0 setproctitle==1.3.8 \
  blake3==1.0.11 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10; }
# `vllm serve` on top; anthropic < 1 and mcp < 2 (their newer majors need httpx2)
# shellcheck disable=SC2086
[ -d srvwhl ] || { mkdir srvwhl && python3 -m pip download -q --no-deps $PLAT -d srvwhl \
  anthropic==0.125.0 dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0 httptools==0.9.0 \
  httpx-sse==0.4.3 ijson==3.6.0 interegular==0.3.3 jmespath==1.1.0 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 lark==1.3.1 lm-format-enforcer==0.11.3 mcp==1.30.0 mistral-common==1.13.1 \
  model-hosting-container-standards==0.1.16 mypy-extensions==1.2.0 outlines-core==0.2.14 \
  prometheus-fastapi-instrumentator==8.1.0 pycountry==26.2.16 pydantic-extra-types==2.11.1 \
  pydantic-settings==2.16.3 pyjwt==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 \
  python-multipart==0.0.34 referencing==0.37.0 rpds-py==2026.9.1 sse-starlette==3.7.0 supervisor==4.3.0 \
  typing-inspect==0.9.0 uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4; }
bash "$HERE/model-folder.sh" model
cp "$HERE/setup-026.sh" dev/setup.sh && cp "$HERE/env-026.sh" dev/env.sh
du -sh p1 p2 whl srvwhl moe model
