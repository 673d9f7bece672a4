"""Capture and steering on the shipped SmolLM2-135M-Instruct, on CPU, in one batch.

    python examples/capture_and_steer.py            (after scripts/setup.sh; or run scripts/main.sh)

1. Capture the residual stream at a few layers for a chat prompt (prompt + generated positions).
2. Build a steering vector from the model's own activations (mean difference between two prompt
   sets at a middle layer) and add it to one request, while a batch-mate runs unsteered.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from vllm_worker import SteeringVector  # noqa: E402
from vllm_worker.shipped_model import shipped_model_path  # noqa: E402

LAYER = 15


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    llm = LLM(str(shipped_model_path()), dtype="float32", max_model_len=1024, seed=0)
    tok = llm.get_tokenizer()

    def chat(text: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)

    # 1) capture
    sp = SamplingParams(max_tokens=12, temperature=0, extra_args={"output_residual_stream": [0, LAYER, -1]})
    out = llm.generate([chat("What is the capital of France?")], sp, use_tqdm=False)[0]
    acts = out.activations["residual_stream"]
    print(f"answer: {out.outputs[0].text!r}")
    print(
        f"captured layers {out.activations['layers']}: tensor {tuple(acts.shape)} "
        f"(layers, prompt {len(out.prompt_token_ids)} + generated {len(out.outputs[0].token_ids)} - 1, d_model)"
    )
    print(f"residual norm at the last position, per layer: {acts[:, -1].norm(dim=-1).tolist()}")

    # 2) a steering vector from the model's own activations: mean(happy) - mean(sad) at LAYER
    happy = ["I love this wonderful day!", "What a joyful, delightful surprise!", "This is fantastic news!"]
    sad = ["I hate this miserable day.", "What a painful, awful loss.", "This is terrible news."]
    cap = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_residual_stream": [LAYER]})
    means = [
        torch.stack(
            [
                o.activations["residual_stream"][0].mean(0)
                for o in llm.generate([chat(t) for t in group], cap, use_tqdm=False)
            ]
        ).mean(0)
        for group in (happy, sad)
    ]
    direction = (means[0] - means[1]).unsqueeze(0)  # (1 layer, d_model)
    steer = SteeringVector(direction, [LAYER], scale=4.0)

    question = chat("Describe your morning in one sentence.")
    plain = SamplingParams(max_tokens=30, temperature=0)
    steered = SamplingParams(max_tokens=30, temperature=0, extra_args={"apply_steering_vectors": [steer]})
    a, b = llm.generate([question, question], [plain, steered], use_tqdm=False)  # same batch
    print(f"unsteered: {a.outputs[0].text!r}")
    print(f"steered (+happy at layer {LAYER}, scale 4): {b.outputs[0].text!r}")


if __name__ == "__main__":
    main()
