"""The neuron point `mlp_post` (the MLP's d_mlp-wide hidden activation, carried in d_model-wide pieces):
refusals, a last piece narrower than d_model, and hooks beside graph-safe captures — equal to HF."""

from __future__ import annotations

from vllm import SamplingParams

from support.engines import make_engine
from support.points import PROMPTS
from support.points import close as _close
from support.points import engine as _engine
from support.points import ids as _ids
from support.points import refused as _refused
from support.points import vec as _vec
from support.reference import hf_model, point_activations
from vllm_worker import Hook, SteeringVector


def test_mlp_post_refusals_name_the_field():
    """mlp_post: MoE models have no single hidden activation; a vector must be d_mlp wide; edits that read
    the whole row (norm_match) are refused there (the row travels in d_model-wide pieces)."""
    _refused(_engine("mixtral"), {"output_activations": {"mlp_post": [1]}}, "mlp_post", "mixture-of-experts")
    llm = _engine("llama")
    wrong = SteeringVector(_vec(1), [1], point="mlp_post")
    _refused(llm, {"apply_steering_vectors": [wrong]}, "apply_steering_vectors[0].activations", "d_mlp 256")
    nm = SteeringVector(_vec(1, 256), [1], point="mlp_post", norm_match=True)
    _refused(llm, {"apply_steering_vectors": [nm]}, "apply_steering_vectors[0]", "only per-value edits")
    for op in ("ablate", "cap"):  # a projection on a direction reads the whole d_mlp row
        whole = SteeringVector(_vec(1, 256), [1], point="mlp_post", op=op, **({"hi": 0.5} if op == "cap" else {}))
        _refused(llm, {"apply_steering_vectors": [whole]}, "apply_steering_vectors[0]", "only per-value edits")


def _zero_col(col: int):
    def fn(ctx, h):
        h = h.clone()
        h[:, col] = 0
        return h

    return fn


def test_mlp_post_with_a_narrower_last_piece_equals_hf():
    """d_mlp 320 = 128 + 128 + 64: the last piece is narrower than its d_model-wide staging row. Capture and
    steering on the graph-safe path, and with a hook at mlp_post (Python path: the hook sees the whole row
    and zeroes a value of the last piece), equal HF; the captured rows are d_mlp wide."""
    llm = make_engine("llama_odd")
    v = _vec(11, 320)
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    steer = SteeringVector(v, [1], scale=2.0, point="mlp_post")
    graph = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_activations": capture, "apply_steering_vectors": [steer]},
    )
    python = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={
            "output_activations": capture,
            "apply_steering_vectors": [steer],
            "apply_hooks": [Hook(_zero_col(300), [2], point="mlp_post")],
        },
    )
    outs = llm.generate([PROMPTS[0]] * 2, [graph, python], use_tqdm=False)

    def edit(hooked: bool):
        def fn(where, layer, h):
            if where == "mlp_post" and layer == 1:
                return h + 2.0 * v[0]
            if hooked and where == "mlp_post" and layer == 2:
                h = h.clone()
                h[:, 300] = 0
                return h
            return None

        return fn

    for out, hooked in zip(outs, (False, True)):
        assert out.activations["mlp_post"].shape[-1] == 320
        ref, _ = point_activations(hf_model("llama_odd"), "llama", _ids(out), edit(hooked))
        for p, layers in capture.items():
            _close(out.activations[p], ref[p][layers], f"llama_odd {p} (hooked: {hooked})")
    assert (outs[1].activations["mlp_post"][1, :, 300] == 0).all()


def test_a_neuron_hook_beside_a_graph_safe_capture_of_mlp_post(llama):
    """One request zeroes neuron 5 of layer 1 with a hook at mlp_post while its batch-mate captures that
    point on the graph-safe kernel: the hook sees whole d_mlp rows, each request equals HF with its own edit."""

    def zero(ctx, h):
        ctx.saved.setdefault("widths", []).append(h.shape[1])
        h = h.clone()
        h[:, 5] = 0
        return h

    base = dict(max_tokens=4, temperature=0, ignore_eos=True)
    sps = [
        SamplingParams(**base, extra_args={"output_activations": {"mlp_post": [1], "resid_post": [3]}}),
        SamplingParams(
            **base,
            extra_args={"output_activations": {"resid_post": [3]}, "apply_hooks": [Hook(zero, [1], point="mlp_post")]},
        ),
    ]
    plain, hooked = llama.generate([PROMPTS[0], PROMPTS[1]], sps, use_tqdm=False)

    def edit(where, layer, h):
        if (where, layer) == ("mlp_post", 1):
            h = h.clone()
            h[:, 5] = 0
            return h
        return None

    ref, _ = point_activations(hf_model("llama"), "llama", _ids(plain))
    _close(plain.activations["mlp_post"], ref["mlp_post"][[1]], "graph-safe mlp_post capture")
    _close(plain.activations["resid_post"], ref["resid_post"][[3]], "plain batch-mate downstream")
    ref, _ = point_activations(hf_model("llama"), "llama", _ids(hooked), edit)
    _close(hooked.activations["resid_post"], ref["resid_post"][[3]], "downstream of the neuron hook")
    assert set(hooked.hook_results["0"]["widths"]) == {256}  # whole d_mlp rows, every step
