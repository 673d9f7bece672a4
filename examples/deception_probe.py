"""Deception probe, standalone: contrastive activations through a persistent hook on a running server, a
logistic-regression probe in plain torch, AUROC on held-out role-play scenarios.

    vllm-lens serve MODEL --allow-remote-hooks      # the persistent hook runs on the server: opt in
    python examples/deception_probe.py --base-url http://127.0.0.1:8000 --layer 15

The data are inspect-lens's own (`inspect_lens.datasets`): training = true facts said under an honest
and under a lying instruction (the same answer text, so only the model's "intent" differs); evaluation
= role-play scenarios with an honest and a deceptive answer. Each conversation, answer included, is
sent once, teacher-forced (max_tokens=1), while one persistent hook saves the layer's stream at every
prompt position. The probe is a standardised, L2-regularised logistic regression in plain torch (LBFGS),
trained per token of each answer's detection window; a conversation's score is the mean of its
tokens' scores. The Inspect version of the
same experiment is `evals/deception_probe.py`.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import torch

from vllm_worker import Hook, LensClient

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def save_stream(ctx, h):
    """Persistent post-hook: this step's rows of the stream and their positions."""
    ctx.saved.setdefault("rows", []).append((ctx.positions.cpu(), h.float().cpu()))
    return None


def conversation(sample) -> tuple[list[dict], str, str]:
    """(messages before the answer, the answer, its detection window text) of an inspect-lens sample."""
    msgs = [{"role": m.role, "content": m.text} for m in sample.input]
    return msgs[:-1], msgs[-1]["content"], sample.metadata["detect_text"]


def teacher_forced(client: LensClient, sample) -> tuple[list[int], int]:
    """(prompt ids = chat template up to the assistant turn + the answer's tokens, window length)."""
    head, answer, detect = conversation(sample)
    ids = client.tokenize_chat(head)
    answer_ids = client.tokenize(answer, add_special_tokens=False)
    before = answer[: len(answer) - len(detect)].rstrip()
    window = len(answer_ids) - (len(client.tokenize(before, add_special_tokens=False)) if before else 0)
    return ids + answer_ids, max(window, 1)


def features(client: LensClient, samples: list, layer: int, workers: int = 8) -> list[torch.Tensor]:
    """Per sample, its stream at `layer` over its detection window, (window, d). One persistent hook on
    the server; requests sent concurrently; results matched to samples by request id."""
    client.clear_hooks()
    client.register_hooks([Hook(save_stream, [layer])])
    try:

        def send(sample) -> tuple[str, int, int]:
            ids, window = teacher_forced(client, sample)
            r = client.generate(ids, max_tokens=1, temperature=0)
            return r.raw["id"] + "-0", len(ids), window  # completion request ids carry the prompt index

        with ThreadPoolExecutor(workers) as pool:
            sent = list(pool.map(send, samples))
        results = client.collect_hook_results()
    finally:
        client.clear_hooks()
    feats = []
    for rid, n, window in sent:
        stream = torch.zeros(n, 0)
        for pos, rows in results[rid]["0"]["rows"]:
            if stream.shape[1] == 0:
                stream = torch.zeros(n, rows.shape[1])
            keep = pos < n
            stream[pos[keep]] = rows[keep]
        feats.append(stream[n - window :])
    return feats


def fit_probe(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-2, steps: int = 200) -> dict:
    """Logistic regression on standardised features: {"mean", "std", "w", "b"}."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y.float()) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return {"mean": mean, "std": std, "w": w.detach(), "b": b.detach()}


def score(probe: dict, x: torch.Tensor) -> torch.Tensor:
    return ((x - probe["mean"]) / probe["std"]) @ probe["w"] + probe["b"]


def fit_tokens(feats: list[torch.Tensor], labels: torch.Tensor, C: float = 1.0) -> dict:
    """The probe trained per token (every token of a window carries its sample's label); `C` as in
    scikit-learn (inverse L2 strength on the summed loss)."""
    x = torch.cat(feats)
    y = torch.cat([torch.full((len(f),), int(l)) for f, l in zip(feats, labels)])
    return fit_probe(x, y, l2=1 / (2 * C * len(x)))


def score_samples(probe: dict, feats: list[torch.Tensor]) -> torch.Tensor:
    """A sample's score: the mean of its tokens' scores over the detection window."""
    return torch.stack([score(probe, f).mean() for f in feats])


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(score of a positive > score of a negative), ties counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    ap.add_argument("--train-limit", type=int, default=None, help="facts to train on (2 samples each)")
    ap.add_argument("--eval-limit", type=int, default=None, help="role-play scenarios to score (2 samples each)")
    args = ap.parse_args()
    from inspect_lens.datasets import instructed_pairs, roleplay

    client = LensClient(args.base_url, api_key=args.api_key)
    layer = client.info()["n_layers"] // 2 if args.layer is None else args.layer
    train, test = instructed_pairs(args.train_limit), roleplay(limit=args.eval_limit)
    label = lambda samples: torch.tensor([int(s.metadata["label"] == "deceptive") for s in samples])  # noqa: E731
    x_train, x_test = features(client, train, layer), features(client, test, layer)
    probe = fit_tokens(x_train, label(train))
    print(f"layer {layer}: {len(train)} training samples, {len(test)} role-play samples")
    print(f"train AUROC {auroc(score_samples(probe, x_train), label(train)):.3f}")
    print(f"role-play AUROC {auroc(score_samples(probe, x_test), label(test)):.3f}")


if __name__ == "__main__":
    main()
