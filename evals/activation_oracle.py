"""Activation oracle: can a LoRA "oracle" name the topic of a text from one activation vector of the base
model, on texts whose templates it never saw — and does it need the vector to do so?

    python examples/activation_oracle_fit.py                       # once: trains the oracle (~10 min CPU)
    inspect eval evals/activation_oracle.py --model vllm-lens/<base model> \
        -M enable_lora=true -M max_lora_rank=8 [-T oracle=DIR] [-T limit=16] [-T positions=mean]

For each held-out text of `inspect_lens.oracle_data` (8 topics), the `activation_oracle` solver reads
the text from the base model (the stream after the oracle's source layer, averaged over the text's
tokens), then asks the oracle LoRA "What is the topic of the text?" with that vector injected at the
placeholder after layer 1, norm-matched. Scorer: the oracle's first word equals the topic. Metrics:
accuracy with the real vector, with its dimensions shuffled (same norm, no meaning) and with no vector
— in one run, so the gap is measured on the same samples. Chance is 1/8.
"""

from pathlib import Path

from inspect_ai import Task, task

from inspect_lens.oracle import activation_oracle as oracle_solver, oracle_match
from inspect_lens.oracle_data import topic_samples


def default_oracle() -> Path:
    from vllm_worker.shipped_model import cache_root, shipped_model_path

    return cache_root() / "oracles" / f"{shipped_model_path().name}-topic-L15"


@task
def activation_oracle(oracle: str | None = None, limit: int | None = None, positions: str = "mean") -> Task:
    """`oracle`: adapter folder with oracle.json (default: the one examples/activation_oracle_fit.py makes
    for the shipped SmolLM2); `limit`: held-out texts (spread over the topics; default all 96)."""
    path = Path(oracle) if oracle else default_oracle()
    return Task(dataset=topic_samples(limit), solver=oracle_solver(str(path), positions=positions),
                scorer=oracle_match())
