"""Train a tiny activation oracle: a LoRA that answers "what topic did this activation come from?" about
an activation vector injected into its own forward pass (peft + HF transformers, on CPU).

    python examples/activation_oracle_fit.py                 # the shipped SmolLM2: ~10 min on 2 cores
    python examples/activation_oracle_fit.py --model DIR --steps 40 --out DIR   # any Llama-family model

Data, made here from the base model's own activations: templated sentences about 8 topics
(`inspect_lens.oracle_data`; whole templates are held out for evaluation). Each sentence is a user
message in the chat template; its residual stream after the source layer (the middle one by default),
averaged over the sentence's tokens, is what the oracle reads — as the `activation_oracle` solver
reads a conversation with `positions="mean"`. The oracle prompt is the chat template of

    Layer: {L}
     ?
    What is the topic of the text? Answer with one word.

and the vector is added at the placeholder " ?" after layer 1 exactly as vLLM's steering does it with
`SteeringVector(v[None, None], [1], scale=1, norm_match=True, position_indices=[pos])`:
h <- h + |h| v/|v|. The LoRA (rank 8 on every projection) is trained with the loss on the answer
tokens only. Saved: a standard peft adapter folder plus `oracle.json` (source layer, injection
layer, placeholder, question, topics). Printed: held-out accuracy with the real vector, with the
vectors shuffled across samples, and with no vector — the gap is the evidence that the oracle reads
the activation rather than guessing.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from inspect_lens.oracle_data import PLACEHOLDER, QUESTION, TOPICS, oracle_ids, oracle_prompt, text_window, topic_texts



def make_samples() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held out) lists of (text, topic); held-out uses templates never seen in training."""
    return topic_texts(held_out=False), topic_texts(held_out=True)


@torch.no_grad()
def source_vectors(model, tok, texts: list[str], layer: int) -> torch.Tensor:
    """(n, d): the stream after `layer`, averaged over each text's tokens inside the chat template — the
    same numbers vLLM's capture gives the solver (`positions="mean"`)."""
    out = []
    for text in texts:
        ids, (a, b) = text_window(tok, text)
        hs = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states[layer + 1]
        out.append(hs[0, a:b].mean(0).float())
    return torch.stack(out)


class Injector:
    """Forward hook on decoder layer 1: h[pos] += |h[pos]| v/|v| per batch row (vLLM's norm_match)."""

    def __init__(self, layer_module: torch.nn.Module) -> None:
        self.vectors: torch.Tensor | None = None  # (B, d) or None (no injection)
        self.positions: list[int] = []
        layer_module.register_forward_hook(self)

    def __call__(self, mod, args, out):
        if self.vectors is None:
            return None
        h = out[0] if isinstance(out, tuple) else out
        rows = torch.arange(h.shape[0])
        pos = torch.tensor(self.positions)
        cur = h[rows, pos]
        v = self.vectors.to(h.dtype)
        add = cur.norm(dim=-1, keepdim=True) * v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        h = h.index_put((rows, pos), cur + add)
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h


def encode(tok, source_layer: int, answer: str | None, placeholder: str = PLACEHOLDER) -> tuple[list[int], int, int]:
    """(ids, placeholder position, number of prompt tokens) for the oracle prompt (+ answer if given)."""
    prompt, pos = oracle_ids(tok, source_layer, QUESTION, placeholder)
    ids = prompt + (tok.encode(answer + tok.eos_token, add_special_tokens=False) if answer else [])
    return ids, pos, len(prompt)


def answer_logprobs(model, tok, inj: Injector, source_layer: int, vectors: torch.Tensor | None,
                    placeholder: str = PLACEHOLDER) -> torch.Tensor:
    """(n, n_topics): log p(topic answer | oracle prompt with each vector injected)."""
    topics = list(TOPICS)
    base, pos, n_prompt = encode(tok, source_layer, None, placeholder)
    cands = [tok.encode(t + tok.eos_token, add_special_tokens=False) for t in topics]
    n = 1 if vectors is None else len(vectors)
    scores = torch.zeros(n, len(topics))
    with torch.no_grad():
        for k, cand in enumerate(cands):
            ids = torch.tensor([base + cand] * n)
            inj.vectors, inj.positions = vectors, [pos] * n
            logits = model(ids, use_cache=False).logits.float().log_softmax(-1)
            tgt = ids[:, n_prompt:]
            scores[:, k] = logits[:, n_prompt - 1:-1].gather(-1, tgt.unsqueeze(-1)).squeeze(-1).sum(-1)
    inj.vectors = None
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the shipped SmolLM2, converted)")
    ap.add_argument("--source-layer", type=int, default=None, help="default: the middle layer")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placeholder", default=PLACEHOLDER, help="where the vector goes (one token is best)")
    ap.add_argument("--out", default=None, help="adapter folder (default: under the user cache)")
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_worker.shipped_model import cache_root, shipped_model_path

    model_dir = args.model or str(shipped_model_path())
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_layers = base.config.num_hidden_layers
    layer = n_layers // 2 if args.source_layer is None else args.source_layer
    out = Path(args.out or cache_root() / "oracles" / f"{Path(model_dir).name}-topic-L{layer}")
    train, test = make_samples()
    topics = list(TOPICS)
    v_train = source_vectors(base, tok, [t for t, _ in train], layer)
    v_test = source_vectors(base, tok, [t for t, _ in test], layer)
    y_test = torch.tensor([topics.index(c) for _, c in test])

    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    inj = Injector(model.base_model.model.model.layers[1])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    encoded = [encode(tok, layer, topic, args.placeholder) for _, topic in train]
    model.train()
    for step in range(args.steps):
        idx = random.sample(range(len(train)), args.batch)
        width = max(len(encoded[i][0]) for i in idx)
        ids = torch.full((len(idx), width), tok.pad_token_id or 0)
        labels = torch.full((len(idx), width), -100)
        for r, i in enumerate(idx):
            seq, _, n_prompt = encoded[i]
            ids[r, :len(seq)] = torch.tensor(seq)
            labels[r, n_prompt:len(seq)] = torch.tensor(seq[n_prompt:])
        inj.vectors, inj.positions = v_train[idx], [encoded[i][1] for i in idx]
        loss = model(ids, labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()
    inj.vectors = None
    perm = torch.randperm(len(v_test), generator=torch.Generator().manual_seed(args.seed + 1))
    results = {}
    for name, vecs in (("real", v_test), ("shuffled", v_test[perm]), ("none", None)):
        scores = answer_logprobs(model, tok, inj, layer, vecs, args.placeholder)
        pred = scores.argmax(-1)
        pred = pred.expand(len(y_test)) if vecs is None else pred
        results[name] = float((pred == y_test).float().mean())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    meta = {"base_model": model_dir, "source_layer": layer, "injection_layer": 1, "placeholder": args.placeholder,
            "question": QUESTION, "prompt": oracle_prompt(layer, placeholder=args.placeholder), "topics": topics,
            "vector": "mean over the text's tokens (user message, chat template)",
            "held_out_accuracy": results, "chance": 1 / len(topics), "steps": args.steps}
    (out / "oracle.json").write_text(json.dumps(meta, indent=1))
    print(f"held-out accuracy ({len(test)} texts, {len(topics)} topics, chance {1 / len(topics):.3f}): "
          + ", ".join(f"{k} vector {v:.3f}" for k, v in results.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
