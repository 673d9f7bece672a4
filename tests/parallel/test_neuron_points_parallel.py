"""mlp_post under TP=2 (two CPU worker processes, each holding half of d_mlp): captured rows are whole d_mlp
rows in HF's column order, a (d_mlp,) steering vector and a hook act on the whole row (each rank keeps its
slice), batch-mates untouched — equal to HF."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from support.hook_fns import PROMPT
from support.points import close, ids, vec
from support.reference import hf_model, point_activations
from vllm_worker import Hook, SteeringVector


def _zero_200(ctx, h):
    ctx.saved.setdefault("widths", []).append(h.shape[1])
    h = h.clone()
    h[:, 200] = 0  # a neuron of rank 1's half
    return h


def test_tp2_mlp_post_gathered_steered_and_hooked_equal_hf(tp2):
    v = vec(21, 256)
    base = dict(max_tokens=4, temperature=0, ignore_eos=True)
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    steered = SamplingParams(
        **base,
        extra_args={
            "output_activations": capture,
            "apply_steering_vectors": [SteeringVector(v, [1], scale=2.0, point="mlp_post")],
        },
    )
    hooked = SamplingParams(
        **base,
        extra_args={"output_activations": capture, "apply_hooks": [Hook(_zero_200, [2], point="mlp_post")]},
    )
    plain = SamplingParams(**base, extra_args={"output_activations": {"resid_post": [3]}})
    outs = tp2.generate([PROMPT, "a day", PROMPT], [steered, hooked, plain], use_tqdm=False)

    def steer_edit(where, layer, h):
        return h + 2.0 * v[0] if (where, layer) == ("mlp_post", 1) else None

    def hook_edit(where, layer, h):
        if (where, layer) == ("mlp_post", 2):
            h = h.clone()
            h[:, 200] = 0
            return h
        return None

    hf = hf_model("llama")
    for out, edit, what in zip(outs[:2], (steer_edit, hook_edit), ("steered", "hooked")):
        assert out.activations["mlp_post"].shape[-1] == 256
        ref, _ = point_activations(hf, "llama", ids(out), edit)
        for p, layers in capture.items():
            close(out.activations[p], ref[p][layers], f"tp2 {what} {p}")
    assert (outs[1].activations["mlp_post"][1, :, 200] == 0).all()
    assert set(outs[1].hook_results["0"]["widths"]) == {256}  # whole rows on every step, reported once
    ref, _ = point_activations(hf, "llama", ids(outs[2]))
    close(outs[2].activations["resid_post"], ref["resid_post"][[3]], "tp2 plain batch-mate")


def test_tp2_mlp_post_capture_alone_equals_hf(tp2):
    """A capture-only request (no Python hook): still gathered on every rank, on the Python path."""
    sp = SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True, extra_args={"output_activations": {"mlp_post": [0, 3]}}
    )
    out = tp2.generate([PROMPT], sp, use_tqdm=False)[0]
    ref, _ = point_activations(hf_model("llama"), "llama", ids(out))
    close(out.activations["mlp_post"], ref["mlp_post"][[0, 3]], "tp2 mlp_post capture")


def test_tp2_mlp_post_ablate_and_cap_over_the_whole_row_equal_hf(tp2):
    """ablate / cap at mlp_post under TP=2: the projection reads the gathered row, both halves."""
    u, c = vec(41, 256), vec(42, 256)
    svs = [
        SteeringVector(u, [1], op="ablate", point="mlp_post"),
        SteeringVector(c, [2], op="cap", lo=-0.05, hi=0.05, point="mlp_post"),
    ]
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    sp = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_activations": capture, "apply_steering_vectors": svs},
    )
    out = tp2.generate([PROMPT], sp, use_tqdm=False)[0]

    def edit(where, layer, h):
        if where != "mlp_post" or layer not in (1, 2):
            return None
        d = (u if layer == 1 else c)[0] / (u if layer == 1 else c).norm()
        p = h @ d
        q = torch.zeros_like(p) if layer == 1 else p.clamp(-0.05, 0.05)
        return h + (q - p).unsqueeze(1) * d

    ref, _ = point_activations(hf_model("llama"), "llama", ids(out), edit)
    for p, layers in capture.items():
        close(out.activations[p], ref[p][layers], f"tp2 whole-row ops {p}")


def test_pp2_mlp_post_on_both_stages_equals_hf(pp2):
    """PP=2: each stage lays out its own mlp_post rows (pieces interleaved, `transport.row_layout`); the
    frontend merges the stages' parts site by site and still returns whole d_mlp rows equal to HF."""
    capture = {"mlp_post": [0, 3], "resid_post": [1, 2]}
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, extra_args={"output_activations": capture})
    out = pp2.generate([PROMPT], sp, use_tqdm=False)[0]
    ref, _ = point_activations(hf_model("llama"), "llama", ids(out))
    for p, layers in capture.items():
        close(out.activations[p], ref[p][layers], f"pp2 {p}")


def test_pp2_mlp_post_whole_row_edits_on_both_stages_equal_hf(pp2):
    """PP=2 (no TP: each stage's graph path serves whole rows, `interventions.WHOLE`): an ablation at a layer
    of the first stage and a cap at one of the second, each over the whole row, equal HF."""
    u, c = vec(51, 256), vec(52, 256)
    svs = [
        SteeringVector(u, [1], op="ablate", point="mlp_post"),
        SteeringVector(c, [3], op="cap", lo=-0.05, hi=0.05, point="mlp_post"),
    ]
    capture = {"mlp_post": [1, 3], "resid_post": [3]}
    sp = SamplingParams(
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        extra_args={"output_activations": capture, "apply_steering_vectors": svs},
    )
    out = pp2.generate([PROMPT], sp, use_tqdm=False)[0]

    def edit(where, layer, h):
        if where != "mlp_post" or layer not in (1, 3):
            return None
        d = (u if layer == 1 else c)[0] / (u if layer == 1 else c).norm()
        p = h @ d
        q = torch.zeros_like(p) if layer == 1 else p.clamp(-0.05, 0.05)
        return h + (q - p).unsqueeze(1) * d

    ref, _ = point_activations(hf_model("llama"), "llama", ids(out), edit)
    for p, layers in capture.items():
        close(out.activations[p], ref[p][layers], f"pp2 whole-row ops {p}")
