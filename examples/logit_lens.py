"""Logit lens over SmolLM2-135M-Instruct with a hook, inside vLLM's batched forward pass.

    python examples/logit_lens.py        (after scripts/setup.sh)

A post-hook on every layer applies the final RMSNorm and the unembedding (read with
`ctx.get_parameter`, full and unsharded on any TP/PP layout) to the residual stream of the last
position, and keeps the top token per layer in `ctx.saved`.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from vllm_worker import Hook  # noqa: E402
from vllm_worker.shipped_model import shipped_model_path  # noqa: E402


def logit_lens(ctx, h):
    # max_tokens=1: one forward pass (the prefill); its last row is the last prompt position
    w = ctx.get_parameter("lm_head.weight")
    g = ctx.get_parameter("model.norm.weight")
    x = h[-1:].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    ctx.saved[ctx.layer_idx] = (x @ w.float().T).softmax(-1).topk(1)
    return None


def main() -> None:
    llm = LLM(str(shipped_model_path()), dtype="float32", max_model_len=1024)
    tok = llm.get_tokenizer()
    L = llm.llm_engine.model_config.get_total_num_hidden_layers()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True) + "The capital of France is"
    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"apply_hooks": [Hook(logit_lens, list(range(L)))]})
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    saved = out.hook_results["0"]
    print(f"next token: {out.outputs[0].text!r}")
    for layer in range(L):
        p, i = saved[layer]
        print(f"layer {layer:2d}: {tok.decode([int(i)])!r:>14}  p={float(p):.3f}")


if __name__ == "__main__":
    main()
