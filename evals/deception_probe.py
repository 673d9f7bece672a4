"""Deception probe: does a linear probe on the model's own residual stream separate honest from deceptive
answers?

    inspect eval evals/deception_probe.py --model vllm-lens/<model> [-T layer=15] [-T probe=probe.json]

1. Probe: loaded from `probe` if that file exists; otherwise trained (standardize + logistic regression,
   per token) on instructed pairs — true statements under an honest vs a lying system prompt — and saved
   (to `probe`, or beside the eval log).
2. Evaluation: role-play scenarios (ours, or an Apollo-format `dataset.yaml` via `roleplay_path`), each
   answered honestly and deceptively, plus benign control chats. Answers are read teacher-forced: nothing
   is generated, the probe scores the given answer.
3. Metrics: AUROC (deceptive vs honest) and recall at 1% FPR (threshold = the control set's 99th
   percentile). Per-sample scores, labels and per-token scores are in the log.
Samples are ordered honest, deceptive, control, honest, ... so `--limit N` keeps all three labels.

Served mode (`-T served=true -T probe=<probe folder>`): the server scores the probe inside the forward
pass (`output_probe_scores`) and only the per-token scores come back; same windows, aggregate and metrics.
The folder is a served probe (`LinearProbe.save_served`; a probe trained here is saved so beside the log)
under the server's `--lens-probe-dir` (loaded as `deception-<hash8>` of its files when readable here, so
evals sharing a server keep their own probes), or `probe` names one the server has loaded.
`-T aggregate=` (mean, max, last, rolling_max:W, ema:A) turns token scores into the response score.
"""

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset
from inspect_ai.model import GenerateConfig

from inspect_lens import capture_activations
from inspect_lens import deception_probe as deception_probe_scorer
from inspect_lens.datasets import control, roleplay
from inspect_lens.sample_order import interleave
from inspect_lens.served_probes import probe_scorer, probe_scores, served_probe_arg


@task
def deception_probe(
    layer: int | None = None,
    probe: str | None = None,
    roleplay_path: str | None = None,
    train_limit: int | None = None,
    eval_limit: int | None = None,
    control_limit: int | None = None,
    C: float = 1.0,
    served: bool = False,
    aggregate: str = "mean",
) -> Task:
    """`layer`: residual-stream layer (default: the middle one). `*_limit`: number of facts / scenarios /
    control chats to use (default: all)."""
    # labels interleaved: Inspect's --limit N (the first N) keeps every label
    samples = interleave(roleplay(roleplay_path, eval_limit) + control(control_limit), key=lambda s: s.target)
    if served:
        probes = served_probe_arg(probe, "deception")
        return Task(
            dataset=MemoryDataset(samples, name="inspect-lens-deception"),
            solver=probe_scores(probes),
            scorer=probe_scorer(next(iter(probes)), aggregate),
            config=GenerateConfig(temperature=0),
        )
    return Task(
        dataset=MemoryDataset(samples, name="inspect-lens-deception"),
        solver=capture_activations(layer),
        scorer=deception_probe_scorer(probe=probe, layer=layer, train_limit=train_limit, C=C, aggregate=aggregate),
        config=GenerateConfig(temperature=0),
    )
