"""Start a real engine with the plugin in a fresh process that reports vLLM as another release, and print
one JSON line: what the start raised (its class) or the capture of one prompt (used by
tests/engine/test_version_gate.py: the release gate acts where a user meets it, at engine start).

Usage: python version_run.py MODEL_DIR MAJOR MINOR
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402

model, major, minor = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vllm.__version_tuple__ = (major, minor, 0)  # what compat.version reads first
try:
    llm = vllm.LLM(
        model, dtype="float32", max_model_len=512, seed=0, enforce_eager=True, kv_cache_memory_bytes=128 << 20
    )
except Exception as e:  # noqa: BLE001 - reported by class, the test tells the kinds apart
    print("RESULT " + json.dumps({"raised": type(e).__name__, "message": str(e)}))
    sys.exit(0)
sp = vllm.SamplingParams(max_tokens=2, temperature=0, extra_args={"output_residual_stream": [1]})
out = llm.generate(["the water"], sp, use_tqdm=False)[0]
print(
    "RESULT "
    + json.dumps({"tokens": list(out.outputs[0].token_ids), "capture": out.activations["resid_post"].tolist()})
)
