"""`Hook(read_only=True)`: when every hook of a step only reads, the taps copy the stream and the hooks run
after the step's forward (`runtime._defer`). They must see exactly what hooks at their taps see, on the
Python path and on the graph path (seams), with captured, steered and plain batch-mates, and equal HF."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from support.reference import hf_model, residuals
from vllm_worker import Hook, HookError, SteeringVector
from vllm_worker.counters import STEP_TIMINGS

D = 128
PROMPTS = [
    "the water of people will come down to the side of the first",
    "a long thing to see him",
    "they said the first people could",
    "more day could go come did number sound",
]


def _record(ctx, h):
    """Per request: each call's layer, point, absolute positions and rows (on the host)."""
    ctx.saved.setdefault("calls", []).append((ctx.layer_idx, ctx.point, ctx.positions.cpu(), h.detach().cpu().clone()))


def _norms_batched(ctx, h):
    norms = h.norm(dim=-1)
    for rid, s, e in ctx.rows:
        ctx.saved[rid].setdefault("norms", []).append(norms[s:e].cpu())


def _sp(extra: dict | None) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, extra_args=extra)


def _extras(read_only: bool) -> list[dict | None]:
    steer = [SteeringVector(torch.randn(1, D, generator=torch.Generator().manual_seed(3)) * 3, [1], scale=0.7)]
    hooks = [Hook(_record, [0, 2], read_only=read_only), Hook(_record, [1], pre=True, read_only=read_only)]
    return [
        {"apply_hooks": hooks},
        {"apply_steering_vectors": steer, "output_residual_stream": [1, 3]},  # steered before layer 2's hook
        {"apply_hooks": [Hook(_norms_batched, [3], batched=True, read_only=read_only)], "output_residual_stream": [0]},
        None,
    ]


def _run(llm, extras: list) -> tuple[list, int]:
    before = STEP_TIMINGS["deferred_sites"]
    outs = llm.generate(PROMPTS[: len(extras)], [_sp(e) for e in extras], use_tqdm=False)
    return outs, STEP_TIMINGS["deferred_sites"] - before


@pytest.mark.parametrize("seams", ["1", "0"], ids=["graph-path", "python-path"])
def test_read_only_hooks_run_after_the_forward_and_see_what_hooks_at_their_taps_see(llama, monkeypatch, seams):
    monkeypatch.setenv("VLLM_LENS_SEAMS", seams)
    deferred, n_deferred = _run(llama, _extras(True))
    inline, n_inline = _run(llama, _extras(False))
    assert n_deferred >= 6 * 3 and n_inline == 0  # prefill + 5 decode steps; three hooked sites each
    for a, b in zip(deferred, inline):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and max(abs(la[k].logprob - lb[k].logprob) for k in la) <= 1e-5
        if a.activations is not None:
            assert torch.equal(a.activations["residual_stream"], b.activations["residual_stream"])
    ca, cb = deferred[0].hook_results, inline[0].hook_results
    for key in ("0", "1"):
        assert len(ca[key]["calls"]) == len(cb[key]["calls"]) >= 6
        for (la, pa, posa, ha), (lb, pb, posb, hb) in zip(ca[key]["calls"], cb[key]["calls"]):
            assert (la, pa) == (lb, pb) and torch.equal(posa, posb) and torch.equal(ha, hb)
    na, nb = deferred[2].hook_results["0"]["norms"], inline[2].hook_results["0"]["norms"]
    assert len(na) == len(nb) >= 6 and all(torch.equal(x, y) for x, y in zip(na, nb))

    # and what the deferred hooks read is the stream HF computes (layer 2 out; layer 1 in = layer 0 out)
    out = deferred[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _ = residuals(hf_model("llama"), ids[:-1])
    for layer, src in ((2, "0"), (0, "0"), (1, "1")):
        calls = [c for c in out.hook_results[src]["calls"] if c[0] == layer]
        pos = torch.cat([c[2] for c in calls])
        rows = torch.cat([c[3] for c in calls])
        want = ref[layer - 1 if src == "1" else layer]
        assert torch.equal(pos, torch.arange(len(ids) - 1))
        assert (rows - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def _returns_a_tensor(ctx, h):
    return h * 2


def test_a_read_only_hook_that_returns_a_tensor_fails_only_its_request(llama):
    baseline = llama.generate(PROMPTS[1:3], [_sp(None)] * 2, use_tqdm=False)
    with pytest.raises(HookError) as exc:
        llama.generate(
            PROMPTS[:3],
            [_sp({"apply_hooks": [Hook(_returns_a_tensor, [1], read_only=True)]}), _sp(None), _sp(None)],
            use_tqdm=False,
        )
    bad, *ok = exc.value.outputs
    assert bad.hook_error is not None and "read_only hook returned a tensor" in str(exc.value)
    for o, b in zip(ok, baseline):
        assert o.hook_error is None and list(o.outputs[0].token_ids) == list(b.outputs[0].token_ids)


def _double(ctx, h):
    return h * 2


def test_one_writing_hook_keeps_every_hook_of_the_step_at_its_tap(llama):
    """A request's hooks share `ctx.saved`, and a writing hook changes what later ones read: with any
    writing hook in the step nothing is deferred, and the read-only hook reads the edited stream."""
    extras = [{"apply_hooks": [Hook(_double, [1]), Hook(_record, [1, 2], read_only=True)]}, None]
    outs, n = _run(llama, extras)
    assert n == 0
    alone, _ = _run(llama, [{"apply_hooks": [Hook(_record, [1, 2])]}, None])
    first_edited, first_alone = outs[0].hook_results["1"]["calls"][0], alone[0].hook_results["0"]["calls"][0]
    assert first_edited[0] == 1 and torch.allclose(first_edited[3], 2 * first_alone[3], rtol=1e-5)


def test_persistent_read_only_hooks_are_deferred_too(llama):
    llama.clear_hooks()
    results = {}
    for read_only in (True, False):
        llama.register_hooks([Hook(_norms_batched, [2], batched=True, read_only=read_only)])
        try:
            _, n = _run(llama, [None, None])
            results[read_only] = (n, llama.collect_hook_results())
        finally:
            llama.clear_hooks()
    assert results[True][0] >= 6 and results[False][0] == 0
    got, want = results[True][1], results[False][1]
    assert len(got) == len(want) == 2

    def by_prompt(res: dict) -> list:  # request ids differ between the runs: order by prefill length
        return sorted((v["0"]["norms"] for v in res.values()), key=lambda n: n[0].numel())

    for x, y in zip(by_prompt(got), by_prompt(want)):
        assert len(x) == len(y) >= 6 and all(torch.equal(p, q) for p, q in zip(x, y))
