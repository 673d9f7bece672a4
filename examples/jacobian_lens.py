"""Jacobian lens readout inside vLLM: each layer's stream, moved by J_l, read through the final norm and
the unembedding — top-k next tokens per (layer, position).

    python examples/jacobian_lens_fit.py --out lens.pt                   # once (HF on CPU)
    vllm-lens serve MODEL --allow-remote-hooks                           # hooks run on the server: opt in
    python examples/jacobian_lens.py run --lens lens.pt --prompt "The capital of France is" --grid-out jlens.png
    python examples/jacobian_lens.py run --lens lens.pt --baseline ...   # plain logit lens (J = identity)

The readout is one post-hook on the lens's source layers, running on the worker in vLLM's batch:
x = h_l J_l^T, then the model's final RMSNorm and unembedding (`ctx.get_parameter`, full and unsharded
on any TP/PP layout), then top-k. Only the small results (token ids, probabilities) travel back. With
J = identity it is exactly the logit lens. For Llama-family models (final RMSNorm at `model.norm`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import cloudpickle
import torch

from vllm_worker import Hook, LensClient

# the hook travels to the server by value (the server cannot import this file)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def readout_hook(J: dict[int, torch.Tensor] | None, k: int, last_row_only: bool = False):
    """Post-hook: top-k readout of J_l h_l (h_l itself where `J` is None or lacks the layer). Saves, per
    layer, (positions, top ids (rows, k), probabilities (rows, k)) per forward step. `last_row_only`: read
    only each step's last row (the position that predicts the next generated token)."""

    def readout(ctx, h):
        pos = ctx.positions
        if last_row_only:
            h, pos = h[-1:], pos[-1:]
        x = h.float()
        if J is not None and ctx.layer_idx in J:
            x = x @ J[ctx.layer_idx].to(x.device, torch.float32).T
        norm = ctx.model.model.norm
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(norm, "variance_epsilon", 1e-5))
        x = x * ctx.get_parameter("model.norm.weight").float()
        p, i = (x @ ctx.get_parameter("lm_head.weight").float().T).softmax(-1).topk(k, dim=-1)
        ctx.saved.setdefault(ctx.layer_idx, []).append((pos.cpu(), i.cpu(), p.cpu()))
        return None

    return readout


def readout_from_saved(saved: dict, layers: list[int], n_pos: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probs), each (len(layers), n_pos, k), from a readout hook's results (steps merged by
    position; JSON results have string keys and lists, offline ones int keys and tensors)."""
    ids = torch.full((len(layers), n_pos, k), -1, dtype=torch.long)
    probs = torch.zeros(len(layers), n_pos, k)
    for row, layer in enumerate(layers):
        for pos, i, p in saved.get(layer, saved.get(str(layer), [])):
            pos, i, p = torch.as_tensor(pos), torch.as_tensor(i), torch.as_tensor(p)
            keep = pos < n_pos
            ids[row, pos[keep]] = i[keep].long()
            probs[row, pos[keep]] = p[keep].float()
    return ids, probs


def load_lens(path: str | None, n_layers: int, baseline: bool) -> tuple[dict[int, torch.Tensor] | None, list[int]]:
    """(J per source layer, or None for the plain logit lens; the layers to read)."""
    if baseline or path is None:
        return None, list(range(n_layers))
    lens = torch.load(path, map_location="cpu")
    layers = [int(l) for l in lens["source_layers"]]
    return {l: j.float().clone() for l, j in zip(layers, lens["J"])}, layers  # clone: a view would pickle all of J


def run(
    client: LensClient, prompt: str | list[int], J: dict[int, torch.Tensor] | None, layers: list[int], k: int = 5
) -> dict[str, Any]:
    """Readout of every prompt position (text, or token ids) at `layers`, one request."""
    ids = client.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    r = client.generate(ids, max_tokens=1, temperature=0, hooks=[Hook(readout_hook(J, k), layers)])
    top, probs = readout_from_saved(r.hook_results["0"], layers, len(ids), k)
    return {
        "ids": ids,
        "layers": layers,
        "topk": top,
        "topk_probs": probs,
        "top": top[..., 0],
        "probs": probs[..., 0],
        "decode": lambda t: client.detokenize([int(t)]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="read out a prompt through the lens on a running server")
    r.add_argument("--lens", default=None, help="lens.pt from jacobian_lens_fit.py")
    r.add_argument("--baseline", action="store_true", help="plain logit lens (J = identity) instead")
    r.add_argument("--base-url", default="http://127.0.0.1:8000")
    r.add_argument("--api-key", default=None)
    r.add_argument("--prompt", default="The capital of France is")
    r.add_argument("--top-k", type=int, default=5)
    r.add_argument("--grid-out", default=None, help="write a (layer x position) PNG grid of top-1 tokens")
    args = ap.parse_args()
    if args.lens is None and not args.baseline:
        ap.error("run needs --lens (or --baseline for the plain logit lens)")
    client = LensClient(args.base_url, api_key=args.api_key)
    J, layers = load_lens(args.lens, client.info()["n_layers"], args.baseline)
    res = run(client, args.prompt, J, layers, args.top_k)
    res["title"] = "logit lens" if J is None else "Jacobian lens"
    print(f"{res['title']}, last position ({client.detokenize(res['ids'][-1:])!r}), top-{args.top_k}:")
    for row, layer in enumerate(layers):
        cells = "  ".join(
            f"{res['decode'](i)!r} {p:.2f}" for i, p in zip(res["topk"][row, -1], res["topk_probs"][row, -1])
        )
        print(f"layer {layer:2d}: {cells}")
    if args.grid_out:
        from logit_lens import plot

        plot(res, args.grid_out)
        print(f"wrote {args.grid_out}")


if __name__ == "__main__":
    main()
