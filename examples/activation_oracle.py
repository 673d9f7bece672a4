"""Ask an activation oracle about a text, in one in-process vLLM engine: capture from the base model,
inject into the oracle LoRA — both in the same engine, as ordinary requests.

    python examples/activation_oracle_fit.py          # once: trains the oracle for the shipped SmolLM2
    python examples/activation_oracle.py --text "The striker scored in the last minute of the final."

1. A base-model request (no LoRA) reads the text as a user message with capture at the oracle's source
   layer; the vector is the stream averaged over the text's tokens (what the oracle was trained on).
2. An oracle request (LoRA) asks the oracle's question with the vector added at the placeholder after
   layer 1, norm-matched: `SteeringVector(v[None, None], [1], norm_match=True, position_indices=[pos])`.
   The same question without the vector shows what the oracle says when it cannot read anything.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds


def ask(llm, oracle_dir: str, texts: list[str]) -> list[dict]:
    """Per text: the oracle's answers with its vector and with none."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from inspect_lens.oracle_data import oracle_ids, text_window
    from vllm_worker import SteeringVector

    meta = json.loads((Path(oracle_dir) / "oracle.json").read_text())
    layer, inject, ph = meta["source_layer"], meta.get("injection_layer", 1), meta["placeholder"]
    tok = llm.get_tokenizer()
    # vLLM caches adapters by integer id: derive it from the folder so another adapter already loaded
    # in this engine under some id is never mistaken for the oracle
    path = str(Path(oracle_dir).resolve())
    lora = LoRARequest(f"oracle-{Path(path).name}", 1 + zlib.crc32(path.encode()) % (1 << 30), path)
    # 1. the vectors: capture on the base model, the text as an open user turn
    prompts, windows = [], []
    for text in texts:
        ids, window = text_window(tok, text)
        prompts.append({"prompt_token_ids": ids})
        windows.append(window)
    cap = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_residual_stream": [layer]})
    outs = llm.generate(prompts, cap, use_tqdm=False)
    vecs = [o.activations["residual_stream"][0, a:b].float().mean(0) for o, (a, b) in zip(outs, windows)]
    # 2. the oracle: one prompt, the vector at the placeholder
    ids, pos = oracle_ids(tok, layer, meta["question"], ph)
    q = {"prompt_token_ids": ids}
    sps = [
        SamplingParams(
            max_tokens=8,
            temperature=0,
            extra_args={
                "apply_steering_vectors": [
                    SteeringVector(v[None, None], [inject], scale=1.0, norm_match=True, position_indices=[pos])
                ]
            },
        )
        for v in vecs
    ]
    real = llm.generate([q] * len(vecs), sps, lora_request=lora, use_tqdm=False)
    none = llm.generate([q], SamplingParams(max_tokens=8, temperature=0), lora_request=lora, use_tqdm=False)[0]
    return [
        {"text": t, "answer": r.outputs[0].text.strip(), "without_vector": none.outputs[0].text.strip()}
        for t, r in zip(texts, real)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="base model folder (default: the shipped SmolLM2)")
    ap.add_argument("--oracle", default=None, help="adapter folder with oracle.json (default: the fit script's)")
    ap.add_argument("--text", action="append", default=None, help="a text to ask about (repeatable)")
    args = ap.parse_args()
    from vllm import LLM

    from vllm_worker.shipped_model import cache_root, shipped_model_path

    model = args.model or str(shipped_model_path())
    oracle = args.oracle or str(cache_root() / "oracles" / f"{Path(model).name}-topic-L15")
    if not (Path(oracle) / "oracle.json").exists():
        raise SystemExit(f"no oracle at {oracle}: run examples/activation_oracle_fit.py first")
    rank = json.loads((Path(oracle) / "adapter_config.json").read_text())["r"]
    llm = LLM(model, dtype="float32", max_model_len=1024, enable_lora=True, max_lora_rank=max(8, rank), seed=0)
    texts = args.text or [
        "The striker scored in the last minute of the final.",
        "Preheat the oven and whisk the eggs with sugar.",
        "The telescope spotted a comet near Jupiter.",
    ]
    for r in ask(llm, oracle, texts):
        print(f"{r['text']!r}\n  oracle: {r['answer']!r}   (without the vector: {r['without_vector']!r})")


if __name__ == "__main__":
    main()
