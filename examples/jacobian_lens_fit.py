"""Fit a Jacobian lens: J_l = E[dh_final / dh_l] for chosen layers, with HF transformers on CPU.

    python examples/jacobian_lens_fit.py --model ~/.cache/inspect-lens/smollm2-135m-instruct-0.1.2-f32 \\
        --out lens.pt                                   # default: the shipped SmolLM2, every layer
    python examples/jacobian_lens.py run --lens lens.pt --prompt "The capital of France is"

The logit lens reads layer l's residual stream h_l as if it were the final one. The Jacobian lens first
moves it to where the last layer would have put it: h_final ~ J_l h_l, with J_l the average Jacobian of
the final stream (before the final norm) with respect to h_l at the same position, over a small text
corpus. Each sample is one prefix of a corpus text and its last position (cut at random lengths, so
no later token leaks into the average); the Jacobian rows come from batched backward passes through a
zero "delta" added to h_l at that position, one token deep: the prefix runs once without gradients and
fills the KV cache (d / 64 vmapped passes per prefix length). SmolLM2-135M, every layer, the built-in
corpus (64 samples): about 3 minutes on 2 CPU cores. Saves `{"J": (n_layers, d, d), "source_layers", "d_model",
"n_samples", "model"}`. Llama-family decoder layers (`model.layers`).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

CORPUS = [
    "The capital of France is Paris, a city known for its museums and cafes.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
    "She opened the door slowly and saw that the room was completely empty.",
    "In 1969 two astronauts walked on the surface of the Moon for the first time.",
    "The recipe needs two cups of flour, three eggs and a spoonful of sugar.",
    "Python lists are mutable, while tuples cannot be changed after they are created.",
    "The river flooded the valley after a week of heavy rain in the mountains.",
    "He was angry that the train was late again, and he missed his meeting.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The orchestra played a quiet piece by Debussy before the interval.",
    "Our quarterly revenue grew by twelve percent compared with last year.",
    "The cat slept on the warm windowsill all afternoon.",
    "To reset the router, hold the small button on the back for ten seconds.",
    "The treaty ended a war that had lasted for almost thirty years.",
    "My grandmother taught me how to knit when I was seven years old.",
    "Light travels faster than sound, which is why we see lightning first.",
    "The committee will vote on the new budget next Tuesday morning.",
    "A triangle with three equal sides is called an equilateral triangle.",
    "The detective found a muddy footprint near the broken window.",
    "Bees communicate the location of flowers with a kind of dance.",
    "I am so happy that you could come to my birthday party!",
    "The stock market fell sharply after the announcement on interest rates.",
    "Mount Everest is the highest mountain above sea level on Earth.",
    "The children built a sandcastle and watched the tide wash it away.",
    "Please remember to submit your report before the end of the week.",
    "The violinist tuned her instrument while the audience took their seats.",
    "Antibiotics do not work against viruses such as the common cold.",
    "The old lighthouse has guided ships along this coast for two centuries.",
    "He whispered that he was afraid of the dark corridor ahead.",
    "The function returns the sum of all even numbers in the list.",
    "Tokyo, the capital of Japan, is one of the largest cities in the world.",
    "After the storm, a bright rainbow appeared over the hills.",
]


def decoder_layers(model) -> list[torch.nn.Module]:
    return list(model.model.layers)


def fit(
    model,
    tokenizer,
    texts: list[str],
    layers: list[int],
    samples_per_text: int = 2,
    min_len: int = 3,
    seed: int = 0,
    rows_per_pass: int = 64,
) -> tuple[torch.Tensor, int]:
    """(J (len(layers), d, d) averaged over samples, number of samples)."""
    rng = random.Random(seed)
    blocks = decoder_layers(model)
    d = model.config.hidden_size
    by_len: dict[int, list[list[int]]] = {}  # prefixes of corpus texts, read at their last position
    for text in texts:
        ids = tokenizer.encode(text)
        if len(ids) < min_len:
            continue
        for cut in rng.sample(range(min_len, len(ids) + 1), min(samples_per_text, len(ids) + 1 - min_len)):
            by_len.setdefault(cut, []).append(ids[:cut])
    J = torch.zeros(len(layers), d, d, dtype=torch.float64)
    n = 0
    eye = torch.eye(d)
    for length, batch in sorted(by_len.items()):
        x = torch.tensor(batch)
        # the prefix without gradients (its keys/values do not depend on the last position); only the
        # last token runs with autograd, so each backward pass is one token deep per sample
        with torch.no_grad():
            cache = model(x[:, :-1], use_cache=True).past_key_values
        deltas = {l: torch.zeros(len(batch), 1, d, requires_grad=True) for l in layers}
        final: list[torch.Tensor] = []

        def hook(mod, args, out, l):
            h = out[0] if isinstance(out, tuple) else out
            if l in deltas:  # a zero added to the last position's stream: its gradient is dh_final/dh_l
                h = h + deltas[l]
            if l == len(blocks) - 1:
                final.append(h)
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h

        handles = [b.register_forward_hook(lambda m, a, o, l=i: hook(m, a, o, l)) for i, b in enumerate(blocks)]
        try:
            model(x[:, -1:], past_key_values=cache, use_cache=True)
        finally:
            for h in handles:
                h.remove()
        y = final[0][:, -1]  # (B, d): the final stream (pre-norm) at the last position
        inputs = [deltas[l] for l in layers]
        for start in range(0, d, rows_per_pass):
            rows = eye[start : start + rows_per_pass]  # (R, d): one output coordinate per backward pass
            grads = torch.autograd.grad(
                y,
                inputs,
                grad_outputs=rows.unsqueeze(1).expand(-1, len(batch), -1),
                retain_graph=True,
                is_grads_batched=True,
            )
            for k, g in enumerate(grads):  # g: (R, B, 1, d) = rows start.. of each sample's Jacobian
                J[k, start : start + rows.shape[0]] += g[:, :, 0].sum(1).double()
        n += len(batch)
    return (J / max(n, 1)).float(), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the shipped SmolLM2, converted)")
    ap.add_argument("--corpus", default=None, help="a text file, one text per line (default: a built-in set)")
    ap.add_argument("--layers", default=None, help="source layers, e.g. 0,5,10 (default: every layer)")
    ap.add_argument("--samples-per-text", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="lens.pt")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        from vllm_worker.shipped_model import shipped_model_path

        args.model = str(shipped_model_path())
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = CORPUS if args.corpus is None else [t for t in Path(args.corpus).read_text().splitlines() if t.strip()]
    n_layers = model.config.num_hidden_layers
    layers = list(range(n_layers)) if args.layers is None else [int(x) for x in args.layers.split(",")]
    J, n = fit(model, tokenizer, texts, layers, args.samples_per_text, seed=args.seed)
    torch.save(
        {"J": J, "source_layers": layers, "d_model": model.config.hidden_size, "n_samples": n, "model": args.model},
        args.out,
    )
    eye = torch.eye(J.shape[1])
    for l, j in zip(layers, J):
        print(f"layer {l:2d}: |J - I|_F / |I|_F = {float((j - eye).norm() / eye.norm()):.3f}")
    print(f"fitted on {n} samples; wrote {args.out}")


if __name__ == "__main__":
    main()
