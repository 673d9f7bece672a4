"""`steer()` with an op through Inspect: the log names the vector and its op, the samples equal offline."""

from __future__ import annotations

import re
import zipfile

import torch
from vllm import SamplingParams

from support.servers import run_eval
from vllm_worker import SteeringVector


def test_steer_solver_with_an_op(server, llama, tmp_path):
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig

    from inspect_lens import steer
    from inspect_lens.steering import content_name

    d = torch.randn(2, 128, generator=torch.Generator().manual_seed(31))
    vec = SteeringVector(d, [1, 2], op="cap", hi=-0.5, phase="generated")
    prompts = ["the people will come", "a long thing to see him"]
    task = Task(
        dataset=[Sample(input=p) for p in prompts],
        solver=steer(vec),
        config=GenerateConfig(max_tokens=6, temperature=0),
    )
    log = run_eval(task, server, tmp_path)
    sp = SamplingParams(max_tokens=6, temperature=0, extra_args={"apply_steering_vectors": [vec]})
    plain = SamplingParams(max_tokens=6, temperature=0)
    changed = 0
    for sample in read_eval_log(log.location).samples:
        msgs = [{"role": "user", "content": sample.input}]
        ref = llama.chat(msgs, sp, use_tqdm=False)[0]
        assert sample.output.completion == ref.outputs[0].text
        changed += ref.outputs[0].text != llama.chat(msgs, plain, use_tqdm=False)[0].outputs[0].text
    assert changed, "the cap changed no answer"
    with zipfile.ZipFile(log.location) as z:
        text = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".json"))
    assert content_name(vec.activations) in text and '"b64"' not in text
    assert re.search(r'"op":\s*"cap"', text) and re.search(r'"phase":\s*"generated"', text)
