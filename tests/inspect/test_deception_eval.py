"""The Inspect side end to end against a real server on a tiny random model: the capture solver's
teacher-forced window, the deception-probe eval (training, saving, metrics), the steer solver."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from support.servers import KEY, run_eval
from vllm_worker import SteeringVector
from vllm_worker.api.client import LensClient

ROOT = Path(__file__).resolve().parents[2]


def _eval_module():
    spec = importlib.util.spec_from_file_location("deception_probe_eval", ROOT / "evals" / "deception_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(task, tmp_path, server):

    log = run_eval(task, server, tmp_path)
    return log


@pytest.fixture(scope="module")
def probe_eval(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deception")
    task = _eval_module().deception_probe(layer=2, train_limit=12, eval_limit=8, control_limit=10)
    return _run(task, tmp, server), tmp


def test_deception_probe_eval_end_to_end(probe_eval):
    """Metrics exist and are in range; the trained probe was saved beside the log with its layer; every
    sample's score is the mean of its per-token scores over a window that matches the answer's tokens."""
    from inspect_ai.log import read_eval_log

    log, tmp = probe_eval
    metrics = {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
    assert set(metrics) == {"probe_auroc", "auroc_ci_low", "auroc_ci_high", "recall_at_fpr"}
    assert metrics["auroc_ci_low"] <= metrics["probe_auroc"] <= metrics["auroc_ci_high"]
    assert 0.0 <= metrics["probe_auroc"] <= 1.0 and 0.0 <= metrics["recall_at_fpr"] <= 1.0
    back = read_eval_log(log.location)
    samples = back.samples
    assert len(samples) == 8 * 2 + 10
    labels = [next(iter(s.scores.values())).metadata["label"] for s in samples]
    assert labels.count("honest") == labels.count("deceptive") == 8 and labels.count("control") == 10
    probe_files = list(tmp.glob("*.probe-L2.json"))
    assert len(probe_files) == 1 and probe_files[0].name.startswith(Path(log.location).stem)
    probe = json.loads(probe_files[0].read_text())
    assert probe["layer"] == 2 and probe["meta"]["train_samples"] == 24 and len(probe["coef"]) == 128
    # ... and in the served format beside it (issue #42 §1: the eval's probe can be served as is): the
    # engine's reader takes the folder, and its formula gives the JSON probe's scores
    from inspect_lens import LinearProbe
    from vllm_worker.probes.format import load_probe_files

    served = load_probe_files(probe_files[0].with_suffix(""))
    assert served.layers == [2] and served.d_model == 128 and served.output == "logit" and served.aggregate == ["mean"]
    x = np.random.default_rng(0).normal(size=(16, 128)) * 3
    want = LinearProbe.load(probe_files[0]).score_tokens(x)
    np.testing.assert_allclose(served.score(torch.as_tensor(x, dtype=torch.float32))[:, 0].numpy(), want, atol=1e-4)
    for s in samples:
        sc = next(iter(s.scores.values()))
        start, end = sc.metadata["window"]
        assert sc.metadata["window_exact"], s.id
        assert len(sc.metadata["token_scores"]) == end - start > 0
        assert abs(np.mean(sc.metadata["token_scores"]) - sc.value) < 1e-3
        assert sc.metadata["provenance"]["dtype"] == "float32" and sc.metadata["provenance"]["vllm_version"]
        assert sc.metadata["probe_hash"] == hashlib.sha256(probe_files[0].read_bytes()).hexdigest()[:16]
        cap = s.metadata["inspect_lens_capture"]
        assert cap["layers"] == [2] and cap["teacher_forced"] and cap["shape"][2] == 128
    assert Path(log.location).stat().st_size < 400_000  # no tensors, no training set in the log


def test_eval_scores_equal_direct_capture_and_probe(probe_eval, server):
    """Recompute two samples by hand (client capture of the same chat, teacher-forced, + the saved probe):
    the logged scores are the probe applied to exactly the answer's positions."""
    from inspect_ai.log import read_eval_log

    from inspect_lens import LinearProbe

    log, tmp = probe_eval
    probe = LinearProbe.load(next(tmp.glob("*.probe-L2.json")))
    client = LensClient(server, api_key=KEY)
    for s in read_eval_log(log.location).samples[:2]:
        msgs = [{"role": m.role, "content": m.text} for m in s.input]
        r = client.generate(
            messages=msgs,
            max_tokens=1,
            temperature=0,
            capture_layers=[2],
            add_generation_prompt=False,
            continue_final_message=True,
        )
        sc = next(iter(s.scores.values()))
        start, end = sc.metadata["window"]
        assert end == len(r.prompt_token_ids)
        want = probe.score_tokens(r.activations["residual_stream"][0, start:end].numpy())
        np.testing.assert_allclose(sc.metadata["token_scores"], want, atol=1e-3)
        text = client._http.post("/detokenize", json={"tokens": r.prompt_token_ids[start:end]}).json()["prompt"]
        assert text.strip() == s.metadata["detect_text"]  # the window is the answer, nothing more or less


def test_loading_a_saved_probe_skips_training_and_gives_same_scores(probe_eval, server, tmp_path):
    log, tmp = probe_eval
    probe_file = next(tmp.glob("*.probe-L2.json"))
    task = _eval_module().deception_probe(probe=str(probe_file), eval_limit=2, control_limit=2)
    again = _run(task, tmp_path, server)
    assert not list(tmp_path.glob("*.probe-*.json"))  # loaded, not retrained
    from inspect_ai.log import read_eval_log

    first = {s.id: next(iter(s.scores.values())).value for s in read_eval_log(log.location).samples}
    for s in read_eval_log(again.location).samples:
        assert abs(next(iter(s.scores.values())).value - first[s.id]) < 1e-4
        assert next(iter(s.scores.values())).metadata["probe"] == str(probe_file)


def test_steer_solver_by_name_equals_offline_steering(server, llama, tmp_path):
    """`steer("name")` through Inspect gives the tokens offline steering gives; the log names the vector."""
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig

    from inspect_lens import register_steering_vector, steer

    vec = SteeringVector(torch.randn(1, 128, generator=torch.Generator().manual_seed(9)) * 6, [1])
    register_steering_vector("test-push", vec)
    prompt = "the people will come"
    task = Task(
        dataset=[Sample(input=prompt)], solver=steer("test-push"), config=GenerateConfig(max_tokens=6, temperature=0)
    )
    log = _run(task, tmp_path, server)
    out = read_eval_log(log.location).samples[0].output
    sp = lambda extra: SamplingParams(max_tokens=6, temperature=0, extra_args=extra)  # noqa: E731
    ref = llama.chat([{"role": "user", "content": prompt}], sp({"apply_steering_vectors": [vec]}), use_tqdm=False)[0]
    plain = llama.chat([{"role": "user", "content": prompt}], sp({}), use_tqdm=False)[0]
    assert out.completion == ref.outputs[0].text != plain.outputs[0].text
    plan = json.dumps(read_eval_log(log.location).plan.model_dump(mode="json"))
    assert '"test-push"' in plan and '"b64"' not in plan
