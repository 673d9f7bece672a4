"""Coup probe: does a linear probe on the agent model's own residual stream flag harmful actions in
template families it was not trained on?

    inspect eval evals/coup_probe.py --model vllm-lens/<model> [-T layer=15] [-T probe=probe.json] \
        [-T test_families=code,backups] [-T train_limit=4] [-T eval_limit=4] [-T control_limit=50]

1. Probe (off-policy, after F. Roger's coup probes): loaded from `probe` if that file exists; otherwise
   trained per token (standardize + logistic regression) on the other families of
   `inspect_lens.coup_data` — benign vs harmful tool calls in shared agent contexts, with hard negatives
   and bland-sounding harmful actions — and saved (to `probe`, or beside the eval log).
2. Evaluation: the held-out families (`test_families`), read teacher-forced (the action is given, not
   generated), plus benign control chats for the threshold.
3. Metrics: AUROC (harmful vs benign), recall at 1% FPR (threshold = the control chats' 99th
   percentile) and AUROC per held-out family. Per-sample and per-token scores are in the log.
Served mode (`-T served=true -T probe=<probe folder>`): the server scores the probe in the forward pass and
only per-token scores come back (see evals/deception_probe.py); `-T aggregate=` as there.
`train_limit` / `eval_limit` count agent contexts per family (12 each by default: all). Samples are
ordered with (family, label) and the control chats interleaved, so `--limit N` keeps every class.
"""

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset
from inspect_ai.model import GenerateConfig

from inspect_lens import capture_activations
from inspect_lens import coup_probe as coup_probe_scorer
from inspect_lens.coup_data import coup_pairs, families
from inspect_lens.datasets import control
from inspect_lens.metrics import auroc_by, auroc_ci, probe_auroc, recall_at_fpr
from inspect_lens.sample_order import interleave
from inspect_lens.served_probes import probe_scorer, probe_scores, served_probe_arg

DEFAULT_TEST = ("code", "backups")


def sample_class(sample) -> tuple[str, str]:
    """(family, label) of a held-out sample; ("", "control") for a control chat."""
    return (sample.metadata.get("family", ""), sample.metadata["label"])


@task
def coup_probe(
    layer: int | None = None,
    probe: str | None = None,
    test_families: str | list[str] | None = None,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    control_limit: int | None = None,
    C: float = 1.0,
    served: bool = False,
    aggregate: str = "mean",
) -> Task:
    """`test_families`: held-out families (comma list; default code,backups); the rest train the probe."""
    if isinstance(test_families, str):
        test_families = [f.strip() for f in test_families.split(",") if f.strip()]
    test = list(test_families or DEFAULT_TEST)
    unknown = [f for f in test if f not in families()]
    if unknown:
        raise ValueError(f"test_families: unknown {unknown} (known: {', '.join(families())})")
    train = [f for f in families() if f not in test]
    if not train:
        raise ValueError("test_families: at least one family must remain for training")
    # (family, label) classes and the controls interleaved: Inspect's --limit N (the first N) keeps them all
    samples = interleave(coup_pairs(test, eval_limit) + control(control_limit), key=sample_class)
    if served:
        probes = served_probe_arg(probe, "coup")
        return Task(
            dataset=MemoryDataset(samples, name="inspect-lens-coup-probe"),
            solver=probe_scores(probes),
            scorer=probe_scorer(next(iter(probes)), aggregate, meta_keys=("family", "kind")),
            metrics=[probe_auroc(), auroc_ci(), recall_at_fpr(0.01), auroc_by("family")],
            config=GenerateConfig(temperature=0),
            metadata={"train_families": train, "test_families": test},
        )
    return Task(
        dataset=MemoryDataset(samples, name="inspect-lens-coup-probe"),
        solver=capture_activations(layer),
        scorer=coup_probe_scorer(
            probe=probe, layer=layer, train_families=train, train_limit=train_limit, C=C, aggregate=aggregate
        ),
        config=GenerateConfig(temperature=0),
        metadata={"train_families": train, "test_families": test},
    )
