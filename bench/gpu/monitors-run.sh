#!/usr/bin/env bash
# The monitors run on the lent H200 (#42 probes and probe actions, #43 ops and neuron points): the check
# (bench/probes/gpu_monitors_check.py), W15 (streaming with scores, bench/stream_scores.py) and plan
# gpu-monitors, from a code folder staged beside vLLM 0.26's parts in G (default /work/main/.gpu/mon:
# p1 p2 whl srvx dev model vllm026s.sha256; code = the commit measured, what the device needs of it).
#
# Here first:   bash bench/gpu/monitors-prepare.sh (once a machine), then bash bench/gpu/monitors-run.sh stage COMMIT   (G/code afresh; prints each call's carry size)
# Then the device calls, back to back (the machine goes back after 30 s idle, /root with it). Calls 1 and 2 stage
# vLLM's parts (and the server's packages) in /root/stage; every later call carries only the code and what installs it:
#   call 1, carry [G/p1]:         mkdir -p /root/stage && cp .gpu/mon/p1/vpart.* /root/stage/ && nvidia-smi -L
#   call 2, carry [G/p2 G/srvx]:  cp .gpu/mon/p2/vpart.* /root/stage/ && mkdir -p /root/stage/srvx && cp .gpu/mon/srvx/* /root/stage/srvx/
#   call 3, carry [G/whl G/dev G/model G/code G/vllm026s.sha256]:
#                                 cd .gpu/mon/code && bash bench/gpu/monitors-run.sh check   (or install, then bench in the same call)
#   call 4, carry [G/dev G/model G/code]:
#                                 cd .gpu/mon/code && bash bench/gpu/monitors-run.sh bench
#   (or, after `install`, carry [G/dev G/model G/code G/spy]: ... monitors-run.sh profile)
#
# p1 / p2: vLLM 0.26's stripped .tar.xz (../../shared/gpu/prepare.sh) split 40 + 28 MiB (monitors-prepare.sh), so that
# each call, the tree included (~10.5 MB, every call), keeps 13+ MB of room (`stage` prints each call's size).
# srvx/srv.tar.xz: the wheels `vllm-lens serve` needs beyond whl/ (../../shared/gpu/prepare.sh's srvwhl list),
# unpacked into one site folder and xz'd (10.6 MB instead of 21.3).
# check: joins and installs vLLM 0.26 (+ the server's packages) into /root/site, this code into /root/lens, runs
# the check (one engine, CUDA graphs; $OUT/check.log, $OUT/check.json), then W15 on one `vllm-lens serve`
# ($OUT/w15.json, $OUT/w15.log) when bench/stream_scores.py exists.
# bench: plan gpu-monitors (REPEATS, default 3; BENCH_W0_END, default 2: W0 again on every engine at the end),
# the lens-points engine tapping mlp_post; VLLM_LENS_STEER_MB only when set by the caller. Writes the results'
# .md/.json/.png, $OUT/bench.log and $OUT/logs.tgz (each engine's log). BENCH_WORKLOADS / BENCH_SYSTEMS narrow it.
# BENCH_CPUS (taskset's list, e.g. 0-7): the whole bench, every system alike, on those cores only.
# Before it (ROW_CHECK=0: not), bench/probes/row_invariance.py --device cuda --quick ($OUT/row_invariance.jsonl, < 90 s).
# BI_CHECK=1 (default off): then, vLLM's batch-invariant mode: row_invariance.py --vllm-batch-invariant
# ($OUT/row_invariance_bi.jsonl) and one engine with VLLM_BATCH_INVARIANT=1, a request's probe scores / tokens
# alone and among 256 others (bench/probes/gpu_batch_invariant.py: $OUT/batch_invariant.jsonl, ~3 min);
# BI_ONLY=1: stop there (with the bench after it a call passes the device's 600 s).
# cpu-smoke (here, on the CPU engine, the shipped tiny model): the same Python parts, small sizes.
set -uo pipefail
MODE=${1:?"check | bench | cpu-smoke"}
HERE="$(cd "$(dirname "$0")/../.." && pwd)"  # the code folder (repo root of the commit measured)
O=${OUT:-/tmp/monitors-run}
mkdir -p "$O"
cd "$HERE"

# Each engine's share of the GPU (bench/system_base.py's BENCH_GPU_UTIL, default 0.2: the engines run side by side):
# 0.2 of an H200 holds the 8B model and its KV cache; of an 80 GB H100 it leaves no room for the KV cache
# (the weights alone are 16 GB), so a card under 100 GiB gets 0.3 unless the caller sets BENCH_GPU_UTIL.
gpu_util() {
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ -n "$mib" ] && [ "$mib" -lt 100000 ]; then echo 0.3; else echo 0.2; fi
}

case "$MODE" in
stage)
  C=${2:?COMMIT}
  G=${G:-/work/main/.gpu/mon}
  rm -rf "$G/code" && mkdir -p "$G/code" || exit 1
  # what the device runs: the packages, the bench code (not its results), the tests' support helpers
  git archive "$C" -- pyproject.toml README.md vllm_worker inspect_lens tests/support \
    $(git ls-tree --name-only "$C" bench/ | grep -v '^bench/results$') | tar -x -C "$G/code" || exit 1
  git rev-parse "$C" > "$G/code/COMMIT"
  TREE=$(cd /work/main && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
  mb() { du -sbL "$@" | awk -v t="$TREE" '{s+=$1} END {printf "%.1f MB (64 MiB = 67.1 MB)", (s+t)/1e6}'; }
  echo "tree $((TREE / 1000)) kB; call 1: $(mb "$G/p1")"
  echo "call 2: $(mb "$G"/{p2,srvx})"
  echo "call 3: $(mb "$G"/{whl,dev,model,code,vllm026s.sha256})"
  echo "call 4: $(mb "$G"/{dev,model,code})"
  [ -d "$G/spy" ] && echo "profile call: $(mb "$G"/{dev,model,code,spy})"
  ;;
check | install)
  ln -sfn .. .gpu  # code/.gpu -> G: the staged parts under the names setup.sh and gpu.sh use
  bash .gpu/dev/setup.sh || exit 1
  SRV=.gpu/srvx  # the server's packages: carried in this call, or staged in /root/stage/srvx by call 2
  [ -f "$SRV/srv.tar.xz" ] || SRV=/root/stage/srvx
  if [ -f "$SRV/srv.tar.xz" ]; then
    (cd "$SRV" && sha256sum -c srv.sha256 >/dev/null) || { echo "srvx: checksum"; exit 1; }
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/root/site')" "$SRV/srv.tar.xz" && echo "server packages in /root/site"
  fi
  # shellcheck disable=SC1091
  source .gpu/dev/env.sh
  rm -rf /root/lens && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens . >/dev/null || exit 1
  export PYTHONPATH=/root/lens:$PYTHONPATH
  python3 -c 'import torch, vllm, vllm_worker; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(), "lens", vllm_worker.__file__)' | tee "$O/env.txt"
  [ "$MODE" = install ] && exit 0
  T0=$(date +%s)
  VLLM_CACHE_ROOT=/root/vcache/check timeout 420 python3 bench/probes/gpu_monitors_check.py "$PWD/.gpu/model" > "$O/check.log" 2>&1
  echo "check rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E '^(PASS|FAIL) ' "$O/check.log" | cut -c1-600
  grep -h '^CHECK ' "$O/check.log" | cut -c7- > "$O/check.json"
  [ -s "$O/check.json" ] || tail -40 "$O/check.log"
  if [ -f bench/stream_scores.py ]; then  # W15: one server, plain and scored streams interleaved
    T0=$(date +%s)
    VLLM_CACHE_ROOT=/root/vcache/w15 timeout "${W15_TIMEOUT:-300}" python3 bench/stream_scores.py --model "$PWD/.gpu/model" \
      --streams 256 --new 128 --prompt-len 30 --repeats 3 --out "$O/w15.json" \
      --serve-args "--load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.5 --max-num-seqs 256" > "$O/w15.log" 2>&1
    echo "W15 rc=$? in $(( $(date +%s) - T0 )) s"
    cp /tmp/stream-scores-*.log "$O/w15-server.log" 2>/dev/null
    [ -s "$O/w15.json" ] && cat "$O/w15.json" || tail -30 "$O/w15.log"
  fi
  ;;
bench)
  ln -sfn .. .gpu
  # shellcheck disable=SC1091
  source .gpu/dev/env.sh
  [ -d /root/site/vllm ] || { echo "vLLM not staged (run the check call first)"; exit 1; }
  rm -rf /root/lens && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens . >/dev/null || exit 1
  # device time per forward in the lens engines' clock (bench/worker.py device_split), for where the time goes
  export VLLM_LENS_GPU_CLOCK=${VLLM_LENS_GPU_CLOCK:-1}
  # the engine core's collections by thread, beside every thread's CPU (lens_rusage: the round table's last column)
  export VLLM_LENS_HOST_CLOCK=${VLLM_LENS_HOST_CLOCK:-1}
  BENCH_GPU_UTIL=${BENCH_GPU_UTIL:-$(gpu_util)}
  export BENCH_GPU_UTIL
  export BENCH_LENS_POINTS=mlp_post BENCH_W0_END=${BENCH_W0_END:-2} REPEATS=${REPEATS:-3} OUT="$O"
  if [ "${ROW_CHECK:-1}" = 1 ] && [ -f bench/probes/row_invariance.py ]; then
    # does a probe score's row depend on the batch on this GPU (torch.mm), and does the CPU method fix it
    T0=$(date +%s)
    PYTHONPATH=/root/lens:$PYTHONPATH timeout 90 python3 bench/probes/row_invariance.py --device cuda --quick \
      > "$O/row_invariance.jsonl" 2>&1
    echo "row_invariance rc=$? in $(( $(date +%s) - T0 )) s"
  fi
  if [ "${BI_CHECK:-0}" = 1 ] && [ -f bench/probes/gpu_batch_invariant.py ]; then
    # vLLM's batch-invariant mode: the projection candidates under it, then one engine with it on
    T0=$(date +%s)
    PYTHONPATH=/root/lens:$PYTHONPATH timeout 150 python3 bench/probes/row_invariance.py --device cuda --quick \
      --vllm-batch-invariant > "$O/row_invariance_bi.jsonl" 2>&1
    echo "row_invariance --vllm-batch-invariant rc=$? in $(( $(date +%s) - T0 )) s"
    T0=$(date +%s)
    PYTHONPATH=/root/lens:$PYTHONPATH VLLM_CACHE_ROOT=/root/vcache/bi timeout "${BI_TIMEOUT:-300}" \
      python3 bench/probes/gpu_batch_invariant.py "$PWD/.gpu/model" > "$O/batch_invariant.log" 2>&1
    echo "batch_invariant rc=$? in $(( $(date +%s) - T0 )) s"
    grep '^{' "$O/batch_invariant.log" > "$O/batch_invariant.jsonl"
    grep -h '"check": "\(engine\|summary\)"' "$O/batch_invariant.jsonl" | cut -c1-600
    [ -s "$O/batch_invariant.jsonl" ] || tail -30 "$O/batch_invariant.log"
    [ "${BI_ONLY:-0}" = 1 ] && exit 0
  fi
  T0=$(date +%s)
  # BENCH_CPUS: every process of the bench (driver and engines, plain and ours alike) on these cores only
  PIN=()
  [ -n "${BENCH_CPUS:-}" ] && PIN=(taskset -c "$BENCH_CPUS")
  timeout "${BENCH_TIMEOUT:-560}" "${PIN[@]}" bash bench/gpu.sh --models "${BENCH_PLAN:-gpu-monitors}=$PWD/.gpu/model" > "$O/bench.log" 2>&1
  echo "bench rc=$? in $(( $(date +%s) - T0 )) s"
  tar -czf "$O/logs.tgz" bench/logs 2>/dev/null
  grep -E '^\[gpu-monitors[a-z-]*\] (rep|end|WARNING)|ready in|Error|error' "$O/bench.log" | cut -c1-300 | tail -80
  ;;
profile)
  # host-side py-spy of one round of each workload (plain vLLM beside it for the ratios; BENCH_SYSTEMS narrows),
  # then W15's server (both legs, one round); G/spy holds py-spy's wheel. After `install`, same machine.
  ln -sfn .. .gpu
  # shellcheck disable=SC1091
  source .gpu/dev/env.sh
  [ -d /root/site/vllm ] || { echo "vLLM not staged (run the install call first)"; exit 1; }
  rm -rf /root/lens /root/pyspy && python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /root/lens . >/dev/null || exit 1
  python3 -m pip install -q --no-deps --no-index --target /root/pyspy .gpu/spy/*.whl >/dev/null || exit 1
  export PYTHONPATH=/root/lens:$PYTHONPATH
  mkdir -p "$O/spy"
  export BENCH_LENS_POINTS=mlp_post BENCH_W0_END=0 REPEATS=1 OUT="$O"
  BENCH_GPU_UTIL=${BENCH_GPU_UTIL:-$(gpu_util)}
  export BENCH_GPU_UTIL
  export BENCH_PYSPY="$O/spy" BENCH_PYSPY_BIN=/root/pyspy/bin/py-spy BENCH_PYSPY_WORKLOADS=W0,W9,W10,W11,W12,W13,W14
  T0=$(date +%s)
  timeout "${BENCH_TIMEOUT:-400}" bash bench/gpu.sh --models "gpu-monitors=$PWD/.gpu/model" > "$O/bench.log" 2>&1
  echo "profile bench rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E '^\[gpu-monitors\] (rep|end|WARNING)|ready in|Error|error' "$O/bench.log" | cut -c1-300 | tail -30
  if [ "${W15_PROFILE:-1}" = 1 ] && [ -f bench/stream_scores.py ]; then
    T0=$(date +%s)
    VLLM_CACHE_ROOT=/root/vcache/w15 timeout "${W15_TIMEOUT:-170}" /root/pyspy/bin/py-spy record --subprocesses --threads --idle \
      --nonblocking --rate 200 --format raw --output "$O/spy/pyspy-w15.txt" -- python3 bench/stream_scores.py \
      --model "$PWD/.gpu/model" --streams 256 --new 128 --prompt-len 30 --repeats 1 --out "$O/w15.json" \
      --serve-args "--load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.5 --max-num-seqs 256" > "$O/w15.log" 2>&1
    echo "W15 profile rc=$? in $(( $(date +%s) - T0 )) s"
    [ -s "$O/w15.json" ] && cat "$O/w15.json" | cut -c1-1500 || tail -20 "$O/w15.log"
  fi
  # one archive: the device returns only so many files a call (a dozen raw profiles were left out once)
  tar -czf "$O/spy.tgz" -C "$O" spy && rm -rf "$O/spy" && ls -la "$O/spy.tgz"
  ;;
cpu-smoke)
  # shellcheck disable=SC1091
  [ -f scripts/env.sh ] && source scripts/env.sh
  PY=${PY:-.venv/bin/python}
  M=$($PY -m vllm_worker.shipped_model)
  CHECK_DEVICE=cpu CHECK_DTYPE=float32 CHECK_DUMMY=0 CHECK_N_NEW=8 timeout 900 $PY bench/probes/gpu_monitors_check.py "$M" > "$O/check.log" 2>&1
  echo "check rc=$?"
  grep -E '^(PASS|FAIL) ' "$O/check.log" | cut -c1-300
  BENCH_LENS_POINTS=mlp_post BENCH_W0_END=1 BENCH_KV_BYTES=$((1 << 30)) timeout 1500 $PY bench/run.py --models "gpu-monitors=$M" \
    --n 8 --prompt-len 16 --new 8 --repeats 2 --machine cpu-smoke --no-bulk --out "$O" > "$O/bench.log" 2>&1
  echo "bench rc=$?"
  grep -E 'rep |end |error|Error' "$O/bench.log" | tail -40
  ;;
*)
  echo "unknown mode $MODE" >&2
  exit 2
  ;;
esac
