"""Taps: the points inside the model where the plugin reads and edits the residual stream.

One registered op, `vllm_lens::tap(hidden, residual, site)`, placed by forward hooks at the output of
every decoder layer this rank holds and at the input of its first one. The hooks are installed when the
model is loaded, before vLLM compiles it, so torch.compile traces the op into the graph (hooks added
after compilation never fire: the silent failure this design replaces), and vLLM's CUDA graphs record
what it launches.

The op does two things. (1) At a layer's output it runs the graph-safe kernel (`graph.GraphTaps`), which
reads per-step device buffers: this is how capture and steering run inside full CUDA graphs (decode
steps), with no Python in the step. (2) When called from Python it also calls the per-forward handler
(`runtime.LensRuntime.on_tap`), which may do anything, per request (Python hooks). The op is one of
vLLM's piecewise `splitting_ops`, so it is called from Python between piecewise graphs, and steps with
Python hooks are kept off full graphs (`compat.patch_cudagraph_dispatch`); eager mode calls it always.

Sites: `site = layer * SITES_PER_LAYER + point`. Points today: IN (the stream entering a layer; placed
only on the first layer of a stage: for the others it is the previous layer's OUT) and OUT (the stream
leaving a layer). A further point inside a layer (attention output, MLP output, mid-layer residual) is a
new point number placed by a new hook; the handler and the plan already key everything by site.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_worker import compat

OP = "vllm_lens::tap"
IN, OUT = 0, 1
SITES_PER_LAYER = 8

Handler = Callable[[torch.Tensor, "torch.Tensor | None", int], None]
_handler: Handler | None = None
_graph: Any = None  # graph.GraphTaps of this process, if any


def site(layer: int, point: int) -> int:
    return layer * SITES_PER_LAYER + point


def split_site(s: int) -> tuple[int, int]:
    return divmod(s, SITES_PER_LAYER)


def set_handler(fn: Handler | None) -> Handler | None:
    """Install the per-forward handler (the runtime whose plan is running); returns the previous one."""
    global _handler
    prev, _handler = _handler, fn
    return prev


def set_graph(g: Any) -> Any:
    """Install the graph-safe buffers the taps act on; returns the previous ones."""
    global _graph
    prev, _graph = _graph, g
    return prev


def _tap_impl(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    g = _graph
    if g is not None and site % SITES_PER_LAYER == OUT:
        g.apply(hidden, residual, site // SITES_PER_LAYER)
    h = _handler
    if h is not None:
        h(hidden, residual, site)


def _tap_fake(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    return None


# Registered through torch.library.Library (as vLLM registers its own ops), not torch.library.custom_op,
# whose Python wrappers cost several times more per call (docs/internals.md#measured-reasons): the op is
# called once per layer per step.
_lib = torch.library.Library("vllm_lens", "FRAGMENT")
_lib.define("tap(Tensor(a!) hidden, Tensor? residual, int site) -> ()")
_lib.impl("tap", _tap_impl, "CompositeExplicitAutograd")
torch.library.register_fake(OP, _tap_fake, lib=_lib)


def _out_hook(layer: int) -> Callable:
    s = site(layer, OUT)

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden, residual = compat.residual_parts(output)
        torch.ops.vllm_lens.tap(hidden, residual, s)

    return hook


def _in_hook(layer: int) -> Callable:
    s = site(layer, IN)

    def hook(module: torch.nn.Module, args: tuple) -> None:
        hidden, residual = compat.layer_inputs(args)
        torch.ops.vllm_lens.tap(hidden, residual, s)

    return hook


def install(layers: list[tuple[int, torch.nn.Module]]) -> None:
    """Place the taps on this stage's decoder layers (before compilation: see the module docstring)."""
    first, module = layers[0]
    module.register_forward_pre_hook(_in_hook(first))
    for idx, module in layers:
        module.register_forward_hook(_out_hook(idx))
