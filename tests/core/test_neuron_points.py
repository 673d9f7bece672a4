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


def _edit_chain(svs: list, n: int):
    """HF reference: `svs` at mlp_post in order, each over whole rows (2-D: every row of its phase; 3-D:
    the rows its positions name), `n` the prompt's length."""

    def fn(where, layer, h):
        if where != "mlp_post" or not any(layer in sv.layer_indices for sv in svs):
            return None
        x = h.clone()
        t = torch.arange(h.shape[0])
        for sv in svs:
            if layer not in sv.layer_indices:
                continue
            li = sv.layer_indices.index(layer)
            phase = {"all": t >= 0, "prompt": t < n, "generated": t >= n}[sv.phase]
            if sv.position_indices is None:
                rows = [(r, sv.activations[li].float()) for r in torch.nonzero(phase).squeeze(1).tolist()]
            else:
                rows = [(p, sv.activations[li][k].float()) for k, p in enumerate(sv.position_indices) if phase[p]]
            for r, v in rows:
                cur = x[r]
                if sv.op == "set":
                    x[r] = v
                elif sv.op == "add":
                    x[r] = cur + sv.scale * (v / v.norm() * cur.norm() if sv.norm_match else v)
                else:
                    u = v / v.norm()
                    p = cur @ u
                    q = 0.0 if sv.op == "ablate" else p.clamp(min=sv.lo, max=sv.hi)
                    x[r] = cur + (q - p) * u
        return x

    return fn


def test_mlp_post_whole_row_chain_on_both_paths_equals_hf(monkeypatch):
    """A request's chain at mlp_post mixing per-value ops with whole-row ones — add, ablate (prompt), cap, a
    3-D set at two prompt positions, a norm-matched add (generated), an ablation at two layers — in the
    order given: the graph path (every step: device tables) and the Python path agree to 1e-5 and both
    equal HF fp32 at prompt and generated positions; a capture-only batch-mate equals its solo run."""
    llm = make_engine("llama_odd")
    u, c, x = _vec(41, 320), _vec(42, 320), _vec(43, 320)
    sets = torch.randn(1, 2, 320, generator=torch.Generator().manual_seed(44))
    chain = [
        SteeringVector(_vec(45, 320), [1], scale=2.0, point="mlp_post"),
        SteeringVector(u, [1], op="ablate", point="mlp_post", phase="prompt"),
        SteeringVector(c, [1], op="cap", lo=-0.1, hi=0.2, point="mlp_post"),
        SteeringVector(sets, [1], op="set", position_indices=[1, 3], point="mlp_post"),
        SteeringVector(x, [1], scale=0.5, norm_match=True, point="mlp_post", phase="generated"),
        SteeringVector(torch.cat([u, x]), [1, 2], op="ablate", point="mlp_post"),
    ]
    capture = {"mlp_post": [1, 2], "resid_post": [3]}
    base = dict(max_tokens=5, temperature=0, ignore_eos=True)

    def run(python: bool):
        extras = [{"output_activations": capture, "apply_steering_vectors": chain}, {"output_activations": capture}]
        if python:  # a no-op hook: the step's features from Python
            for e in extras:
                e["apply_hooks"] = [Hook(_noop, [3])]
        before = dict(STEP_TIMINGS)
        outs = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(**base, extra_args=e) for e in extras])
        return outs, {k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "python_steps")}

    fast, s1 = run(False)
    monkeypatch.setenv("VLLM_LENS_SEAMS", "0")  # hooks send the whole step to the Python path
    slow, s2 = run(True)
    assert s1["graph_steps"] >= base["max_tokens"] and s1["python_steps"] == 0, s1
    assert s2["graph_steps"] == 0 and s2["python_steps"] >= base["max_tokens"], s2
    for a, b in zip(fast, slow):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for p in capture:
            got, ref = a.activations[p], b.activations[p]
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), p
    out = fast[0]
    ref, _ = point_activations(hf_model("llama_odd"), "llama", _ids(out), _edit_chain(chain, len(out.prompt_token_ids)))
    for p, layers in capture.items():
        got, want = out.activations[p], ref[p][layers]
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), p
    ablated = out.activations["mlp_post"][0] @ (u[0] / u.norm())  # the chain's last step, at layer 1
    assert ablated.abs().max() <= 1e-5 * out.activations["mlp_post"].abs().max()
    solo = llm.generate([PROMPTS[1]], SamplingParams(**base, extra_args={"output_activations": capture}))[0]
    mate = fast[1]
    assert list(mate.outputs[0].token_ids) == list(solo.outputs[0].token_ids)
    for p in capture:
        assert torch.equal(mate.activations[p], solo.activations[p]), p


def _noop(ctx, h):
    return None
