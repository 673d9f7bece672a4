"""Taps: the points inside the model where the plugin reads and edits the residual stream.

One registered op, `vllm_lens::tap(hidden, residual, site)`, placed by forward hooks at the output of
every decoder layer this rank holds and at the input of its first one. The hooks are installed when the
model is loaded, before vLLM compiles it, so torch.compile traces the op into the graph (hooks added
after compilation never fire: the silent failure this design replaces). In vLLM's piecewise CUDA-graph
mode the op is one of the `splitting_ops`, so it runs eagerly between graph pieces and may do dynamic,
per-step work; a full-graph replay would skip it, which is why steps that use a feature are dispatched
away from full graphs (`adapter.patch_cudagraph_dispatch`). With no feature active the op returns at once
and, inside a captured full graph, costs nothing.

Sites: `site = layer * SITES_PER_LAYER + point`. Points today: IN (the stream entering a layer; placed
only on the first layer of a stage: for the others it is the previous layer's OUT) and OUT (the stream
leaving a layer). A further point inside a layer (attention output, MLP output, mid-layer residual) is a
new point number placed by a new hook; the handler and the plan already key everything by site.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import adapter

OP = "vllm_lens::tap"
IN, OUT = 0, 1
SITES_PER_LAYER = 8

Handler = Callable[[torch.Tensor, "torch.Tensor | None", int], None]
_handler: Handler | None = None


def site(layer: int, point: int) -> int:
    return layer * SITES_PER_LAYER + point


def split_site(s: int) -> tuple[int, int]:
    return divmod(s, SITES_PER_LAYER)


def set_handler(fn: Handler | None) -> Handler | None:
    """Install the per-forward handler (the runtime whose plan is running); returns the previous one."""
    global _handler
    prev, _handler = _handler, fn
    return prev


def _tap_impl(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    h = _handler
    if h is not None:
        h(hidden, residual, site)


def _tap_fake(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    return None


# Registered through torch.library.Library (as vLLM registers its own ops): a call costs ~3 us here,
# against ~25 us through torch.library.custom_op's Python wrappers (measured), and the op is called once
# per layer per step.
_lib = torch.library.Library("vllm_lens", "FRAGMENT")
_lib.define("tap(Tensor(a!) hidden, Tensor? residual, int site) -> ()")
_lib.impl("tap", _tap_impl, "CompositeExplicitAutograd")
torch.library.register_fake(OP, _tap_fake, lib=_lib)


def _out_hook(layer: int) -> Callable:
    s = site(layer, OUT)

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden, residual = adapter.residual_parts(output)
        torch.ops.vllm_lens.tap(hidden, residual, s)

    return hook


def _in_hook(layer: int) -> Callable:
    s = site(layer, IN)

    def hook(module: torch.nn.Module, args: tuple) -> None:
        hidden, residual = adapter.layer_inputs(args)
        torch.ops.vllm_lens.tap(hidden, residual, s)

    return hook


def install(layers: list[tuple[int, torch.nn.Module]]) -> None:
    """Place the taps on this stage's decoder layers (before compilation: see the module docstring)."""
    first, module = layers[0]
    module.register_forward_pre_hook(_in_hook(first))
    for idx, module in layers:
        module.register_forward_hook(_out_hook(idx))
