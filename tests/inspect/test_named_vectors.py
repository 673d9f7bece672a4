"""`steer(SteeringVector(...))` through Inspect: the provider uploads the tensor to the server once, by
content name, and every request names it — the eval log holds names and parameters, no tensor, and the
tokens equal offline steering with the tensor."""

from __future__ import annotations

import zipfile

import torch
from vllm import SamplingParams

from support.servers import KEY, run_eval
from vllm_worker import SteeringVector
from vllm_worker.api.client import LensClient


def test_steer_solver_logs_a_name_not_the_tensor(server, llama, tmp_path):
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig

    from inspect_lens import steer
    from inspect_lens.steering import content_name

    vec = SteeringVector(torch.randn(1, 128, generator=torch.Generator().manual_seed(21)) * 6, [1], scale=1.5)
    name = content_name(vec.activations)
    prompts = ["the people will come", "a long thing to see him"]
    task = Task(
        dataset=[Sample(input=p) for p in prompts],
        solver=steer(vec),
        config=GenerateConfig(max_tokens=6, temperature=0),
    )
    log = run_eval(task, server, tmp_path)

    sp = SamplingParams(max_tokens=6, temperature=0, extra_args={"apply_steering_vectors": [vec]})
    for sample in read_eval_log(log.location).samples:
        ref = llama.chat([{"role": "user", "content": sample.input}], sp, use_tqdm=False)[0]
        assert sample.output.completion == ref.outputs[0].text
    # the whole log (plan, events, model calls) names the vector and carries no tensor
    with zipfile.ZipFile(log.location) as z:
        text = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".json"))
    assert name in text and '"b64"' not in text
    assert text.count(name) >= 1 + len(prompts)  # the plan and each sample's model call
    assert name in [v["name"] for v in LensClient(server, api_key=KEY).list_vectors()]


def test_a_vector_the_server_lost_is_uploaded_again(server, llama, tmp_path):
    """The same provider across a server that forgot its vectors (a restart, or a DELETE): the request
    naming the vector is answered "unknown vector" once, the provider uploads it again and the sample
    still equals offline steering."""
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig, get_model

    from inspect_lens import steer
    from inspect_lens.steering import content_name
    from support.engines import model_path

    vec = SteeringVector(torch.randn(1, 128, generator=torch.Generator().manual_seed(22)) * 6, [1], scale=1.5)
    name = content_name(vec.activations)
    model = get_model(f"vllm-lens/{model_path('llama')}", base_url=f"{server}/v1", api_key=KEY, memoize=False)
    client = LensClient(server, api_key=KEY)
    sp = SamplingParams(max_tokens=6, temperature=0, extra_args={"apply_steering_vectors": [vec]})
    for round in range(2):
        task = Task(
            dataset=[Sample(input="the people will come")],
            solver=steer(vec),
            config=GenerateConfig(max_tokens=6, temperature=0),
        )
        log = run_eval(task, server, tmp_path / str(round), model=model)
        [sample] = read_eval_log(log.location).samples
        ref = llama.chat([{"role": "user", "content": sample.input}], sp, use_tqdm=False)[0]
        assert sample.output.completion == ref.outputs[0].text
        assert name in [v["name"] for v in client.list_vectors()]
        client.delete_vector(name)  # the server forgets it; the provider still thinks it is there
