"""Issue #43's op x phase grid where other tests leave holes: `add` by phase at `resid_post` (both paths),
every op by phase at `mlp_in` (what the MLP reads), and `set` at `mlp_post` (neuron patching: a whole d_mlp
row, and a 3-D row at chosen prompt positions) — each equal to HF float32 with the same edit by hand,
tokens included, with a plain batch-mate unchanged and the graph-safe path asserted where it is the one
documented."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.engines import make_engine
from support.points import close
from support.reference import hf_model, point_activations
from vllm_worker import Hook, SteeringVector
from vllm_worker.counters import STEP_TIMINGS

PROMPTS = ["the water of people will come down to the side", "a long thing to see him", "how many water did she"]
N = 5


def _vec(seed: int, d: int = 128, rows: int = 1, norm: float = 3.0) -> torch.Tensor:
    v = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True) * norm


def _sp(extra: dict | None) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, extra_args=extra)


def _apply(x: torch.Tensor, sv: SteeringVector, rows: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """The documented formula of `sv.op` on rows `rows` of x (T, d), with `row` (d,) or (len(rows), d)."""
    x = x.clone()
    v = row.float().expand(len(rows), -1) if row.dim() == 1 else row.float()
    cur = x[rows]
    if sv.op == "add":
        x[rows] = cur + sv.scale * v
    elif sv.op == "set":
        x[rows] = v
    else:
        d = v / v.norm(dim=-1, keepdim=True)
        p = (cur * d).sum(-1, keepdim=True)
        q = torch.zeros_like(p) if sv.op == "ablate" else p.clamp(min=sv.lo, max=sv.hi)
        x[rows] = cur + (q - p) * d
    return x


def _edit(svs: list[SteeringVector], n_prompt: int):
    """HF reference edit (point, layer, (T, d)) -> new value: the vectors in order, each on its phase's rows
    (3-D rows: at their `position_indices`)."""

    def fn(point: str, layer: int, h: torch.Tensor):
        x, hit = h, False
        t = torch.arange(h.shape[0])
        for sv in svs:
            if sv.point != point or layer not in sv.layer_indices:
                continue
            i = sv.layer_indices.index(layer)
            keep = {"all": t >= 0, "prompt": t < n_prompt, "generated": t >= n_prompt}[sv.phase]
            if sv.activations.dim() == 3:
                sel = [(k, p) for k, p in enumerate(sv.position_indices) if p < h.shape[0] and keep[p]]
                if sel:
                    rows = torch.tensor([p for _, p in sel])
                    x, hit = _apply(x, sv, rows, sv.activations[i][[k for k, _ in sel]]), True
            else:
                rows = torch.nonzero(keep).squeeze(1)
                if len(rows):
                    x, hit = _apply(x, sv, rows, sv.activations[i]), True
        return x if hit else None

    return fn


def _check(out, svs: list[SteeringVector], family: str, capture: dict[str, list[int]]) -> None:
    """Tokens (greedy under the edit) and every captured point equal HF float32 with the edit."""
    hf = hf_model(family)
    n = len(out.prompt_token_ids)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, logits = point_activations(hf, "llama", ids, _edit(svs, n))
    assert logits[n - 1 : -1].argmax(-1).tolist() == ids[n:]  # each generated token HF's greedy one
    for p, layers in capture.items():
        close(out.activations[p], ref[p][layers][:, : len(ids) - 1], f"{family} {p}")


def _steps(before: dict) -> dict:
    return {k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "python_steps")}


@pytest.mark.parametrize("python_path", [False, True], ids=["graph", "python"])
def test_add_by_phase_equals_hf(llama, python_path, monkeypatch):
    """`add` at `phase="prompt"` and `phase="generated"` (resid_post, two layers): only that phase's
    positions move, equal to HF; a plain batch-mate equals its solo run; the path is the one asked for."""
    if python_path:
        monkeypatch.setenv("VLLM_LENS_SEAMS", "0")  # a hook sends the whole step to the Python path
    cases = [
        [SteeringVector(_vec(41, rows=2), [1, 2], scale=2.0, phase="prompt")],
        [SteeringVector(_vec(42), [2], scale=3.0, phase="generated")],
    ]
    capture = {"resid_post": [0, 1, 2, 3]}
    extras: list[dict] = [{"apply_steering_vectors": c, "output_activations": capture} for c in cases]
    extras.append({"output_activations": capture})
    if python_path:
        for e in extras:
            e["apply_hooks"] = [Hook(lambda ctx, h: None, [3])]
    before = dict(STEP_TIMINGS)
    outs = llama.generate(PROMPTS, [_sp(e) for e in extras], use_tqdm=False)
    steps = _steps(before)
    if python_path:
        assert steps["graph_steps"] == 0 and steps["python_steps"] >= N
    else:
        assert steps["graph_steps"] >= N and steps["python_steps"] == 0
    plain = llama.generate(PROMPTS[:2], [_sp({"output_activations": capture})] * 2, use_tqdm=False)
    for out, svs, base in zip(outs, cases, plain):
        _check(out, svs, "llama", capture)
        n = len(out.prompt_token_ids)
        layer = svs[0].layer_indices[-1]
        width = min(out.activations["resid_post"].shape[1], base.activations["resid_post"].shape[1])
        moved = (out.activations["resid_post"][layer, :width] - base.activations["resid_post"][layer, :width]).abs()
        moved = moved.amax(-1)
        if svs[0].phase == "generated":
            assert moved[:n].max() == 0 and moved[n:].max() > 1e-2
        else:
            assert moved[: n - 1].max() > 1e-2
    solo = llama.generate([PROMPTS[2]], [_sp({"output_activations": capture})], use_tqdm=False)[0]
    assert list(outs[2].outputs[0].token_ids) == list(solo.outputs[0].token_ids)
    assert torch.equal(outs[2].activations["resid_post"], solo.activations["resid_post"])


def test_every_op_by_phase_at_mlp_in_equals_hf(llama):
    """ablate / cap / set / add at `mlp_in` (the MLP's normed input), each with its own phase, and a 3-D set
    at two prompt positions: equal to HF with the edits at the MLP's input, on the graph-safe path."""
    n_first = len(llama.get_tokenizer()(PROMPTS[0]).input_ids)
    cases = [
        [
            SteeringVector(_vec(51), [1], op="ablate", point="mlp_in", phase="prompt"),
            SteeringVector(_vec(52), [1], op="cap", lo=-0.05, hi=0.05, point="mlp_in", phase="generated"),
        ],
        [
            SteeringVector(_vec(53, norm=2.0), [2], op="set", point="mlp_in", phase="generated"),
            SteeringVector(_vec(54), [2], scale=1.5, point="mlp_in", phase="prompt"),
        ],
        [SteeringVector(_vec(55, rows=2, norm=2.0)[None], [2], op="set", point="mlp_in", position_indices=[1, 3])],
    ]
    assert n_first > 3
    capture = {"mlp_in": [1, 2], "resid_post": [3]}
    extras: list[dict] = [{"apply_steering_vectors": c, "output_activations": capture} for c in cases]
    extras.append({"output_activations": capture})
    before = dict(STEP_TIMINGS)
    outs = llama.generate(PROMPTS + [PROMPTS[0]], [_sp(e) for e in extras], use_tqdm=False)
    assert _steps(before)["graph_steps"] >= N and _steps(before)["python_steps"] == 0
    for out, svs in zip(outs, cases + [[]]):
        _check(out, svs, "llama", capture)
    a = outs[0].activations["mlp_in"][0]  # layer 1: the ablated direction is gone from the prompt rows
    n = len(outs[0].prompt_token_ids)
    d = cases[0][0].activations[0] / cases[0][0].activations[0].norm()
    assert (a[:n] @ d).abs().max() <= 1e-4 * a.abs().max() and (a[n:] @ d).abs().max() > 1e-3
    c = cases[0][1].activations[0] / cases[0][1].activations[0].norm()
    assert (a[n:] @ c).abs().max() <= 0.05 + 1e-5
    s = outs[2].activations["mlp_in"][1]
    assert torch.allclose(s[[1, 3]], cases[2][0].activations[0], atol=1e-5)


def test_set_at_mlp_post_patches_neurons_equal_hf():
    """`set` at `mlp_post` on a d_mlp = 320 model (pieces 128 + 128 + 64): a whole row written at generated
    positions (every neuron), and a 3-D row at two prompt positions (patching in another prompt's neurons,
    as causal tracing does) — equal to HF with the same writes, on the graph-safe path (per-value ops are
    cut into pieces there), the captured rows holding exactly the values written; a batch-mate unchanged."""
    llm = make_engine("llama_odd")
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    src = llm.generate([PROMPTS[1]], [_sp({"output_activations": {"mlp_post": [1]}})], use_tqdm=False)[0]
    patch = src.activations["mlp_post"][0][[2, 4]].clone()  # (2, 320): prompt 1's neurons at positions 2, 4
    cases = [
        [SteeringVector(_vec(61, d=320, norm=5.0), [2], op="set", point="mlp_post", phase="generated")],
        [SteeringVector(patch[None], [1], op="set", point="mlp_post", position_indices=[2, 4])],
    ]
    extras: list[dict] = [{"apply_steering_vectors": c, "output_activations": capture} for c in cases]
    extras.append({"output_activations": capture})
    before = dict(STEP_TIMINGS)
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[2]], [_sp(e) for e in extras], use_tqdm=False)
    assert _steps(before)["graph_steps"] >= N and _steps(before)["python_steps"] == 0
    for out, svs in zip(outs, cases + [[]]):
        _check(out, svs, "llama_odd", capture)
    n = len(outs[0].prompt_token_ids)
    written = outs[0].activations["mlp_post"][1]
    assert torch.equal(written[n:], cases[0][0].activations[0].expand(len(written) - n, -1))
    assert not torch.equal(written[:n], cases[0][0].activations[0].expand(n, -1))
    patched = outs[1].activations["mlp_post"][0]
    assert torch.equal(patched[[2, 4]], patch)
    solo = llm.generate([PROMPTS[2]], [_sp({"output_activations": capture})], use_tqdm=False)[0]
    assert list(outs[2].outputs[0].token_ids) == list(solo.outputs[0].token_ids)
    for p in capture:
        assert torch.equal(outs[2].activations[p], solo.activations[p])


def test_ablate_and_cap_at_z_and_set_at_attn_out_equal_hf(llama):
    """`z` takes every op over its whole n_heads * d_head row (docs/hook-points.md), not only head `set`:
    ablate (prompt) then cap (generated) at z of layer 1, and a 2-D `set` of attn_out at layer 2 (all
    positions) — equal to HF with the same edits, on the graph-safe path; the captured z rows flattened."""
    svs = [
        SteeringVector(_vec(71), [1], op="ablate", point="z", phase="prompt"),
        SteeringVector(_vec(72), [1], op="cap", lo=-0.02, hi=0.02, point="z", phase="generated"),
        SteeringVector(_vec(73, norm=1.5), [2], op="set", point="attn_out"),
    ]
    capture = {"z": [1], "attn_out": [2], "resid_post": [3]}
    extra = {"apply_steering_vectors": svs, "output_activations": capture}
    before = dict(STEP_TIMINGS)
    out = llama.generate([PROMPTS[1]], [_sp(extra)], use_tqdm=False)[0]
    assert _steps(before)["graph_steps"] >= N and _steps(before)["python_steps"] == 0
    n = len(out.prompt_token_ids)
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, logits = point_activations(hf_model("llama"), "llama", ids, _edit(svs, n))
    assert logits[n - 1 : -1].argmax(-1).tolist() == ids[n:]
    z = out.activations["z"].flatten(-2)  # (1, n_pos, n_heads * d_head)
    close(z, ref["z"][[1]][:, : len(ids) - 1], "llama z")
    for p in ("attn_out", "resid_post"):
        close(out.activations[p], ref[p][capture[p]][:, : len(ids) - 1], f"llama {p}")
    u = svs[0].activations[0] / svs[0].activations[0].norm()
    assert (z[0, :n] @ u).abs().max() <= 1e-4 * z.abs().max()
    c = svs[1].activations[0] / svs[1].activations[0].norm()
    assert (z[0, n:] @ c).abs().max() <= 0.02 + 1e-5
    assert torch.allclose(out.activations["attn_out"][0], svs[2].activations[0].expand(len(ids) - 1, -1), atol=1e-6)
