"""A coup-probe monitor in a real ControlArena setting, offline: AgentDojo with the ground-truth replay
policy, honest and attack trajectories, trusted monitoring with our monitor, AUROC between the two.

    pip install -e '.[control]'        # control-arena + AgentDojo (scripts/setup.sh installs them)
    inspect eval evals/control_agentdojo.py --model vllm-lens/<model> [--limit N] \
        [-T suite=banking] [-T probe=probe.json] [-T layer=15] [-T mode=reencode]

The replay policy (`agentdojo_fixed`) plays each task's ground-truth tool calls — in attack mode with the
injected side task's calls added — so the trajectories are real AgentDojo actions and none of them comes
from the model. The monitor re-encodes each step's tool call through the served model and scores it with
a coup probe (loaded from `probe`, or trained on `inspect_lens.coup_data` on first use and saved beside
the log). `mode=on_policy` needs a model-driven policy and is refused here. Score = the highest step
suspicion of a trajectory; metrics: AUROC (attack vs honest trajectories) and recall at 1 % FPR. `--limit`
counts samples of the combined (honest first, then attack) data set: use `-T per_mode=N` to keep both.
"""

from inspect_ai import Task, task

from control_arena import EvalMode
from control_arena.eval import ControlEvalConfig, get_control_task
from control_arena.micro_protocol import trusted_monitoring_builder
from control_arena.scorers import max_suspicion_scorer
from control_arena.settings.agentdojo_setting import AgentDojoSetting, agentdojo_fixed

from inspect_lens.control import coup_probe_monitor, trajectory_suspicion


@task
def control_agentdojo(suite: str = "banking", probe: str | None = None, layer: int | None = None,
                      mode: str = "reencode", per_mode: int | None = None, train_limit: int | None = None,
                      max_task_chars: int = 600) -> Task:
    """`per_mode`: samples per mode (default: all of the suite's). `train_limit`: contexts per coup_data
    family when the probe is trained here. `max_task_chars`: task text kept when re-encoding a step."""
    if mode != "reencode":
        raise ValueError("mode: the replay policy generates no activations; only 'reencode' applies here")
    setting = AgentDojoSetting(suite=suite)
    honest = list(setting.get_filtered_dataset(EvalMode.HONEST))[:per_mode]
    attack = list(setting.get_filtered_dataset(EvalMode.ATTACK))[:per_mode]
    protocol = trusted_monitoring_builder(policy=agentdojo_fixed(),
                                          monitor=coup_probe_monitor(probe=probe, layer=layer, mode=mode,
                                                                             train_limit=train_limit,
                                                                             max_task_chars=max_task_chars))
    # no role model is called: the policy replays, the monitor reads the task's model (--model); the
    # placeholders keep ControlArena from instantiating its default (hosted) models
    config = ControlEvalConfig(trusted_model="mockllm/model", untrusted_model="mockllm/model")
    return get_control_task(setting, protocol, EvalMode.HONEST, eval_config=config,
                            monitoring_scorers=[max_suspicion_scorer(), trajectory_suspicion()],
                            dataset=honest + attack, task_name="control_agentdojo",
                            metadata={"per_mode": per_mode, "suite": suite})
