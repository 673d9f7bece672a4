"""Whole-row work at mlp_post beside other steering of the same request (review4). A probe action's gated
steering at mlp_post stays whole at the tap's own site (the frontend cuts only the request's own vectors
into pieces), where the graph path has no column: it must take the Python path even when the request's
plain mlp_post steering holds entries at that tap's pieces. The graph run equals the same request on the
Python path (which serves gated mlp_post steering), and the action's steering is not silently dropped."""

from __future__ import annotations

from vllm import SamplingParams

from support.engines import make_engine
from support.points import PROMPTS
from support.points import vec as _vec
from vllm_worker import Hook, SteeringVector
from vllm_worker.counters import STEP_TIMINGS


def _noop(ctx, h):
    return None


def test_a_gated_mlp_post_steer_beside_plain_mlp_post_steering_is_applied(monkeypatch):
    llm = make_engine("llama_odd")
    gated = SteeringVector(_vec(51, 320, norm=8.0), [1], point="mlp_post")
    plain = SteeringVector(_vec(52, 320), [1], scale=1.5, point="mlp_post")  # (cut into pieces: entries)
    act = {"direction": _vec(53, 128, norm=1.0)[0].tolist(), "layer": 2, "threshold": -1e9, "then": {"steer": gated}}
    capture = {"mlp_post": [1], "resid_post": [3]}
    base = dict(max_tokens=5, temperature=0, ignore_eos=True)

    def run(python: bool, action: bool = True):
        e: dict = {"output_activations": capture, "apply_steering_vectors": [plain]}
        if action:
            e["probe_actions"] = [act]
        if python:  # a no-op hook: the step's features from Python
            e["apply_hooks"] = [Hook(_noop, [3])]
        return llm.generate([PROMPTS[0]], [SamplingParams(**base, extra_args=e)], use_tqdm=False)[0]

    fast = run(False)
    monkeypatch.setenv("VLLM_LENS_SEAMS", "0")  # hooks send the whole step to the Python path
    before = dict(STEP_TIMINGS)
    slow = run(True)
    assert STEP_TIMINGS["python_steps"] - before["python_steps"] >= base["max_tokens"]
    unfired = run(True, action=False)
    assert fast.activations["probe_actions"][0]["fired"] and slow.activations["probe_actions"][0]["fired"]
    ref = slow.activations["mlp_post"]
    # the action's steering changed the generated rows (the test can tell it from its absence)
    assert (ref - unfired.activations["mlp_post"]).abs().max() > 1.0
    for p in capture:
        got, want = fast.activations[p], slow.activations[p]
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), p
