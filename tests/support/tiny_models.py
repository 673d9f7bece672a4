"""Tiny random-weight models (Llama, Qwen2, GPT2 and OPT families) with an offline-built tokenizer.

head_dim is 32 (vLLM's CPU attention needs >= 32). Built once into a cache folder keyed by family.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 512


def _tokenizer(dst: Path) -> None:
    """A byte-level BPE trained offline on a fixed corpus (works under every tokenizer class)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    words = (
        "the a of to and in is it that was for on are with as his they be at one have this from "
        "or had by hot word but what some we can out other were all there when up use your how said "
        "an each she which do their time if will way about many then them write would like so these "
        "her long make thing see him two has look more day could go come did number sound no most "
        "people my over know water than call first who may down side been now find"
    ).split()
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=VOCAB, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(dst)


def _config(family: str):
    from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            **common,
        )
    if family == "qwen2":
        return Qwen2Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            **common,
        )
    if family == "gpt2":
        return GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=1024, **common)
    if family == "opt":
        return OPTConfig(
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            word_embed_proj_dim=128,
            max_position_embeddings=1024,
            pad_token_id=0,
            do_layer_norm_before=True,
            **common,
        )
    raise ValueError(family)


def build(family: str, root: Path) -> Path:
    """Folder of a tiny `family` model (created on first call; deterministic weights)."""
    from transformers import AutoModelForCausalLM

    dst = root / f"tiny-{family}"
    if (dst / "config.json").exists():
        return dst
    torch.manual_seed({"llama": 1, "qwen2": 2, "gpt2": 3, "opt": 4}[family])
    cfg = _config(family)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default weights so that layers actually move the residual stream.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    tmp = dst.with_name(dst.name + ".tmp")
    model.save_pretrained(tmp)
    _tokenizer(tmp)
    os.replace(tmp, dst)
    return dst
