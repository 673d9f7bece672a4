#!/usr/bin/env bash
# ON THE LENT H200, from this repo's tree: the GPU checks on the vLLM of an install prefix (bench/gpu/join.sh),
# engines side by side in two waves so that the five checks fit one 10-minute call.
#   bash bench/gpu/checks.sh PREFIX MODEL     # e.g. /root/v33 /work/main/.gpu/model; logs to $OUT
# Wave 1: gpu_check, gpu_v2_check (its V2 and V1 children run one after the other); wave 2:
# gpu_direct_check, gpu_serve_check; wave 3: gpu_seams_check alone (on 0.33, started beside two engines, it
# found no memory left for its KV cache: its in-process engine profiles the GPU while the others grow). Each engine takes 0.3 of the GPU and its own compile cache
# (concurrent compiles of one graph into one cache can collide). Prints the checks' JSON lines at the end.
set -uo pipefail
PREFIX=${1:?PREFIX} MODEL=${2:?MODEL} O=${OUT:-/tmp/gpu-checks}
mkdir -p "$O"
# shellcheck disable=SC1091
source "$PREFIX/env.sh"
rm -rf /root/lens && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens . >/dev/null
export PYTHONPATH=/root/lens:$PYTHONPATH
python3 - > "$O/env.txt" 2>&1 <<'PY' || { cat "$O/env.txt"; exit 1; }
import platform, torch, triton, vllm, vllm_worker
print("python", platform.python_version(), "glibc", platform.libc_ver())
print("torch", torch.__version__, torch.version.cuda, "nccl", torch.cuda.nccl.version())  # cudnn.version() refuses 9.19 < 9.24
print("triton", triton.__version__, "vllm", vllm.__version__, "lens", vllm_worker.__file__)
print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16); print("matmul ok", float((x @ x).float().norm()) > 0)
PY
cat "$O/env.txt"
run() {  # NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  VLLM_CACHE_ROOT=/root/vcache/$name timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "$name rc=$?" >> "$O/rc.txt"
}
T0=$(date +%s)
run check 330 python3 bench/probes/gpu_check.py "$MODEL" &
run v2 330 python3 bench/probes/gpu_v2_check.py "$MODEL" --mode check &
wait
echo "wave 1: $(( $(date +%s) - T0 )) s"
run direct 200 env VLLM_LENS_DIRECT_POOL=1 python3 bench/probes/gpu_direct_check.py "$MODEL" &
run serve 200 python3 bench/probes/gpu_serve_check.py "$MODEL" &
wait
echo "waves 1-2: $(( $(date +%s) - T0 )) s"
run seams 170 python3 bench/probes/gpu_seams_check.py "$MODEL"
echo "all waves: $(( $(date +%s) - T0 )) s"
cat "$O/rc.txt"
grep -h -E '^(CHECK|SEAMS|V2CHECK|SERVE) ' "$O"/*.log | cut -c1-1500
for f in "$O"/*.log; do grep -q -E '^(CHECK|SEAMS|V2CHECK|SERVE) ' "$f" || { echo "== $f"; tail -25 "$f"; }; done
