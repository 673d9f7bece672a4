"""Plain vLLM (plugin disabled): does one prompt give bitwise the same logprobs alone as batched with another
request? Prints one line `RESULT <vllm version> bitwise=<bool> max_logprob_diff=<float>`.

scripts/compat-matrix.sh runs it on each release: where plain vLLM itself is not bitwise batch-invariant on
CPU, the suite's bitwise checks across batch compositions (a request alone vs. in a batch, a server vs. an
offline engine) cannot hold either, while every comparison with HF at its tolerance does.

Usage: python batch_invariance.py MODEL_DIR
"""

import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_LENS_DISABLE"] = "1"

import vllm  # noqa: E402

llm = vllm.LLM(
    sys.argv[1], dtype="float32", max_model_len=512, seed=0, enforce_eager=True, kv_cache_memory_bytes=128 << 20
)
prompt = "the water of people will come down to the side"
other = "a completely different and longer prompt about rivers and the sea"
sp = vllm.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)


def logprobs(out) -> list[tuple[int, float]]:
    c = out.outputs[0]
    return [(t, d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]


alone = logprobs(llm.generate([prompt], sp, use_tqdm=False)[0])
batched = logprobs(llm.generate([prompt, other], sp, use_tqdm=False)[0])
diff = max(abs(a[1] - b[1]) for a, b in zip(alone, batched))
same_tokens = [t for t, _ in alone] == [t for t, _ in batched]
print(f"RESULT {vllm.__version__} bitwise={alone == batched} same_tokens={same_tokens} max_logprob_diff={diff:.3g}")
