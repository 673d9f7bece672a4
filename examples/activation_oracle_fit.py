"""Train a tiny activation oracle: a LoRA that answers "what topic did this activation come from?" about
an activation vector injected into its own forward pass (peft + HF transformers, on CPU).

    python examples/activation_oracle_fit.py                 # the shipped SmolLM2: ~10 min on 2 cores
    python examples/activation_oracle_fit.py --model DIR --steps 40 --out DIR   # any Llama-family model

`evals/activation_oracle.py` fits the same oracle by itself on first use (and caches it where this
script writes by default), so running this script first is optional; use it to refit, or to fit with
other settings. The fitting is `inspect_lens.oracle_fit.fit_oracle` (its docstring has the details):
templated sentences about 8 topics (`inspect_lens.oracle_data`; whole templates held out), each
sentence's residual stream after the source layer (the middle one by default) averaged over its tokens,
injected norm-matched at the placeholder of the oracle prompt after layer 1; LoRA rank 8 on every
projection, loss on the answer tokens only. Saved: a standard peft adapter folder plus `oracle.json`.
Printed: held-out accuracy with the real vector, with the vectors shuffled across samples, and with no
vector — the gap is the evidence that the oracle reads the activation rather than guessing.
"""

from __future__ import annotations

import argparse
import sys

from inspect_lens.oracle_data import PLACEHOLDER
from inspect_lens.oracle_fit import (
    BATCH,
    LR,
    RANK,
    SEED,
    STEPS,
    Injector,
    answer_logprobs,
    encode,
    fit_oracle,
    make_samples,
    source_vectors,
)

# the training pieces stay importable from this script (tests/inspect/test_oracle.py uses them)
__all__ = ["Injector", "answer_logprobs", "encode", "fit_oracle", "main", "make_samples", "source_vectors"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model folder (default: the shipped SmolLM2, converted)")
    ap.add_argument("--source-layer", type=int, default=None, help="default: the middle layer")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--rank", type=int, default=RANK)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--placeholder", default=PLACEHOLDER, help="where the vector goes (must be one token)")
    ap.add_argument("--out", default=None, help="adapter folder (default: under the user cache)")
    args = ap.parse_args()
    from tqdm.auto import tqdm

    try:
        meta = fit_oracle(
            args.model,
            args.out,
            source_layer=args.source_layer,
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            rank=args.rank,
            seed=args.seed,
            placeholder=args.placeholder,
            echo=lambda line: tqdm.write(line, file=sys.stdout),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    acc, n_topics = meta["held_out_accuracy"], len(meta["topics"])
    print(
        f"held-out accuracy ({meta['held_out_texts']} texts, {n_topics} topics, chance {1 / n_topics:.3f}): "
        + ", ".join(f"{k} vector {v:.3f}" for k, v in acc.items())
    )
    print(f"wrote {meta['path']}")


if __name__ == "__main__":
    main()
