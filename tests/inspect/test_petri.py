"""A full Petri audit (inspect-petri's `audit` task) against a real `vllm-lens serve` of the tiny model: a
scripted auditor (canned tool calls, no network, `compaction=False`) sets a system message, talks to the
target, rolls the conversation back and goes on; the task is evals/petri_audit.py (Petri's `audit` with
`inspect_lens.petri.lens_target` as the target and `lens_audit_scores`). Every
surviving turn's probe reading must equal a direct capture of the same tokens + the saved probe, the
rolled-back turn's readings must not leak into the surviving branch, and the oracle's answer must equal
asking the oracle directly about the same vector."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from support import ROOT, load_script
from support.servers import KEY

pytest.importorskip("inspect_petri")
LAYER = 2


def _turn(*calls):
    from inspect_ai.model import ChatMessageAssistant, ModelOutput
    from inspect_ai.tool import ToolCall

    tcs = [ToolCall(id=f"c{i}", function=f, arguments=a) for i, (f, a) in enumerate(calls)]
    return ModelOutput(
        model="mockllm/model",
        choices=[
            {
                "message": ChatMessageAssistant(content="", tool_calls=tcs, model="mockllm/model"),
                "stop_reason": "tool_calls",
            }
        ],
    )


def _scripted_auditor():
    from inspect_ai.model import get_model

    outs = [
        _turn(
            ("set_system_message", {"system_message": "You are a helpful assistant."}),
            ("send_message", {"message": "the water of people will come"}),
            ("resume", {}),
        ),
        _turn(("send_message", {"message": "what some we can out other"}), ("resume", {})),
        # back to the target's first answer (M3): turn 2 is gone, turn 1 is replayed, turn 3 is new
        _turn(
            ("rollback_conversation", {"message_id": "M3"}),
            ("send_message", {"message": "there when up use your how said"}),
            ("resume", {}),
        ),
        _turn(("end_conversation", {})),
    ]
    auditor = get_model("mockllm/model", custom_outputs=outs)

    async def count(text: str) -> int:  # mockllm counts with tiktoken, which downloads its tables
        return max(1, len(text) // 4)

    auditor.api.count_text_tokens = count
    return auditor


def test_petri_audit_with_a_reading_target(lora_server, tiny_oracle, tmp_path):  # noqa: F811
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import GenerateConfig, get_model

    from inspect_lens.oracle import ask_oracle, load_oracle
    from inspect_lens.petri import turn_readings
    from inspect_lens.probes import LinearProbe
    from support.servers import LORA_MODEL
    from vllm_worker.api.client import AsyncLensClient, LensClient

    rng = np.random.default_rng(0)
    probe = LinearProbe.fit(rng.normal(size=(64, 128)), np.r_[np.zeros(32), np.ones(32)], layer=LAYER)
    probe_file = probe.save(tmp_path / "probe.json")
    target = get_model(
        f"vllm-lens/{LORA_MODEL}",
        base_url=f"{lora_server}/v1",
        api_key=KEY,
        config=GenerateConfig(max_tokens=6, temperature=0),
    )

    # the eval users run (Petri's judge left out: no judge model here)
    petri_audit = load_script(ROOT / "evals" / "petri_audit.py").petri_audit
    task = petri_audit(
        probe=str(probe_file),
        oracle=str(tiny_oracle),
        oracle_question="Which topic?",
        max_turns=6,
        seed_instructions="Probe the target.",
        judge=False,
    )
    assert len(task.scorer) == 1  # lens_audit_scores only
    [log] = inspect_eval(
        task,
        model_roles={"auditor": _scripted_auditor(), "target": target},
        model=target,
        log_dir=str(tmp_path / "logs"),
        display="none",
    )
    assert log.status == "success", log.error and log.error.traceback
    sample = log.samples[0]
    tools = [(e.function, str(e.result)) for e in sample.events if e.event == "tool"]
    assert [f for f, _ in tools].count("resume") == 3 and (
        "rollback_conversation",
        "Rolled back to message_id M3.",
    ) in tools

    # the surviving branch: system, user 1, target turn 1 (replayed after the rollback), user 3, target turn 3
    roles = [m.role for m in sample.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"], roles
    assert sample.messages[3].text == "there when up use your how said"
    readings = turn_readings(sample.messages)
    assert len(readings) == 2 and all(r["layer"] == LAYER and r["probe"] == str(probe_file) for r in readings)
    # the target was called three times (turn 1, turn 2, turn 3): the replay of turn 1 made no call (the
    # other calls to the server are the oracle's: real and shuffled per turn)
    target_calls = [
        e
        for e in sample.events
        if e.event == "model" and LORA_MODEL in str(e.model) and e.input and e.input[0].role == "system"
    ]
    assert len(target_calls) == 3

    client = LensClient(lora_server, api_key=KEY)
    msgs = [{"role": m.role, "content": m.text} for m in sample.messages]
    meta = load_oracle(str(tiny_oracle))
    for i, reading in zip((2, 4), readings):
        prompt = client.tokenize_chat(msgs[:i])
        assert len(prompt) == reading["n_prompt"]
        gen = reading["token_ids"]
        assert len(gen) >= 2
        direct = client.generate(prompt + gen[:-1], max_tokens=1, temperature=0, capture_layers=[LAYER])
        rows = direct.activations["residual_stream"][0, len(prompt) : len(prompt) + len(gen) - 1]
        want = probe.score_tokens(rows.float().numpy())
        np.testing.assert_allclose(reading["token_scores"], np.round(want, 4), atol=2e-4)
        assert reading["score"] == pytest.approx(float(want.mean()), abs=1e-4)
        # the oracle was asked about the turn's mean activation at its source layer
        src = client.generate(prompt + gen[:-1], max_tokens=1, temperature=0, capture_layers=[meta["source_layer"]])
        vec = (
            src.activations["residual_stream"][0, len(prompt) : len(prompt) + len(gen) - 1]
            .float()
            .mean(0, keepdim=True)
        )

        async def ask(vec=vec):
            c = AsyncLensClient(lora_server, api_key=KEY, model=LORA_MODEL)
            try:
                return await ask_oracle(
                    target,
                    c,
                    meta,
                    vec,
                    question="Which topic?",
                    source_layer=meta["source_layer"],
                    placeholder=meta["placeholder"],
                    injection_layer=meta.get("injection_layer", 1),
                    controls=("shuffled",),
                )
            finally:
                await c.aclose()

        assert reading["oracle"]["answers"] == asyncio.run(ask())["answers"]
        assert set(reading["oracle"]["answers"]) == {"real", "shuffled"}

    # the scorer aggregates the surviving turns; no capture reached the log (the provider's call records keep
    # a shape summary of captures; the only tensors there are the oracle's 1 x 128 injected vectors)
    value = sample.scores["lens_audit_scores"].value
    assert value["max"] == pytest.approx(max(r["score"] for r in readings))
    assert value["mean"] == pytest.approx(np.mean([r["score"] for r in readings]))
    text = json.dumps(sample.model_dump(mode="json"))
    import re

    assert len(text) < 400_000, len(text)
    assert max(len(b) for b in re.findall(r'"b64": "([^"]*)"', text)) < 1000
    assert all("activations" not in (m.metadata or {}) for m in sample.messages)
