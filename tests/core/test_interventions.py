"""Interventions beyond addition (`SteeringVector(op=..., phase=...)`: ablate, cap, set; prompt / generated
positions; several in order) equal the same edits done by hand in HF float32, at prompt and generated
positions, on the graph-safe path and on the Python path; batch-mates are untouched; bad combinations are a
ValueError naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import SamplingParams

from support.reference import greedy, hf_model, point_activations, residuals
from vllm_worker import Hook, SteeringVector
from vllm_worker.counters import STEP_TIMINGS
from vllm_worker.frontend.fetch import attach_outputs

D = 128
N_HEADS, D_HEAD = 4, 32
LAYERS = [0, 1, 2, 3]
PROMPTS = [
    "the water of people will come down to the side",
    "a long thing to see him",
    "they said the first people could",
    "how many water did she write",
    "the number of them was long",
    "all day we can find it",
    "his word was not the way",
    "she will look at the water",
    "we can see the first day",
    "the long way of the water",
    "he did not look at them",
]
MAX_TOKENS = 6


def _vec(seed: int, shape=(1, D), norm: float = 1.0) -> torch.Tensor:
    v = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True) * norm


def _noop(ctx, h):
    return None


# ---------------------------------------------------------------- the reference: the documented formulas by hand


def op_edit(x: torch.Tensor, sv: SteeringVector, row, rows: torch.Tensor) -> torch.Tensor:
    """`sv`'s op on the stream rows `rows` of `x` (T, d) with its row `row` ((d,) or (len(rows), d))."""
    x = x.clone()
    v = row.float().expand(len(rows), -1) if row.dim() == 1 else row.float()
    cur = x[rows]
    if sv.op == "add":
        if sv.norm_match:
            v = v / v.norm(dim=-1, keepdim=True) * cur.norm(dim=-1, keepdim=True)
        x[rows] = cur + sv.scale * v
    elif sv.op == "set":
        x[rows] = v
    else:
        d = v / v.norm(dim=-1, keepdim=True)
        p = (cur * d).sum(-1, keepdim=True)
        q = torch.zeros_like(p) if sv.op == "ablate" else p.clamp(min=sv.lo, max=sv.hi)
        x[rows] = cur + (q - p) * d
    return x


def hf_edit(svs: list[SteeringVector], n_prompt: int):
    """The vectors (resid_post, in order) as an HF reference edit `(layer, (1, T, d))`."""

    def edit(layer: int, h: torch.Tensor):
        x = h[0]
        for sv in svs:
            if layer not in sv.layer_indices:
                continue
            i = sv.layer_indices.index(layer)
            t = torch.arange(x.shape[0])
            keep = {"all": t >= 0, "prompt": t < n_prompt, "generated": t >= n_prompt}[sv.phase]
            if sv.activations.dim() == 3:
                pos = sv.position_indices or list(range(sv.activations.shape[1]))
                sel = [(k, p) for k, p in enumerate(pos) if p < x.shape[0] and keep[p]]
                if sel:
                    x = op_edit(x, sv, sv.activations[i][[k for k, _ in sel]], torch.tensor([p for _, p in sel]))
            else:
                rows = torch.nonzero(keep).squeeze(1)
                if len(rows):
                    x = op_edit(x, sv, sv.activations[i], rows)
        return x.unsqueeze(0)

    return edit


def check_hf(out, svs: list[SteeringVector], tol: float = 1e-4) -> None:
    """Tokens, and the residual stream after every layer at every position, equal HF with the edit."""
    hf = hf_model("llama")
    prompt = list(out.prompt_token_ids)
    edit = hf_edit(svs, len(prompt))
    got = list(out.outputs[0].token_ids)
    assert got == greedy(hf, prompt, len(got), edit)
    ref, _ = residuals(hf, (prompt + got)[:-1], edit)
    acts = out.activations["residual_stream"]
    assert acts.shape == ref.shape
    err = (acts - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


def _sp(extra, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0, ignore_eos=True, extra_args=extra, **kw)


@pytest.fixture(scope="module")
def plain(llama):
    """Every prompt's plain run (captures of every layer): directions and values the ops use."""
    outs = llama.generate(PROMPTS, _sp({"output_residual_stream": LAYERS}), use_tqdm=False)
    return [o.activations["residual_stream"] for o in outs]


def _cases(plain) -> list[list[SteeringVector]]:
    """Each op x phase, on directions the stream really has (its mean at that layer)."""
    mean = plain[0].mean(dim=1)  # (layers, d)
    out = []
    for phase in ("all", "prompt", "generated"):
        out.append([SteeringVector(mean[[1, 2]], [1, 2], op="ablate", phase=phase)])
        p = (plain[0][2] @ (mean[2] / mean[2].norm())).median().item()
        out.append([SteeringVector(mean[[2]], [2], op="cap", lo=p - 0.5, hi=p - 0.2, phase=phase)])
        out.append([SteeringVector(_vec(7, (1, D), norm=8.0), [1], op="set", phase=phase)])
    return out


def _run(llama, cases, python_path: bool):
    extras = [{"apply_steering_vectors": c, "output_residual_stream": LAYERS} for c in cases]
    extras.append({"output_residual_stream": LAYERS})  # a capture-only batch-mate
    if python_path:  # a no-op hook at a site nobody steers or captures after: the step's features from Python
        for e in extras:
            e["apply_hooks"] = [Hook(_noop, [3])]
    before = dict(STEP_TIMINGS)
    outs = llama.generate(PROMPTS[: len(extras)], [_sp(e) for e in extras], use_tqdm=False)
    return outs, {k: STEP_TIMINGS[k] - before[k] for k in ("graph_steps", "python_steps")}


@pytest.mark.parametrize("python_path", [False, True], ids=["graph", "python"])
def test_each_op_and_phase_equals_hf(llama, plain, python_path, monkeypatch):
    """ablate / cap / set x all / prompt / generated in one batch with a capture-only batch-mate: each
    equals HF with the same edit (tokens and every layer at every position), changed what its phase
    covers and nothing else, and the batch-mate equals its solo run."""
    if python_path:
        monkeypatch.setenv("VLLM_LENS_SEAMS", "0")  # hooks send the whole step to the Python path
    cases = _cases(plain)
    outs, steps = _run(llama, cases, python_path)
    if python_path:
        assert steps["graph_steps"] == 0 and steps["python_steps"] >= MAX_TOKENS
    else:
        assert steps["graph_steps"] >= MAX_TOKENS and steps["python_steps"] == 0
    for i, (case, out) in enumerate(zip(cases, outs)):
        check_hf(out, case)
        n = len(out.prompt_token_ids)
        layer = case[0].layer_indices[0]
        moved = (
            out.activations["residual_stream"][layer] - plain[i][layer][: out.activations["residual_stream"].shape[1]]
        )
        moved = moved.abs().amax(dim=-1)
        phase = case[0].phase
        if phase == "generated":  # the prompt's stream is the plain one, the generated positions moved
            assert moved[:n].max() <= 1e-5 and moved[n:].max() > 1e-2, (i, moved)
        else:
            assert moved[:n].max() > 1e-2, (i, moved)
    solo = llama.generate([PROMPTS[len(cases)]], _sp({"output_residual_stream": LAYERS}), use_tqdm=False)[0]
    mate = outs[len(cases)]
    assert list(mate.outputs[0].token_ids) == list(solo.outputs[0].token_ids)
    assert torch.equal(mate.activations["residual_stream"], solo.activations["residual_stream"])


def test_graph_and_python_paths_agree_on_ordered_ops(llama, plain, monkeypatch):
    """Several interventions at one site apply in the order given (add, ablate, cap, set, add, with a 3-D
    set at two prompt positions and phases mixed), the same on both paths, and equal HF in that order;
    the reverse order gives other numbers."""
    mean = plain[1].mean(dim=1)
    u = mean[1] / mean[1].norm()
    chain = [
        SteeringVector(_vec(3, (1, D), norm=3.0), [1], scale=2.0),
        SteeringVector(u[None], [1], op="ablate", phase="prompt"),
        SteeringVector(_vec(4, (1, D)), [1], op="cap", lo=-0.3, hi=0.4),
        SteeringVector(_vec(5, (1, 2, D), norm=6.0), [1], op="set", position_indices=[1, 3]),
        SteeringVector(_vec(6, (1, D)), [1], scale=0.5, norm_match=True, phase="generated"),
        SteeringVector(_vec(8, (2, D)), [2, 3], op="ablate"),
    ]
    fast, s1 = _run(llama, [chain], False)
    monkeypatch.setenv("VLLM_LENS_SEAMS", "0")
    slow, s2 = _run(llama, [chain], True)
    assert s1["graph_steps"] >= MAX_TOKENS and s2["graph_steps"] == 0
    for a, b in zip(fast, slow):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        x, y = a.activations["residual_stream"], b.activations["residual_stream"]
        assert (x - y).abs().max() <= 1e-4 * max(1.0, y.abs().max().item())
    check_hf(fast[0], chain)
    rev, _ = _run(llama, [chain[::-1]], False)
    check_hf(rev[0], chain[::-1])
    assert (rev[0].activations["residual_stream"][1] - fast[0].activations["residual_stream"][1]).abs().max() > 1e-2


def test_set_patches_positions_from_another_prompts_capture(llama, plain):
    """Activation patching: prompt 1's stream after layer 1 at positions 2 and 4 written into prompt 0's
    forward; downstream layers then equal HF patched the same way."""
    src = plain[1][1][[2, 4]]  # (2, d) from prompt 1 at layer 1
    sv = SteeringVector(src[None], [1], op="set", position_indices=[2, 4], phase="prompt")
    out = llama.generate([PROMPTS[0]], _sp({"apply_steering_vectors": [sv], "output_residual_stream": LAYERS}))[0]
    check_hf(out, [sv])
    got = out.activations["residual_stream"][1]
    assert torch.allclose(got[[2, 4]], src, atol=1e-5) and torch.allclose(got[3], plain[0][1][3], atol=1e-5)


def test_mean_ablation_of_heads_at_z(llama):
    """op="set" at point "z" with heads: those heads' outputs replaced by the given values (here their mean
    over the prompt, from a full z row), the other heads untouched; equals HF with the same edit."""
    prompt = PROMPTS[2]
    cap = llama.generate([prompt], _sp({"output_activations": {"z": [1]}}, max_tokens=1))[0]
    z = cap.activations["z"][0].flatten(-2)  # (n_pos, n_heads, d_head) -> z rows
    mean = z.mean(dim=0, keepdim=True)  # (1, n_heads * d_head)
    sv = SteeringVector(mean, [1], op="set", point="z", heads=[0, 2])
    out = llama.generate(
        [prompt], _sp({"apply_steering_vectors": [sv], "output_activations": {"z": [1], "resid_post": [3]}})
    )[0]
    cols = torch.cat([torch.arange(h * D_HEAD, (h + 1) * D_HEAD) for h in (0, 2)])

    def edit(point, layer, h):
        if point != "z" or layer != 1:
            return None
        h = h.clone()
        h[:, cols] = mean[0, cols]
        return h

    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = point_activations(hf_model("llama"), "llama", ids[:-1], edit)
    got = out.activations["z"][0].flatten(-2)
    assert (got - ref["z"][1]).abs().max() <= 1e-4
    assert (out.activations["resid_post"][0] - ref["resid_post"][3]).abs().max() <= 1e-4 * ref["resid_post"].abs().max()
    others = torch.cat([torch.arange(h * D_HEAD, (h + 1) * D_HEAD) for h in (1, 3)])
    n = len(out.prompt_token_ids)
    assert torch.allclose(got[:n, others], z[:n, others], atol=1e-5)
    assert torch.allclose(got[:, cols], mean[0, cols].expand(len(got), -1), atol=1e-5)


@pytest.mark.parametrize("point", ["attn_out", "mlp_out", "resid_mid", "resid_pre"])
def test_ops_at_inner_points_equal_hf(llama, point):
    """ablate (prompt) then cap (generated) at another point of the layer, against HF hooks there."""
    d1, d2 = _vec(12), _vec(13)
    svs = [
        SteeringVector(d1, [2], op="ablate", point=point, phase="prompt"),
        SteeringVector(d2, [2], op="cap", hi=0.1, point=point, phase="generated"),
    ]
    out = llama.generate(
        [PROMPTS[3]], _sp({"apply_steering_vectors": svs, "output_activations": {point: [2], "resid_post": [3]}})
    )[0]
    n = len(out.prompt_token_ids)

    def edit(p, layer, h):
        if p != point or layer != 2:
            return None
        x = h.clone()
        t = torch.arange(x.shape[0])
        for sv, rows in ((svs[0], t < n), (svs[1], t >= n)):
            idx = torch.nonzero(rows).squeeze(1)
            if len(idx):
                x = op_edit(x, sv, sv.activations[0], idx)
        return x

    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = point_activations(hf_model("llama"), "llama", ids[:-1], edit)
    scale = max(1.0, ref["resid_post"].abs().max().item())
    assert (out.activations[point][0] - ref[point][2]).abs().max() <= 1e-4 * scale
    assert (out.activations["resid_post"][0] - ref["resid_post"][3]).abs().max() <= 1e-4 * scale
    proj = out.activations[point][0] @ (d1[0] / d1.norm())
    assert (
        proj[:n].abs().max() <= 1e-4 * scale
        and (out.activations[point][0][n:] @ (d2[0] / d2.norm())).max() <= 0.1 + 1e-4
    )


def test_generated_phase_request_never_shares_prompt_cache(llama):
    """Prefix caching stays safe: a request intervening at generated positions is salted like any
    steering (vLLM caches full blocks of generated tokens too, which a later turn would read), so a plain
    request over the same text afterwards equals its solo numbers."""
    from vllm_worker.protocol.spec import RequestSpec, Steer, cache_salt

    v = torch.ones(1, D)
    plain_add = Steer([1], v, None, 1.0, False)
    gen = Steer([1], v / v.norm(), None, 1.0, False, op=1, span=(5, 1 << 62))
    salts = {cache_salt(RequestSpec("k", steers=[s])) for s in (plain_add, gen)}
    assert None not in salts and len(salts) == 2
    text = PROMPTS[0] * 6  # several cache blocks
    solo = llama.generate([text], _sp({"output_residual_stream": [3]}))[0]
    sv = SteeringVector(_vec(9, (1, D), norm=30.0), [1], op="set", phase="generated")
    steered = llama.generate([text], _sp({"apply_steering_vectors": [sv]}, max_tokens=40))[0]
    follow = text + steered.outputs[0].text
    a = llama.generate([follow], _sp(None, max_tokens=4, logprobs=1))[0]
    llama.reset_prefix_cache()
    b = llama.generate([follow], _sp(None, max_tokens=4, logprobs=1))[0]
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert max(abs(la[k].logprob - lb[k].logprob) for k in la) <= 1e-5
    again = llama.generate([text], _sp({"output_residual_stream": [3]}))[0]
    assert torch.equal(again.activations["residual_stream"], solo.activations["residual_stream"])


BAD = [
    ({"op": "cap"}, "lo"),
    ({"op": "cap", "lo": 2.0, "hi": 1.0}, "lo"),
    ({"op": "add", "lo": 1.0}, "lo"),
    ({"op": "ablate", "norm_match": True}, "norm_match"),
    ({"op": "set", "scale": 2.0}, "scale"),
    ({"op": "ablate", "activations": torch.zeros(1, D)}, "activations"),
    ({"op": "cap", "hi": 1.0, "activations": torch.zeros(1, D)}, "activations"),
    ({"op": "set", "activations": torch.ones(1, 2, D), "position_indices": [0, 99]}, "position_indices"),
    ({"op": "set", "activations": torch.ones(1, 2, D), "phase": "generated"}, "phase"),
    ({"op": "multiply"}, "op"),
    ({"phase": "decode"}, "phase"),
    ({"op": "cap", "lo": math.nan}, "lo"),
]


@pytest.mark.parametrize("fields,name", BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_combinations_name_the_field(llama, fields, name):
    """Offline: the object refuses it (a ValueError naming the field) where it can tell without the model;
    the same entry as JSON is refused by the engine naming `apply_steering_vectors[0].<field>`."""
    entry = {"activations": torch.ones(1, D), "layer_indices": [1], **fields}
    if name != "position_indices":  # (the prompt's length is known only to the engine)
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            SteeringVector(**entry)
    from vllm_worker.protocol.wire import tensor_to_json

    as_json = {**entry, "activations": tensor_to_json(entry["activations"])}
    with pytest.raises(ValueError, match=rf"apply_steering_vectors\[0\]\.{name}"):
        llama.generate([PROMPTS[0]], _sp({"apply_steering_vectors": [as_json]}, max_tokens=1), use_tqdm=False)
    ok = llama.generate([PROMPTS[0]], _sp(None, max_tokens=1), use_tqdm=False)  # still serving
    assert len(ok[0].outputs[0].token_ids) == 1


def test_model_dump_round_trip_keeps_the_op(llama, plain):
    sv = SteeringVector(plain[0].mean(dim=1)[[2]], [2], op="cap", lo=-1.0, hi=1.0, phase="generated")
    import json

    back = SteeringVector.model_validate(json.loads(json.dumps(sv.model_dump())))
    assert back == sv and back.op == "cap" and (back.lo, back.hi, back.phase) == (-1.0, 1.0, "generated")
    assert back != sv.model_copy(update={"hi": 2.0})
    a = llama.generate([PROMPTS[4]], _sp({"apply_steering_vectors": [sv], "output_residual_stream": [3]}))[0]
    b = llama.generate(
        [PROMPTS[4]], _sp({"apply_steering_vectors": [back.model_dump()], "output_residual_stream": [3]})
    )[0]
    assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
    # the defaults are today's steering: the same numbers as an entry without op / phase
    v = _vec(2, norm=4.0)
    c = llama.generate(
        [PROMPTS[4]],
        _sp({"apply_steering_vectors": [SteeringVector(v, [1], op="add", phase="all")], "output_residual_stream": [3]}),
    )[0]
    d = llama.generate(
        [PROMPTS[4]], _sp({"apply_steering_vectors": [SteeringVector(v, [1])], "output_residual_stream": [3]})
    )[0]
    assert torch.equal(c.activations["residual_stream"], d.activations["residual_stream"])


def test_named_vector_with_an_op(llama, plain):
    """A registered vector named by an entry carrying op fields: the same numbers as the tensor inline."""
    d = plain[2].mean(dim=1)[1]
    llama.register_vector("ops-dir", d)
    try:
        named = SteeringVector(name="ops-dir", layer_indices=[1, 2], op="ablate", phase="prompt")
        inline = SteeringVector(d.expand(2, D).clone(), [1, 2], op="ablate", phase="prompt")
        a, b = (
            llama.generate([PROMPTS[5]], _sp({"apply_steering_vectors": [sv], "output_residual_stream": LAYERS}))[0]
            for sv in (named, inline)
        )
        assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
        check_hf(a, [inline])
        with pytest.raises(ValueError, match="norm_match"):
            llama.generate(
                [PROMPTS[5]],
                _sp(
                    {
                        "apply_steering_vectors": [
                            {"name": "ops-dir", "layer_indices": [1], "op": "ablate", "norm_match": True}
                        ]
                    }
                ),
            )
    finally:  # (the engine is the session's: leave its registry as found)
        llama.delete_vector("ops-dir")


def test_refusal_example_removes_its_direction(llama):
    """examples/refusal_direction.py on the tiny model: the difference-of-means direction, ablated from the
    embeddings and every attention and MLP output, is gone from the stream at every layer and position,
    and the ablated answers equal HF with the same edits."""
    from support import TESTS, load_script

    ex = load_script(TESTS.parent / "examples" / "refusal_direction.py")
    d, gap = ex.refusal_direction(llama, 2, harmful=PROMPTS[:4], harmless=PROMPTS[4:8])
    assert abs(float(d.norm()) - 1.0) < 1e-5 and gap > 0
    steering = ex.ablation(d, 4)
    before = ex.max_projection(llama, PROMPTS[8:], d)
    after = ex.max_projection(llama, PROMPTS[8:], d, steering)
    assert before > 0.1 and after <= 1e-5 * before
    from vllm import SamplingParams

    msgs = [{"role": "user", "content": PROMPTS[9]}]
    out = llama.chat(
        msgs, SamplingParams(max_tokens=5, temperature=0, extra_args={"apply_steering_vectors": steering})
    )[0]

    def edit(point, layer, h):
        if point in ("attn_out", "mlp_out") or (point == "resid_pre" and layer == 0):
            return h - (h @ d)[:, None] * d
        return None

    ids = list(out.prompt_token_ids)
    for _ in range(5):
        _, logits = point_activations(hf_model("llama"), "llama", ids, edit)
        ids.append(int(logits[-1].argmax()))
    assert ids[len(out.prompt_token_ids) :] == list(out.outputs[0].token_ids)


@pytest.mark.parametrize("python_path", [False, True], ids=["graph", "python"])
def test_a_vector_spanning_ordered_and_plain_layers_applies_once(llama, python_path, monkeypatch):
    """A plain vector at layers [1, 3] beside an ablation at layer 1: layer 3 gets the addition once (the
    Python path used to add it both per request and in the batched add), on both paths, equal to HF."""
    if python_path:
        monkeypatch.setenv("VLLM_LENS_SEAMS", "0")
    svs = [SteeringVector(_vec(14), [1], op="ablate"), SteeringVector(_vec(15, (2, D), norm=5.0), [1, 3])]
    outs, _ = _run(llama, [svs], python_path)
    check_hf(outs[0], svs)


LONG = " ".join(["the water of people will come down to the side and they said"] * 4)


def test_phases_under_chunked_prefill_and_a_warm_prefix_cache(engine_factory):
    """A long prompt prefilled in 16-token chunks (with a plain batch-mate decoding beside it), its prefix
    already cached by plain requests: prompt-phase ablation, a 3-D set in the second chunk and a
    generated-phase cap each land where their phase says, equal to HF; the batch-mate equals its solo run."""
    chunked = engine_factory(
        "llama", enable_prefix_caching=True, max_num_batched_tokens=16, block_size=32, enable_chunked_prefill=True
    )
    warm = chunked.generate([LONG], _sp(None, max_tokens=2), use_tqdm=False)[0]
    assert chunked.generate([LONG], _sp(None, max_tokens=2), use_tqdm=False)[0].num_cached_tokens > 0, warm
    svs = [
        SteeringVector(_vec(16, (2, D)), [1, 2], op="ablate", phase="prompt"),
        SteeringVector(_vec(17, (1, 1, D), norm=6.0), [1], op="set", position_indices=[30]),
        SteeringVector(_vec(18), [2], op="cap", lo=-0.1, hi=0.1, phase="generated"),
    ]
    outs = chunked.generate(
        [LONG, PROMPTS[1]],
        [_sp({"apply_steering_vectors": svs, "output_residual_stream": LAYERS}), _sp({"output_residual_stream": [3]})],
        use_tqdm=False,
    )
    assert outs[0].num_cached_tokens == 0  # salted: it never reads the plain requests' KV
    check_hf(outs[0], svs)
    solo = chunked.generate([PROMPTS[1]], _sp({"output_residual_stream": [3]}), use_tqdm=False)[0]
    assert list(outs[1].outputs[0].token_ids) == list(solo.outputs[0].token_ids)
    assert torch.equal(outs[1].activations["residual_stream"], solo.activations["residual_stream"])


def test_head_scaling_by_phase(llama):
    """Head scaling (no activations) takes a phase too: head 2 zeroed at generated positions only."""
    sv = SteeringVector(None, [1], point="z", heads=[2], scale=0.0, phase="generated")
    out = llama.generate([PROMPTS[6]], _sp({"apply_steering_vectors": [sv], "output_activations": {"z": [1]}}))[0]
    n = len(out.prompt_token_ids)
    cols = torch.arange(2 * D_HEAD, 3 * D_HEAD)

    def edit(point, layer, h):
        if point != "z" or layer != 1:
            return None
        h = h.clone()
        h[n:, cols] = 0
        return h

    ids = list(out.prompt_token_ids)
    for _ in range(MAX_TOKENS):
        ref, logits = point_activations(hf_model("llama"), "llama", ids, edit)
        ids.append(int(logits[-1].argmax()))
    assert ids[n:] == list(out.outputs[0].token_ids)
    z = out.activations["z"][0].flatten(-2)
    assert (z - ref["z"][1][: len(z)]).abs().max() <= 1e-4
    assert z[n:, cols].abs().max() == 0 and z[:n, cols].abs().max() > 0


# ---------------------------------------------------------------- identical entries shared across requests


def _status(llm) -> dict:
    return llm.collective_rpc("lens_status")[0]


def test_requests_with_the_same_vector_share_entries_and_each_equals_hf(llama, plain):
    """Three requests ablating the same direction at every layer (one stopping early) and one capping
    another: the table holds one chain per distinct content (4 + 1 entries, not 13) while they run; each
    equals HF with its own edit, the one that left early changes nothing for the others, and the table is
    empty once they are gone."""
    mean = plain[0].mean(dim=1)
    ablate = [SteeringVector(mean, LAYERS, op="ablate")]
    p = (plain[0][2] @ (mean[2] / mean[2].norm())).median().item()
    cap = [SteeringVector(mean[[2]], [2], op="cap", lo=p - 0.5, hi=p - 0.2)]
    cases = [ablate, ablate, ablate, cap]
    tokens = [2, MAX_TOKENS, MAX_TOKENS, MAX_TOKENS]
    engine = llama.llm_engine
    for i, (c, n) in enumerate(zip(cases, tokens)):
        engine.add_request(f"shared-{i}", PROMPTS[i], _sp({"apply_steering_vectors": c}, max_tokens=n))
    done: dict = {}
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        s = _status(llama)
        seen.append((len(done), s["steering_entries"], s["steering_shared_chains"]))
    attach_outputs(llama, list(done.values()))  # (what `generate` does: their results are fetched, and freed)
    assert seen[0] == (0, 5, 5), seen  # 3 requests x 4 layers of one content: 4 entries; the cap: 1
    after_first = [e for n, e, _ in seen if n == 1]
    assert after_first and set(after_first) == {5}, seen  # one user left: the others still hold the chain
    hf = hf_model("llama")
    for i, c in enumerate(cases):
        prompt = list(done[f"shared-{i}"].prompt_token_ids)
        got = list(done[f"shared-{i}"].outputs[0].token_ids)
        assert len(got) == tokens[i] and got == greedy(hf, prompt, len(got), hf_edit(c, len(prompt)))
    outs = llama.generate(
        PROMPTS[:4],
        [
            _sp({"apply_steering_vectors": c, "output_residual_stream": LAYERS}, max_tokens=n)
            for c, n in zip(cases, tokens)
        ],
        use_tqdm=False,
    )
    for out, c in zip(outs, cases):
        check_hf(out, c)
    llama.generate([PROMPTS[0]], _sp({}, max_tokens=1), use_tqdm=False)  # (a worker sees leavers at its next step)
    s = _status(llama)
    assert s["steering_entries"] == 0 and s["steering_shared_chains"] == 0 and s["steer_table_full"] == 0, s
    assert s["stored_requests"] == 0 and s["request_states"] == 0, s
