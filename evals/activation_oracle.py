"""Activation oracle: can a LoRA "oracle" name the topic of a text from one activation vector of the base
model, on texts whose templates it never saw — and does it need the vector to do so?

    inspect eval evals/activation_oracle.py --model vllm-lens/<base model> [--limit 16] [-T oracle=DIR] \
        [-T positions=mean] [-T base=DIR] [-T source_layer=15] [-T steps=150] [-T "placeholder=' ?'"]

The server the provider starts for this task has LoRA enabled (rank from the oracle's adapter_config.json):
no `-M` flags needed. A server you started yourself (`--model-base-url`) needs `--enable-lora
--max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`. The texts are ordered with the topics
interleaved, so `--limit N` evaluates N texts spread evenly over min(N, 8) topics.

The oracle is fitted on first use: when `oracle` (default: `<user cache>/inspect-lens/oracles/<base
model folder>-topic-L<source layer>`) holds no `oracle.json` yet, one is fitted there on the base model
before the task runs (`inspect_lens.oracle_fit`: peft + HF transformers on CPU, ~10 min for the shipped
SmolLM2 on 2 cores, with a progress bar) and reused by every later run. The base model is the one
evaluated — `<base model>` itself when it is a folder, else the folder the server reports for it
(`--model-base-url` to a `vllm-lens serve DIR --served-model-name NAME`); `-T base=DIR` overrides that.
`source_layer` (default: the middle layer), `steps` and `placeholder` (one token; YAML-quote a leading
space, as above) only matter when the oracle is fitted. `examples/activation_oracle_fit.py` fits one by
hand (to refit, or with other settings).

For each held-out text of `inspect_lens.oracle_data` (8 topics), the `activation_oracle` solver reads
the text from the base model (the stream after the oracle's source layer, averaged over the text's
tokens), then asks the oracle LoRA "What is the topic of the text?" with that vector injected at the
placeholder after layer 1, norm-matched. Scorer: the oracle's first word equals the topic. Metrics:
accuracy with the real vector, with its dimensions shuffled (same norm, no meaning) and with no vector
— in one run, so the gap is measured on the same samples. Chance is 1/8.
"""

import json
from pathlib import Path

from inspect_ai import Task, task

from inspect_lens.oracle import activation_oracle as oracle_solver
from inspect_lens.oracle import oracle_match
from inspect_lens.oracle_data import topic_samples


def default_oracle(base: str | Path | None = None, source_layer: int | None = None) -> Path:
    """Where the oracle for `base` (default: the shipped SmolLM2) reading `source_layer` (default: the
    middle one) is cached: `<user cache>/inspect-lens/oracles/<base folder name>-topic-L<layer>`."""
    from inspect_lens.oracle_fit import default_oracle_dir
    from vllm_worker.shipped_model import shipped_model_path

    return default_oracle_dir(base or shipped_model_path(), source_layer)


@task
def activation_oracle(
    oracle: str | None = None,
    positions: str = "mean",
    base: str | None = None,
    source_layer: int | None = None,
    steps: int | None = None,
    placeholder: str | None = None,
) -> Task:
    """`oracle`: adapter folder with oracle.json (default: the cached one for the evaluated model; fitted
    there on first use, as is a given folder that does not exist yet). All 96 held-out texts, topics
    interleaved (`--limit N`: the first N, spread over the topics). When fitting: `base` (the base model
    folder; default: the model evaluated), `source_layer` (default: the middle one), `steps` (default 150), `placeholder` (default
    " ?"; must be one token)."""
    if placeholder is not None and not isinstance(placeholder, str):
        raise ValueError(
            f"placeholder: expected a string, got {placeholder!r} (on the command line, YAML-quote "
            "it: -T \"placeholder=' ?'\")"
        )
    path = Path(oracle).expanduser() if oracle else None
    if path is None or not (path / "oracle.json").exists():
        from inspect_lens.oracle_fit import ensure_oracle, evaluated_base_model

        model_dir = base or evaluated_base_model()
        if model_dir is None:
            raise ValueError(
                f"activation_oracle: no fitted oracle {'at ' + str(path) if path else 'given'}, and the "
                "base model to fit one on is unknown (no vllm-lens/<folder> model is being evaluated, nor a "
                "server that names its folder): pass -T base=<base model folder> or -T oracle=<fitted oracle "
                "folder>"
            )
        path = path or default_oracle(model_dir, source_layer)
        ensure_oracle(path, model_dir, source_layer=source_layer, steps=steps, placeholder=placeholder)
    meta = json.loads((path / "oracle.json").read_text())
    if source_layer is not None and source_layer != meta["source_layer"]:
        raise ValueError(
            f"source_layer: {source_layer} given, but the oracle at {path} reads layer "
            f"{meta['source_layer']} (give another oracle folder, or leave source_layer out)"
        )
    return Task(
        dataset=topic_samples(),
        solver=oracle_solver(str(path), positions=positions),
        scorer=oracle_match(),
        metadata={"oracle": str(path), "oracle_base_model": meta.get("base_model")},
    )
