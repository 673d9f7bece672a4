"""The `sae_feature` scorer in a real `inspect eval`: it reads the sample's answer teacher-forced through the
server with the SAE loaded there, and its reading equals the SAE's encode of the captured stream."""

from __future__ import annotations

import httpx

from support.saes import random_sae
from support.servers import KEY, SAE_DIR, run_eval
from vllm_worker.api.client import LensClient
from vllm_worker.sae import Sae, save

FEATURE = 5


def _sae() -> Sae:
    return random_sae(11, d_sae=32)


def test_sae_feature_scorer_reads_the_answer_through_the_engine(server, tmp_path):
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import generate

    from inspect_lens import sae_feature

    sae = _sae()
    save(sae, SAE_DIR / "scorer")
    r = httpx.post(
        f"{server}/v1/lens/saes",
        json={"name": "scorer", "path": "scorer"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    samples = [Sample(input="the water of people will come", target="-"), Sample(input="a long thing", target="-")]
    fires = run_eval(
        Task(dataset=samples, solver=generate(), scorer=sae_feature("scorer", FEATURE, threshold=-1e9)),
        server,
        tmp_path / "low",
        max_tokens=4,
        temperature=0,
    )
    client = LensClient(server, api_key=KEY)
    for s in fires.samples:
        score = s.scores["sae_feature"]
        assert score.value == 1.0 and score.metadata["n_tokens"] > 0
        # the same text read directly: the feature is the SAE's encode of resid_post[2] at the answer's tokens
        msgs = [{"role": m.role, "content": m.text} for m in s.messages]
        got = client.generate(
            messages=msgs,
            max_tokens=1,
            temperature=0,
            add_generation_prompt=False,
            continue_final_message=True,
            capture_layers=[2],
        )
        stream = got.activations["residual_stream"][0]
        want = sae.encode(stream[-score.metadata["n_tokens"] :])[0][:, FEATURE].max().item()
        assert abs(score.metadata["max_activation"] - want) <= 1e-4 * max(1.0, abs(want))
    quiet = run_eval(
        Task(dataset=samples, solver=generate(), scorer=sae_feature("scorer", FEATURE, threshold=1e9)),
        server,
        tmp_path / "high",
        max_tokens=4,
        temperature=0,
    )
    assert [s.scores["sae_feature"].value for s in quiet.samples] == [0.0, 0.0]
