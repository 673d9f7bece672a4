"""Run plain generation in a fresh process (used with VLLM_LENS_DISABLE=1 as the untouched baseline).

Usage: python plain_run.py MODEL_DIR PROMPTS_JSON MAX_TOKENS  -> prints one JSON line.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.outputs import RequestOutput  # noqa: E402

model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
# same mode as the test session that started us (support.engines.COMPILED)
eager = os.environ.get("LENS_TEST_COMPILED", "") != "1"
llm = LLM(model, dtype="float32", max_model_len=512, seed=0, enforce_eager=eager, kv_cache_memory_bytes=128 << 20)
sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"output_residual_stream": [0]})
outs = llm.generate(prompts, sp, use_tqdm=False)
print(
    "RESULT "
    + json.dumps(
        {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "has_activations_attr": any(hasattr(o, "activations") for o in outs)
            or hasattr(RequestOutput, "activations"),
            "worker_extension_cls": llm.llm_engine.vllm_config.parallel_config.worker_extension_cls,
            "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager,
        }
    )
)
