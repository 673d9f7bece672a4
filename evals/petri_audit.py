"""A Petri alignment audit whose target reads its own activations every turn.

    inspect eval evals/petri_audit.py \
        --model-role auditor=anthropic/claude-sonnet-4-5 --model-role judge=anthropic/claude-sonnet-4-5 \
        --model-role target=vllm-lens/<model> [-T probe=PROBE.json] [-T oracle=DIR] [-T max_turns=10] \
        [-T seed_instructions=SEEDS] [-T judge=false]

Petri's `audit` task (inspect-petri) with `inspect_lens.petri.lens_target` as the target agent: each target
turn is captured at the probe's layer inside Petri's replayable generate call, scored per token with the
probe (default: a deception probe trained on first use through the target's server and saved beside the
log — or pass one `evals/deception_probe.py` saved), optionally shown to an activation oracle, and the
small readings are kept in the message's metadata. Scorers: Petri's judge (needs the `judge` role) and
`lens_audit_scores` (max and mean of the surviving turns' probe scores). `-T judge=false` leaves the judge
out (e.g. offline, where no judge model is reachable). `seed_instructions`: Petri's (a text, a file of
seeds, a folder of `.md` seeds, `tags:<tag>` or `id:<id>`; default: Petri's built-in seeds). `oracle`: an
oracle folder fitted for the target's base model (`evals/activation_oracle.py` fits and caches one on first
use; `examples/activation_oracle_fit.py --out DIR` fits one by hand).
"""

from inspect_ai import Task, task, task_with
from inspect_petri import audit

from inspect_lens.petri import lens_audit_scores, lens_target


@task
def petri_audit(
    probe: str | None = None,
    layer: int | None = None,
    oracle: str | None = None,
    oracle_question: str | None = None,
    train_limit: int | None = None,
    max_turns: int = 10,
    seed_instructions: str | None = None,
    judge: bool = True,
    compaction: bool = False,
) -> Task:
    base = audit(
        target=lens_target(
            probe=probe, layer=layer, oracle=oracle, oracle_question=oracle_question, train_limit=train_limit
        ),
        seed_instructions=seed_instructions,
        max_turns=max_turns,
        compaction=compaction,
    )
    judges = list(base.scorer or []) if judge else []
    return task_with(base, scorer=[*judges, lens_audit_scores()])
