"""Hook functions and checks shared by the parallel-layout tests (TP, PP, EP, Ray): importable by the
worker processes, which load `support` from the PYTHONPATH the tests give them."""

from __future__ import annotations

from vllm import SamplingParams

from vllm_worker import Hook

PROMPT = "the water of people will come down to the side"


def ablate(dim: int):
    """A hook zeroing one dimension of the stream, recording the layers it ran at."""

    def fn(ctx, h):
        ctx.saved.setdefault("layers", []).append(ctx.layer_idx)
        h = h.clone()
        h[:, dim] = 0
        return h

    return fn


def steer_then_ablate_edit(v, steer_layer: int = 1, ablate_layer: int = 2, dim: int = 3):
    """The HF edit (`reference.point_activations`) equal to `SteeringVector(v, [steer_layer])` plus
    `Hook(ablate(dim), [ablate_layer])`, both at resid_post."""

    def edit(point, layer, h):
        if (point, layer) == ("resid_post", steer_layer):
            return h + v[0]
        if (point, layer) == ("resid_post", ablate_layer):
            h = h.clone()
            h[..., dim] = 0
            return h
        return None

    return edit


def lens_top5(ctx, h):
    """A logit lens through `ctx.get_parameter`: the full (gathered) lm_head and final norm."""
    import torch

    w = ctx.get_parameter("lm_head.weight")
    g = ctx.get_parameter("model.norm.weight")
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    ctx.saved.setdefault("top", []).append((x @ w.T).topk(5, dim=-1).indices.cpu())
    ctx.saved.setdefault("w_shape", tuple(w.shape))


def _record_rows(ctx, h):
    ctx.saved.setdefault("rows", []).append(ctx.seq_len)


def check_persistent_hooks(llm) -> None:
    """A persistent hook runs once per step on every request, is collected once (not once per rank), and
    clearing leaves nothing stored on any rank."""
    llm.clear_hooks()
    llm.register_hooks([Hook(_record_rows, [0])])
    llm.generate([PROMPT, PROMPT + " a"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    res = llm.collect_hook_results()
    assert len(res) == 2 and all(len(r["0"]["rows"]) == 3 for r in res.values())
    llm.clear_hooks()
    assert all(s["stored_requests"] == 0 for s in llm.collective_rpc("lens_status"))
