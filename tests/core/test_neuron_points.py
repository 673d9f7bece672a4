"""The neuron point `mlp_post` (the MLP's d_mlp-wide hidden activation, carried in d_model-wide pieces):
refusals, a last piece narrower than d_model, hooks beside graph-safe captures and edits of the whole row
(ablate, cap, norm_match) — equal to HF."""

from __future__ import annotations

import torch
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
from vllm_worker.counters import STEP_TIMINGS


def test_mlp_post_refusals_name_the_field():
    """mlp_post: MoE models have no single hidden activation; a vector must be d_mlp wide."""
    _refused(_engine("mixtral"), {"output_activations": {"mlp_post": [1]}}, "mlp_post", "mixture-of-experts")
    llm = _engine("llama")
    wrong = SteeringVector(_vec(1), [1], point="mlp_post")
    _refused(llm, {"apply_steering_vectors": [wrong]}, "apply_steering_vectors[0].activations", "d_mlp 256")


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


def _row_op(x: torch.Tensor, sv: SteeringVector, rows: torch.Tensor) -> torch.Tensor:
    """`sv`'s op (one (d_mlp,) row) on the rows `rows` of `x`, over the whole row, as HF reference."""
    x = x.clone()
    v = sv.activations[0].float()
    cur = x[rows]
    if sv.op == "add":
        if sv.norm_match:
            v = v / v.norm() * cur.norm(dim=-1, keepdim=True)
        x[rows] = cur + sv.scale * v
        return x
    d = v / v.norm()
    p = (cur * d).sum(-1, keepdim=True)
    q = torch.zeros_like(p) if sv.op == "ablate" else p.clamp(min=sv.lo, max=sv.hi)
    x[rows] = cur + (q - p) * d
    return x


def test_mlp_post_whole_row_ops_equal_hf():
    """ablate (prompt) then add at layer 1, cap (generated) at layer 2, and a norm-matched addition: each a
    projection or norm over the whole d_mlp = 320 row (three pieces, the last narrower), in the order given,
    equal to HF; a plain batch-mate is untouched; every step ran on the graph path."""
    llm = make_engine("llama_odd")
    u, w, c = _vec(31, 320), _vec(32, 320), _vec(33, 320)
    a_svs = [
        SteeringVector(u.repeat(2, 1), [1, 2], op="ablate", point="mlp_post", phase="prompt"),
        SteeringVector(w, [1], scale=1.5, point="mlp_post"),
        SteeringVector(c, [2], op="cap", lo=-0.05, hi=0.05, point="mlp_post", phase="generated"),
    ]
    b_svs = [SteeringVector(w, [2], scale=0.5, norm_match=True, point="mlp_post")]
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    base = dict(max_tokens=4, temperature=0, ignore_eos=True)
    sps = [
        SamplingParams(**base, extra_args={"output_activations": capture, "apply_steering_vectors": a_svs}),
        SamplingParams(**base, extra_args={"output_activations": capture, "apply_steering_vectors": b_svs}),
        SamplingParams(**base, extra_args={"output_activations": capture}),
    ]
    before = dict(STEP_TIMINGS)
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], sps, use_tqdm=False)
    steps = {k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "python_steps")}
    # served by the graph path (device tables: `interventions.WHOLE` chains), not the Python path
    assert steps["graph_steps"] >= 4 and steps["python_steps"] == 0, steps

    def edit_for(svs: list, n: int):
        def fn(where, layer, h):
            if where != "mlp_post":
                return None
            t = torch.arange(h.shape[0])
            rows_of = {"all": t >= 0, "prompt": t < n, "generated": t >= n}
            x, hit = h, False
            for sv in svs:
                if layer in sv.layer_indices:
                    x, hit = _row_op(x, sv, torch.nonzero(rows_of[sv.phase]).squeeze(1)), True
            return x if hit else None

        return fn

    hf = hf_model("llama_odd")
    for out, svs, what in zip(outs, (a_svs, b_svs, []), ("ablate/add/cap", "norm_match", "plain")):
        ref, _ = point_activations(hf, "llama", _ids(out), edit_for(svs, len(out.prompt_token_ids)))
        for p, layers in capture.items():
            _close(out.activations[p], ref[p][layers], f"llama_odd {what} {p}")
    n = len(outs[0].prompt_token_ids)
    ablated = outs[0].activations["mlp_post"][1, :n] @ (u[0] / u.norm())  # layer 2's prompt rows
    assert ablated.abs().max() <= 1e-4 * outs[0].activations["mlp_post"].abs().max()
    capped = outs[0].activations["mlp_post"][1, n:] @ (c[0] / c.norm())
    assert capped.abs().max() <= 0.05 + 1e-4
