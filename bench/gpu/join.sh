#!/usr/bin/env bash
# ON THE DEVICE, from the directory that holds the carried parts (stage.sh's OUTDIR, e.g. .gpu/v33):
#   bash join.sh add                  # a staging call: keep this call's parts in /root/stage (survives while warm);
#                                     # the call that carries tools/ also installs python's zstandard to /root/zst
#   bash join.sh install [PREFIX]     # the last call: check the joined parts, extract to PREFIX (/root/v33),
#                                     # link the image's CUDA libraries beside our NCCL, write PREFIX/env.sh
# `source PREFIX/env.sh` then puts torch 2.14 / vLLM of the prefix ahead of the image's torch 2.11.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
STAGE=${JOIN_STAGE:-/root/stage}
mkdir -p "$STAGE"
for p in "$HERE"/p*/part.*; do [ -f "$p" ] && cp -f "$p" "$STAGE/"; done
if [ -d "$HERE/tools" ] && [ ! -d /root/zst/zstandard ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/zst "$HERE"/tools/zstandard-*.whl
fi
echo "parts in $STAGE: $(ls "$STAGE" | tr '\n' ' ')"
[ "${1:-add}" = install ] || exit 0
PREFIX=${2:-/root/v33}
T0=$(date +%s)
want=$(cat "$HERE/prefix.sha256")
got=$(cat "$STAGE"/part.* | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "join.sh: parts incomplete or damaged (sha256 $got, want $want)"; exit 1; }
rm -rf "$PREFIX" && mkdir -p "$PREFIX"
if command -v zstd >/dev/null; then
  cat "$STAGE"/part.* | zstd -q -dc --long=27 | tar -x -C "$PREFIX"
else
  cat "$STAGE"/part.* | PYTHONPATH=/root/zst python3 -c "
import sys, tarfile, zstandard
with zstandard.ZstdDecompressor(max_window_size=2**27).stream_reader(sys.stdin.buffer) as r:
    tarfile.open(fileobj=r, mode='r|').extractall(sys.argv[1])
" "$PREFIX"
fi
# The image's CUDA 13 libraries (cu13 toolkit, cuDNN, cuSPARSELt, NVSHMEM ...) under the prefix's nvidia/,
# where torch's RPATH ($ORIGIN/../../nvidia/<lib>/lib) and its preloader look; our NCCL stays ours.
IMG=${JOIN_IMAGE_SITE:-}; [ -n "$IMG" ] || IMG=$(env -u PYTHONPATH python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$PREFIX/nvidia"
for d in "$IMG"/nvidia/*/; do
  n=$(basename "$d"); [ -e "$PREFIX/nvidia/$n" ] || ln -s "${d%/}" "$PREFIX/nvidia/$n"
done
cat > "$PREFIX/env.sh" <<EOF
# source me on the device before running vLLM from $PREFIX
export PYTHONPATH=$PREFIX\${PYTHONPATH:+:\$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not carried
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
EOF
echo "installed in $PREFIX in $(( $(date +%s) - T0 )) s ($(du -sh "$PREFIX" | cut -f1))"
rm -rf "$STAGE"
