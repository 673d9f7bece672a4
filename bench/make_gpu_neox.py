"""A Pythia-1.4B-shaped GPT-NeoX config folder for vLLM's `load_format="dummy"` on the lent H200, made the way
`../shared/gpu/prepare.sh` makes the 8B-shaped `.gpu/model`: a config.json (random weights of the real
shapes, nothing on disk) and the tokenizer files of the staged `.gpu/model` (the bench sends token ids, so the
tokenizer only has to load; its vocabulary is smaller than the model's 50304).

    python bench/make_gpu_neox.py [.gpu/neox]    # from the repo root, after prepare.sh; prints the folder

Used by the hook-point check (issue #24): with the plugin installed and CUDA graphs on, the engine must start
(it failed before with "LensIncompatibleVLLM: cannot find the decoder layers of CUDAGraphWrapper").
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIG = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "rotary_pct": 0.25,
    "rotary_emb_base": 10000,
    "use_parallel_residual": True,
    "vocab_size": 50304,
    "max_position_embeddings": 2048,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-05,
    "initializer_range": 0.02,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "use_cache": True,
}


def make(dst: Path, tokenizer_src: Path = ROOT / ".gpu" / "model") -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(CONFIG, indent=1) + "\n")
    copied = 0
    for f in tokenizer_src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
            copied += 1
    if not copied:
        raise SystemExit(f"no tokenizer files in {tokenizer_src} (run ../shared/gpu/prepare.sh first)")
    return dst


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".gpu" / "neox"))
