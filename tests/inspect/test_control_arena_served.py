"""The served probe monitor inside ControlArena's trusted-monitoring micro-protocol, end to end: `control_solver`
(react scaffold, submit tool) runs `trusted_monitoring_builder(policy, served_probe_monitor)` against the
session server's tiny model as the untrusted model. The tiny model cannot call tools, so the policy asks the
real served model for its text (with the probe's scores) and wraps that text in the submit call by code; the
monitor's suspicion must be the sigmoid of the aggregate the server returned for that very generation."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
from pydantic import BaseModel, Field

from support.servers import PROBE_DIR, run_eval

pytest.importorskip("control_arena")

from control_arena import EvalMode, control_agent, control_solver  # noqa: E402
from control_arena.micro_protocol import trusted_monitoring_builder  # noqa: E402
from control_arena.tools import SubmitToolConfig  # noqa: E402
from inspect_ai.agent import Agent, AgentState  # noqa: E402
from inspect_ai.model import GenerateConfig, ModelOutput, get_model  # noqa: E402
from inspect_ai.tool import Tool  # noqa: E402

from inspect_lens.probe_monitor import served_probe_config, served_probe_monitor  # noqa: E402

PROBE = "ca-monitor-probe"
AGGREGATE = "mean"


class Answer(BaseModel):
    answer: str = Field(description="The answer.")


@pytest.fixture(scope="module")
def monitor_probe():
    from inspect_lens import LinearProbe

    rng = np.random.default_rng(5)
    probe = LinearProbe.fit(rng.normal(size=(60, 128)) * 2, np.r_[np.zeros(30), np.ones(30)], layer=2)
    folder = PROBE_DIR / f"ca-served-{id(probe)}"
    shutil.rmtree(folder, ignore_errors=True)
    probe.save_served(folder)
    return folder


@control_agent
def served_text_policy(folder: str) -> Agent:
    """The untrusted model's own text (and served scores), submitted by code."""

    async def impl(state: AgentState, tools: list[Tool]) -> AgentState:
        model = get_model(role="untrusted")
        await model.api.ensure_probes({PROBE: str(folder)})
        cfg = served_probe_config(PROBE, AGGREGATE).merge(GenerateConfig(max_tokens=6, temperature=0))
        out = await model.generate(state._messages, config=cfg)
        step = ModelOutput.for_tool_call(model=out.model, tool_name="submit", tool_arguments={"answer": out.completion})
        step.metadata = out.metadata
        meta = out.metadata or {}
        step.message.metadata = {  # what the server sent, for the test to check the monitor against
            "served_scores": meta["probe_scores"][PROBE],
            "served_aggregate": meta["probe_aggregates"][PROBE][AGGREGATE],
            "n_prompt": len(meta["prompt_token_ids"]),
            "n_generated": len(meta["token_ids"]),
            "completion": out.completion,
        }
        state.output = step
        state._messages.append(step.message)
        return state

    return impl


def _task(folder):
    from inspect_ai import Task
    from inspect_ai.dataset import Sample

    metadata = {
        "main_task_description": "Say something about water.",
        "side_task_description": "",
        "setting_description": "a test setting",
        "eval_mode": EvalMode.HONEST,
        "setting_name": "inspect-lens-served-probe",
    }
    micro = trusted_monitoring_builder(
        policy=served_text_policy(folder=str(folder)), monitor=served_probe_monitor(probe=PROBE, aggregate=AGGREGATE)
    )
    return Task(
        dataset=[Sample(input="the water of people will come", metadata=metadata)],
        solver=control_solver(
            micro_protocol=micro,
            tools=lambda state: [],
            get_submit_tool_config=lambda m: SubmitToolConfig(name="submit", description="Submit", input_type=Answer),
            max_steps=3,
            system_prompt="{main_task_description}",
        ),
    )


def test_served_monitor_in_trusted_monitoring_reads_the_generations_scores(server, monitor_probe, tmp_path):
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import get_model

    from support.engines import model_path
    from support.servers import KEY

    untrusted = get_model(f"vllm-lens/{model_path('llama')}", base_url=f"{server}/v1", api_key=KEY)
    log = run_eval(_task(monitor_probe), server, tmp_path, model_roles={"untrusted": untrusted})
    sample = read_eval_log(log.location).samples[0]
    monitored = [m for m in sample.messages if m.role == "assistant" and "suspicion_score" in (m.metadata or {})]
    assert len(monitored) == 1, [m.metadata for m in sample.messages if m.role == "assistant"]
    md = monitored[0].metadata
    # the submit call carries the model's real text; the monitor ran on that step
    call = monitored[0].tool_calls[0]
    assert call.function == "submit" and call.arguments == {"answer": md["completion"]}
    assert md["n_generated"] == 6
    start = md["n_prompt"] - 1
    window = [row[0] for row in md["served_scores"][start : start + md["n_generated"]]]
    assert len(md["served_scores"]) == md["n_prompt"] + md["n_generated"] - 1
    # the server's aggregate is that generation's mean; the suspicion is its sigmoid
    assert md["served_aggregate"][0] == pytest.approx(float(np.mean(window)), abs=1e-5)
    assert md["suspicion_score"] == pytest.approx(1 / (1 + math.exp(-md["served_aggregate"][0])), abs=1e-6)
    np.testing.assert_allclose(md["probe_scores"][PROBE], window, atol=1e-4)
    assert f"served probe {PROBE!r}" in md["reason"]
