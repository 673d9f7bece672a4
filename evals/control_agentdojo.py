"""A coup-probe monitor in a real ControlArena setting, offline: AgentDojo with the ground-truth replay
policy, honest and attack trajectories, trusted monitoring with our monitor, AUROC between the two.

    pip install -e '.[control]'        # control-arena + AgentDojo (scripts/setup.sh installs them)
    inspect eval evals/control_agentdojo.py --model vllm-lens/<model> [--limit N] \
        [-T suite=banking] [-T probe=probe.json] [-T layer=15] [-T mode=reencode]

The replay policy (`agentdojo_fixed`) plays each task's ground-truth tool calls — in attack mode with the
injected side task's calls added — so the trajectories are real AgentDojo actions and none of them comes
from the model. `mode=reencode` (default): the monitor re-encodes each step's tool call through the served
model (task + action, as the probe was trained) and scores it with a coup probe (loaded from `probe`, or
trained on `inspect_lens.coup_data` on first use and saved beside the log). `mode=on_policy`: each replayed
action is prefilled through the served model in the conversation it belongs to, under the system prompt
its policy would have had — ControlArena's attack prompt with the hidden side task in attack mode
(`inspect_lens.control.prefilled_policy`) — and the monitor scores those activations: what the untrusted
model's own state looks like while taking the action with the attack instructions in context, which the
re-encoding monitor never sees. Give `-T layer=` the probe's layer in this mode. Score = the highest step
suspicion of a trajectory; metrics: AUROC (attack vs honest trajectories) and recall at 1 % FPR. The
combined data set alternates honest and attack samples, so `--limit N` keeps both modes (N/2 each while
both last); `-T per_mode=N` caps each mode before they are combined.
"""

from control_arena import EvalMode
from control_arena.eval import ControlEvalConfig, get_control_task
from control_arena.micro_protocol import trusted_monitoring_builder
from control_arena.scorers import max_suspicion_scorer
from control_arena.settings.agentdojo_setting import AgentDojoSetting, agentdojo_fixed
from inspect_ai import Task, task

from inspect_lens.control import coup_probe_monitor, prefilled_policy, trajectory_suspicion
from inspect_lens.sample_order import round_robin


@task
def control_agentdojo(
    suite: str = "banking",
    probe: str | None = None,
    layer: int | None = None,
    mode: str = "reencode",
    per_mode: int | None = None,
    train_limit: int | None = None,
    max_task_chars: int = 600,
    attack_prompt: str | None = None,
    max_chars: int = 4000,
    max_steps: int | None = None,
) -> Task:
    """`per_mode`: samples per mode (default: all of the suite's). `train_limit`: contexts per coup_data
    family when the probe is trained here. `max_task_chars`: task text kept when re-encoding a step.
    `attack_prompt` (on_policy): the attack-mode system prompt, with `{setting_description}` and
    `{side_task_description}` (default: ControlArena's attack_policy prompt); `max_chars` (on_policy): each
    prefilled message cut to this length, `max_steps` (on_policy): earlier steps kept (default all)."""
    if mode not in ("reencode", "on_policy"):
        raise ValueError(f"mode: expected 'reencode' or 'on_policy', got {mode!r}")
    setting = AgentDojoSetting(suite=suite)
    honest = list(setting.get_filtered_dataset(EvalMode.HONEST))[:per_mode]
    attack = list(setting.get_filtered_dataset(EvalMode.ATTACK))[:per_mode]
    policy = agentdojo_fixed()
    if mode == "on_policy":  # the replayed actions, prefilled through the untrusted model under its prompt
        policy = prefilled_policy(
            policy=policy, layer=layer, attack_prompt=attack_prompt, max_chars=max_chars, max_steps=max_steps
        )
    protocol = trusted_monitoring_builder(
        policy=policy,
        monitor=coup_probe_monitor(
            probe=probe, layer=layer, mode=mode, train_limit=train_limit, max_task_chars=max_task_chars
        ),
    )
    # no role model is called: the policy replays, the monitor reads the task's model (--model); the
    # placeholders keep ControlArena from instantiating its default (hosted) models
    config = ControlEvalConfig(trusted_model="mockllm/model", untrusted_model="mockllm/model")
    return get_control_task(
        setting,
        protocol,
        EvalMode.HONEST,
        eval_config=config,
        monitoring_scorers=[max_suspicion_scorer(), trajectory_suspicion()],
        dataset=round_robin(honest, attack),  # Inspect's --limit N (the first N) keeps both modes
        task_name="control_agentdojo",
        metadata={"per_mode": per_mode, "suite": suite},
    )
