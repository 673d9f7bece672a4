"""Logit lens: what each layer's residual stream would predict, at every position, read inside vLLM.

    vllm-lens serve MODEL --allow-remote-hooks      # hooks run on the server: the operator opts in
    python examples/logit_lens.py --base-url http://127.0.0.1:8000 --prompt "The capital of France is" \\
        --out logit_lens.png
    python examples/logit_lens.py --offline         # in-process engine on the shipped SmolLM2 (no server)

A post-hook on every layer applies the final RMSNorm and the unembedding (read with
`ctx.get_parameter`, full and unsharded on any TP/PP layout) to that layer's stream at every prompt
position, and keeps the top token and its probability in `ctx.saved`. Output: a (layer x position) grid
of top tokens as a PNG (cell colour = probability), and the last position's column printed. For
Llama-family models (final RMSNorm at `model.norm`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import cloudpickle
import torch

from vllm_worker import Hook

# the hook travels to the server by value (the server cannot import this file)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def logit_lens(ctx, h):
    """Top token and its probability per row of this layer's stream."""
    norm = ctx.model.model.norm
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(norm, "variance_epsilon", 1e-5))
    x = x * ctx.get_parameter("model.norm.weight").float()
    p, i = (x @ ctx.get_parameter("lm_head.weight").float().T).softmax(-1).max(-1)
    ctx.saved.setdefault(ctx.layer_idx, []).append((ctx.positions.cpu(), i.cpu(), p.cpu()))
    return None


def grid_from_saved(saved: dict, n_layers: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top token ids, probabilities), each (n_layers, n_pos), from the hook's state (results of several
    forward passes — chunked prefill — are merged by position)."""
    ids = torch.full((n_layers, n_pos), -1, dtype=torch.long)
    probs = torch.zeros(n_layers, n_pos)
    for layer in range(n_layers):
        for pos, i, p in saved[layer] if layer in saved else saved[str(layer)]:
            keep = pos < n_pos
            ids[layer, pos[keep]] = i[keep]
            probs[layer, pos[keep]] = p[keep].float()
    return ids, probs


def run_server(base_url: str, api_key: str | None, prompt: str) -> dict[str, Any]:
    from vllm_worker import LensClient

    client = LensClient(base_url, api_key=api_key)
    n_layers = client.info()["n_layers"]
    ids = client.tokenize(prompt)
    r = client.generate(ids, max_tokens=1, temperature=0, hooks=[Hook(logit_lens, list(range(n_layers)))])
    top, probs = grid_from_saved(r.hook_results["0"], n_layers, len(ids))
    return {"ids": ids, "top": top, "probs": probs, "decode": lambda t: client.detokenize([int(t)])}


def run_offline(prompt: str) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from vllm_worker.shipped_model import shipped_model_path

    llm = LLM(str(shipped_model_path()), dtype="float32", max_model_len=1024)
    tok = llm.get_tokenizer()
    n_layers = llm.llm_engine.model_config.get_total_num_hidden_layers()
    ids = tok.encode(prompt)
    sp = SamplingParams(
        max_tokens=1, temperature=0, extra_args={"apply_hooks": [Hook(logit_lens, list(range(n_layers)))]}
    )
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    top, probs = grid_from_saved(out.hook_results["0"], n_layers, len(ids))
    return {"ids": ids, "top": top, "probs": probs, "decode": lambda t: tok.decode([int(t)])}


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top, probs, decode = res["top"], res["probs"], res["decode"]
    n_layers, n_pos = top.shape
    fig, ax = plt.subplots(figsize=(1.1 * n_pos + 2, 0.32 * n_layers + 1.5))
    ax.imshow(probs.numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=1, origin="lower")
    for l in range(n_layers):
        for t in range(n_pos):
            ax.text(
                t,
                l,
                decode(top[l, t])[:8],
                ha="center",
                va="center",
                fontsize=6,
                color="white" if probs[l, t] > 0.45 else "black",
            )
    ax.set_xticks(range(n_pos), [decode(i) for i in res["ids"]], rotation=45, ha="right", fontsize=7)
    layers = res.get("layers", list(range(n_layers)))
    ax.set_yticks(range(n_layers), [str(l) for l in layers], fontsize=7)
    ax.set_ylabel("layer")
    ax.set_title(
        res.get("title", "logit lens") + ": top next-token per (layer, position); colour = its probability", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--offline", action="store_true", help="in-process engine on the shipped SmolLM2 instead")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--out", default="logit_lens.png")
    args = ap.parse_args()
    res = run_offline(args.prompt) if args.offline else run_server(args.base_url, args.api_key, args.prompt)
    plot(res, args.out)
    for layer in range(res["top"].shape[0]):
        print(f"layer {layer:2d}: {res['decode'](res['top'][layer, -1])!r:>14}  p={res['probs'][layer, -1]:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
