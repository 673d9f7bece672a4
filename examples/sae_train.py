"""Train a small TopK sparse autoencoder on the shipped SmolLM2's residual stream, save it in the SAELens
format, load it into the engine and draw the top-activating tokens of a few of its features.

    python examples/sae_train.py --out-png docs/images/sae_features.png

Activations: the residual stream after `--layer` of every token of 384 templated sentences about 8 topics
(`inspect_lens.oracle_data`), captured by the engine itself (`output_residual_stream`). Training: plain torch
(Adam, TopK activation, MSE; decoder rows kept at unit norm) — about two minutes on 2 CPU cores. The SAE is
trained on first use into `<user cache>/inspect-lens/saes/` and reused afterwards (`--retrain` to redo it).
The picture is made from features the engine returned (`output_sae_features` with `top_k`), not from the
training code.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def default_dir(layer: int, d_sae: int, k: int) -> Path:
    from vllm_worker.shipped_model import cache_root

    return cache_root() / "saes" / f"smollm2-135m-L{layer}-topk{k}-{d_sae}-v2"


def texts() -> list[str]:
    from inspect_lens.oracle_data import topic_texts

    return [t for t, _ in topic_texts(False) + topic_texts(True)]


def capture(llm, prompts: list[str], layer: int) -> list[tuple[list[int], torch.Tensor]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_residual_stream": [layer]})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.prompt_token_ids), o.activations["residual_stream"][0].clone()) for o in outs]


def train(x: torch.Tensor, layer: int, d_sae: int, k: int, steps: int, seed: int = 0):
    """A TopK SAE (float32) on rows `x` (n, d), each rescaled to norm sqrt(d) first (SAELens's
    `constant_norm_rescale`: a few tokens of this model have norms ~50x the rest): pre = (x' - b_dec) @ W_enc
    + b_enc, keep the k largest."""
    from vllm_worker.sae import Sae

    g = torch.Generator().manual_seed(seed)
    d = x.shape[1]
    x = x * (d**0.5 / x.norm(dim=-1, keepdim=True))
    scale = x.norm(dim=-1).mean()
    W_dec = torch.randn(d_sae, d, generator=g)
    W_dec = (W_dec / W_dec.norm(dim=-1, keepdim=True)).requires_grad_()
    W_enc = W_dec.detach().T.clone().requires_grad_()
    b_enc = torch.zeros(d_sae, requires_grad=True)
    b_dec = x.mean(0).clone().requires_grad_()
    opt = torch.optim.Adam([W_enc, b_enc, W_dec, b_dec], lr=1e-3)
    for step in range(steps):
        batch = x[torch.randint(len(x), (256,), generator=g)]
        pre = (batch - b_dec) @ W_enc + b_enc
        top = pre.topk(k, dim=-1)
        f = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        loss = ((f @ W_dec + b_dec - batch) ** 2).sum(-1).mean() / scale**2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            W_dec /= W_dec.norm(dim=-1, keepdim=True)
        if step % 250 == 0 or step == steps - 1:
            print(f"step {step:5d}  relative mse {loss.item():.4f}")
    return Sae(
        "resid_post",
        layer,
        "topk",
        W_enc.detach(),
        b_enc.detach(),
        W_dec.detach(),
        b_dec.detach(),
        None,
        k,
        normalize="constant_norm_rescale",
    )


def ensure_sae(llm, layer: int, d_sae: int, k: int, steps: int, out: Path, retrain: bool = False) -> Path:
    from vllm_worker.sae import save

    if (out / "cfg.json").is_file() and not retrain:
        print(f"SAE: {out} (cached)")
        return out
    t = time.time()
    rows = torch.cat([a[1:] for _, a in capture(llm, texts(), layer)])  # not the first token (attention sink)
    print(f"captured {len(rows)} token activations at layer {layer} in {time.time() - t:.0f}s")
    t = time.time()
    sae = train(rows, layer, d_sae, k, steps)
    save(sae, out, model_name="SmolLM2-135M-Instruct", dataset_path="inspect_lens.oracle_data")
    print(f"trained in {time.time() - t:.0f}s; saved {out}")
    return out


def top_tokens(llm, tok, layer: int, n_features: int, per_feature: int) -> dict[int, list[tuple[float, str]]]:
    """The features that fire on the most tokens (engine-side top-k) and each one's strongest tokens."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, extra_args={"output_sae_features": {"sae": "demo", "top_k": 8}})
    hits: dict[int, list[tuple[float, str]]] = {}
    for o in llm.generate(texts(), sp, use_tqdm=False):
        ids = list(o.prompt_token_ids)
        got = o.activations["sae_features"]["demo"]
        for pos, (fs, vs) in enumerate(zip(got["indices"].tolist(), got["values"].tolist())):
            if pos == 0:
                continue  # the first token's stream is far from the rest (attention sink)
            context = tok.decode(ids[max(1, pos - 4) : pos]) + "[" + tok.decode(ids[pos : pos + 1]) + "]"
            for f, v in zip(fs, vs):
                if v > 0:
                    hits.setdefault(f, []).append((v, context.replace("\n", " ")))
    # specific features: firing on 0.3-3% of tokens, the most frequent of those first
    n_tokens = sum(len(v) for v in hits.values()) / 8
    busy = sorted((f for f in hits if 0.003 * n_tokens <= len(hits[f]) <= 0.03 * n_tokens), key=lambda f: -len(hits[f]))
    chosen = [f for f in busy if len({c for _, c in hits[f]}) >= per_feature][:n_features]
    out = {}
    for f in chosen:
        seen, best = set(), []
        for v, c in sorted(hits[f], reverse=True):
            if c not in seen:
                seen.add(c)
                best.append((v, c))
            if len(best) == per_feature:
                break
        out[f] = best
    return out


def draw(features: dict[int, list[tuple[float, str]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(features)
    fig, axes = plt.subplots(n, 1, figsize=(9, 1.9 * n))
    for ax, (f, rows) in zip(axes, features.items()):
        vals = [v for v, _ in rows][::-1]
        ax.barh(range(len(rows)), vals, color="#4878cf")
        ax.set_yticks(range(len(rows)), [c for _, c in rows][::-1], fontsize=8)
        ax.set_title(f"feature {f}", fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--d-sae", type=int, default=1152)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=None, help="SAE folder (default: in the user cache)")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--out-png", default="sae_features.png")
    ap.add_argument("--features", type=int, default=6)
    args = ap.parse_args()

    from vllm import LLM

    from vllm_worker.shipped_model import shipped_model_path

    llm = LLM(
        str(shipped_model_path()),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=512 << 20,
    )
    out = args.out or default_dir(args.layer, args.d_sae, args.k)
    ensure_sae(llm, args.layer, args.d_sae, args.k, args.steps, out, args.retrain)
    print("loaded:", llm.load_sae("demo", str(out)))
    feats = top_tokens(llm, llm.get_tokenizer(), args.layer, args.features, 6)
    for f, rows in feats.items():
        print(f"feature {f}: " + " | ".join(f"{c} {v:.1f}" for v, c in rows[:4]))
    draw(feats, args.out_png, f"SmolLM2-135M, TopK SAE (k={args.k}, {args.d_sae} features) at resid_post[{args.layer}]")
    print(f"picture: {args.out_png}")


if __name__ == "__main__":
    main()
