"""Causal tracing (ROME-style) against a running server: which (layer, token) states carry a fact?

    vllm-lens serve MODEL --allow-remote-hooks      # hooks run on the server: the operator opts in
    python examples/causal_tracing.py --base-url http://127.0.0.1:8000 \\
        --prompt "The Eiffel Tower is located in the city of" --subject "The Eiffel Tower" --out trace.png

Three kinds of run, every one a normal request in vLLM's batch (the grid is sent as concurrent
requests): clean (captures every layer's residual stream); corrupted (a layer-0 pre-hook adds seeded
Gaussian noise, 3x the embedding std by default, to the subject's token embeddings); and corrupted with
one (layer, token) state restored to its clean value by a post-hook. A post-hook on the last layer reads
p(answer) from the final norm and the unembedding (`ctx.get_parameter`). Output: a (layer x token)
heatmap PNG of p(answer) with the restored state, beside p(clean) and p(corrupted). For Llama-family
models (final RMSNorm at `model.norm`).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle
import torch

from vllm_worker import Hook, LensClient

# the hooks below travel to the server by value (the server cannot import this file)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def subject_noise(n: int, d: int, seed: int, scale: float) -> torch.Tensor:
    """The corruption: seeded N(0, scale^2) noise for the subject's `n` token embeddings."""
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * scale


def corrupt_hook(span: tuple[int, int], noise: torch.Tensor, scale_from_embeddings: float | None):
    """Layer-0 pre-hook: add `noise` (or noise of unit scale times `scale_from_embeddings` x the
    embedding matrix's std) to the rows at positions span[0]..span[1]-1."""

    def corrupt(ctx, h):
        pos = ctx.positions
        rows = ((pos >= span[0]) & (pos < span[1])).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        z = noise.to(h.device, torch.float32)
        if scale_from_embeddings is not None:
            z = z * (scale_from_embeddings * ctx.get_parameter("model.embed_tokens.weight").float().std())
        h = h.clone()
        h[rows] += z[pos[rows] - span[0]].to(h.dtype)
        return h

    return corrupt


def restore_hook(position: int, clean: torch.Tensor):
    """Post-hook at one layer: the stream at `position` becomes its clean value."""

    def restore(ctx, h):
        rows = (ctx.positions == position).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        h = h.clone()
        h[rows] = clean.to(h.device, h.dtype)
        return h

    return restore


def answer_prob_hook(last_position: int, answer: int):
    """Post-hook at the last layer: p(answer) at the last prompt position (final RMSNorm + unembedding)."""

    def answer_prob(ctx, h):
        rows = (ctx.positions == last_position).nonzero().squeeze(1)
        if rows.numel() == 0:
            return None
        norm = ctx.model.model.norm
        x = h[rows[-1]].float()
        x = x * torch.rsqrt(x.pow(2).mean() + getattr(norm, "variance_epsilon", 1e-5))
        x = x * ctx.get_parameter("model.norm.weight").float()
        probs = (x @ ctx.get_parameter("lm_head.weight").float().T).softmax(-1)
        ctx.saved["p"] = float(probs[answer])
        ctx.saved["top"] = int(probs.argmax())
        return None

    return answer_prob


def subject_span(client: LensClient, prompt_ids: list[int], subject: str) -> tuple[int, int]:
    """Token positions of `subject` inside the prompt (its tokens, as the server's tokenizer makes them)."""
    for variant in (subject, " " + subject):
        sub = client.tokenize(variant, add_special_tokens=False)
        for i in range(len(prompt_ids) - len(sub) + 1):
            if prompt_ids[i : i + len(sub)] == sub:
                return i, i + len(sub)
    raise ValueError(f"subject {subject!r} not found in the prompt's tokens")


def trace(
    client: LensClient,
    prompt_ids: list[int],
    span: tuple[int, int],
    noise: torch.Tensor,
    answer: int | None = None,
    scale_from_embeddings: float | None = None,
    layers: list[int] | None = None,
    positions: list[int] | None = None,
    workers: int = 16,
) -> dict[str, Any]:
    """The whole experiment. `noise`: (span length, d), used as is, or (unit noise) scaled by
    `scale_from_embeddings` x std of the embedding matrix. Returns grid (layers x positions) of p(answer)."""
    info = client.info()
    n_layers, last = info["n_layers"], len(prompt_ids) - 1
    all_layers = list(range(n_layers))

    def run(hooks: list[Hook], capture: bool = False):
        return client.generate(
            prompt_ids, max_tokens=1, temperature=0, hooks=hooks, capture_layers=all_layers if capture else None
        )

    probe_answer = answer if answer is not None else 0
    clean = run([Hook(answer_prob_hook(last, probe_answer), [n_layers - 1])], capture=True)
    if answer is None:  # the model's own top answer on the clean prompt
        answer = clean.hook_results["0"]["top"]
        clean = run([Hook(answer_prob_hook(last, answer), [n_layers - 1])], capture=True)
    streams = clean.activations["residual_stream"]  # (n_layers, n_pos, d)
    corrupt = Hook(corrupt_hook(span, noise, scale_from_embeddings), [0], pre=True)
    prob = Hook(answer_prob_hook(last, answer), [n_layers - 1])
    p_corrupt = run([corrupt, prob]).hook_results["1"]["p"]
    layers = all_layers if layers is None else layers
    positions = list(range(len(prompt_ids))) if positions is None else positions
    cells = [(l, t) for l in layers for t in positions]

    def cell(lt: tuple[int, int]) -> float:
        l, t = lt
        res = run([corrupt, Hook(restore_hook(t, streams[l, t]), [l]), prob])
        return res.hook_results["2"]["p"]

    with ThreadPoolExecutor(workers) as pool:
        values = list(pool.map(cell, cells))
    grid = torch.tensor(values).view(len(layers), len(positions))
    return {
        "grid": grid,
        "layers": layers,
        "positions": positions,
        "answer": answer,
        "p_clean": clean.hook_results["0"]["p"],
        "p_corrupt": p_corrupt,
    }


def plot(result: dict[str, Any], labels: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = result["grid"].numpy()
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * grid.shape[0] + 2), max(4, 0.35 * grid.shape[1] + 1.5)))
    im = ax.imshow(grid.T, aspect="auto", cmap="Purples", vmin=0)
    ax.set_yticks(range(len(result["positions"])), [labels[t] for t in result["positions"]])
    ax.set_xticks(range(len(result["layers"])), result["layers"])
    ax.set_xlabel("layer of the restored state")
    ax.set_title(f"{title}\np(clean) = {result['p_clean']:.3f}, p(corrupted) = {result['p_corrupt']:.3f}", fontsize=9)
    fig.colorbar(im, ax=ax, label="p(answer) with the state restored")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompt", default="The Eiffel Tower is located in the city of")
    ap.add_argument("--subject", default="The Eiffel Tower")
    ap.add_argument("--noise", type=float, default=3.0, help="noise std, in units of the embeddings' std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="causal_trace.png")
    args = ap.parse_args()
    client = LensClient(args.base_url, api_key=args.api_key)
    ids = client.tokenize(args.prompt)
    span = subject_span(client, ids, args.subject)
    d = client.info()["d_model"]
    result = trace(
        client, ids, span, subject_noise(span[1] - span[0], d, args.seed, 1.0), scale_from_embeddings=args.noise
    )
    labels = [client.detokenize([t]) + ("*" if span[0] <= i < span[1] else "") for i, t in enumerate(ids)]
    answer = client.detokenize([result["answer"]])
    plot(result, labels, args.out, f"causal trace of {answer!r} ({'*'}: corrupted subject tokens)")
    best = divmod(int(result["grid"].argmax()), len(result["positions"]))
    print(
        f"answer {answer!r}: p(clean) {result['p_clean']:.3f}, p(corrupted) {result['p_corrupt']:.3f}, "
        f"best restoration {result['grid'].max():.3f} at layer {result['layers'][best[0]]}, "
        f"token {labels[result['positions'][best[1]]]!r}"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
