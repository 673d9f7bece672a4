"""Taps: the points inside the model where the plugin reads and edits the residual stream.

One registered op, `vllm_lens::tap(hidden, residual, site)`, placed by forward hooks at the output of
every decoder layer this rank holds and at the input of its first one. The hooks are installed when the
model is loaded, before vLLM compiles it, so torch.compile traces the op into the graph (hooks added
after compilation never fire: the silent failure this design replaces), and vLLM's CUDA graphs record
what it launches.

The op does two things. (1) At a layer's output it runs the graph-safe kernel (`graph.GraphTaps`), which
reads per-step device buffers: this is how capture and steering run inside full CUDA graphs (decode
steps), with no Python in the step. (2) When called from Python it also calls the per-forward handler
(`python_path.PythonPath.on_tap`), which may do anything, per request (Python hooks). The op is one of
vLLM's piecewise `splitting_ops`, so it is called from Python between piecewise graphs. Full graphs never
call Python: steps with Python hooks replay a copy of the full graph cut at these taps (`seams`), or are
kept off full graphs (`compat.patch_cudagraph_dispatch`); eager mode calls it always.

Sites: `site = layer * SITES_PER_LAYER + code` (`protocol.points`): IN (the stream entering the first
layer of a stage; for the others it is the previous layer's OUT), OUT (leaving a layer) and, where the
family's layout is known (`compat.layouts`) and `VLLM_LENS_POINTS` asks for them, the points inside it:
forward hooks on the attention / MLP blocks and the router (`attn_out`, `mlp_out`, `router_logits`),
pre-hooks on the norm between them (`resid_mid`), the MLP block (`mlp_in`: its input, the normed stream),
the output projection (`z`) and the attention kernel (`q`, `k`). The graph kernel and the handler key everything by site. vLLM's Transformers backend runs HF layers on
`(1, tokens, d)` tensors: the taps see `(tokens, d)` views of them (edits land in the original).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_worker import compat
from vllm_worker.protocol.points import (
    ATTN_OUT,
    CODE,
    IN,
    MLP_IN,
    MLP_OUT,
    MLP_POST,
    OUT,
    RESID_MID,
    ROUTER_LOGITS,
    SITES_PER_LAYER,
    Q,
    Z,
    mlp_piece_sites,
    site,
    split_site,
)

OP = "vllm_lens::tap"  # at the residual stream between layers: one of vLLM's piecewise splitting ops
# inside a layer: the same op under another name, *not* splitting (a graph piece per inner point would
# multiply vLLM's compiled pieces and captured graphs several times over); Python runs at it only in steps
# without CUDA graphs (`LensRuntime.prepare_step`)
INNER_OP = "vllm_lens::tap_inner"
# read-only points (q, k: views into vLLM's fused qkv buffer): no mutation declared, so the compiler never
# functionalises a write into a view (which miscompiled on CPU inductor); kept from dead-code elimination
# as a side-effectful op. Nothing at those points edits the tensor (never steered; hooks read only).
READ_OP = "vllm_lens::tap_read"

Handler = Callable[[torch.Tensor, "torch.Tensor | None", int], None]
_handler: Handler | None = None
_graph: Any = None  # graph.GraphTaps of this process, if any
_recorder: Any = None  # seams.CutForward being captured: cut the graph after each tap between layers


__all__ = ["IN", "OUT", "SITES_PER_LAYER", "site", "split_site", "install", "set_handler", "set_graph", "is_inner"]


def is_inner(s: int) -> bool:
    """A site inside a layer (its tap is not a splitting op)."""
    return split_site(s)[1] not in (IN, OUT)


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


def set_recorder(rec: Any) -> Any:
    """While vLLM captures a full graph, `rec.cut(hidden, residual, site)` after each tap between layers
    (`seams.capture`); returns the previous recorder."""
    global _recorder
    prev, _recorder = _recorder, rec
    return prev


def run_handler(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    """The per-forward handler at `site`, as the tap calls it (from a replayed cut graph, `seams`)."""
    h = _handler
    if h is not None:
        h(hidden, residual, site)


def _tap_split_impl(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    _tap_impl(hidden, residual, site)
    rec = _recorder
    if rec is not None:
        rec.cut(hidden, residual, site)


def _tap_impl(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    g = _graph
    if g is not None:
        try:
            g.apply(hidden, residual, site)
        except Exception as e:  # noqa: BLE001 - the step's requests fail (runtime reads g.error); never the engine
            g.fail(e, site)
    h = _handler
    if h is not None:
        h(hidden, residual, site)


def _tap_fake(hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
    return None


# Registered through torch.library.Library (as vLLM registers its own ops), not torch.library.custom_op,
# whose Python wrappers cost several times more per call (docs/decisions.md): the op is
# called once per layer per step.
_lib = torch.library.Library("vllm_lens", "FRAGMENT")
_lib.define("tap(Tensor(a!) hidden, Tensor? residual, int site) -> ()")
_lib.impl("tap", _tap_split_impl, "CompositeExplicitAutograd")
torch.library.register_fake(OP, _tap_fake, lib=_lib)
_lib.define("tap_inner(Tensor(a!) hidden, Tensor? residual, int site) -> ()")
_lib.impl("tap_inner", _tap_impl, "CompositeExplicitAutograd")
torch.library.register_fake(INNER_OP, _tap_fake, lib=_lib)
_lib.define("tap_read(Tensor hidden, Tensor? residual, int site) -> ()")
_lib.impl("tap_read", _tap_impl, "CompositeExplicitAutograd")
torch.library.register_fake(READ_OP, _tap_fake, lib=_lib)
torch.fx.node.has_side_effect(torch.ops.vllm_lens.tap_read.default)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """(tokens, d) view of a (1, tokens, d) tensor (vLLM's Transformers backend)."""
    if t is not None and t.dim() == 3 and t.shape[0] == 1:
        return t[0]
    return t


def _out_hook(s: int) -> Callable:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden, residual = compat.residual_parts(output)
        torch.ops.vllm_lens.tap(_rows(hidden), _rows(residual), s)

    return hook


def _block_hook(s: int) -> Callable:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        torch.ops.vllm_lens.tap_inner(_rows(compat.module_output(output)), None, s)

    return hook


def _qk_hook(q_site: int, k_site: int) -> Callable:
    """Pre-hook of vLLM's attention module, called as `(q, k, v)` after the rotary embedding."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        q, k = compat.attention_inputs(args)
        torch.ops.vllm_lens.tap_read(_rows(q), None, q_site)
        torch.ops.vllm_lens.tap_read(_rows(k), None, k_site)

    return hook


def _mlp_in_hook(s: int) -> Callable:
    """Pre-hook of the MLP block, called as `(hidden,)`: the normed stream it reads (no residual beside it);
    also of the down projection (`mlp_post`: its d_mlp-wide input, one op call for all its pieces)."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        hidden = args[0] if args else None
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
            raise compat.LensIncompatibleVLLM(f"{type(module).__name__} called without its input as first argument")
        torch.ops.vllm_lens.tap_inner(_rows(hidden), None, s)

    return hook


def _in_hook(s: int, inner: bool = False) -> Callable:
    def hook(module: torch.nn.Module, args: tuple) -> None:
        hidden, residual = compat.layer_inputs(args)
        op = torch.ops.vllm_lens.tap_inner if inner else torch.ops.vllm_lens.tap
        op(_rows(hidden), _rows(residual), s)

    return hook


def install(
    layers: list[tuple[int, torch.nn.Module]], inner: dict[int, dict[str, torch.nn.Module]], mlp_chunks: int = 1
) -> list[int]:
    """Place the taps on this stage's decoder layers (before compilation: see the module docstring);
    `inner`: layer -> {point: submodule} where the layout is known; `mlp_chunks`: the d_model-wide pieces of
    an mlp_post row (one tap, a site per piece). Returns the sites placed."""
    first, module = layers[0]
    module.register_forward_pre_hook(_in_hook(site(first, IN)))
    sites = [site(first, IN)]
    for idx, module in layers:
        mods = inner.get(idx, {})
        if Q in mods:  # queries and keys entering the attention kernel
            mods[Q].register_forward_pre_hook(_qk_hook(site(idx, CODE[Q]), site(idx, CODE[Q] + 1)))
        if Z in mods:  # the heads' outputs entering the output projection
            mods[Z].register_forward_pre_hook(_in_hook(site(idx, CODE[Z]), inner=True))
        if ATTN_OUT in mods:
            mods[ATTN_OUT].register_forward_hook(_block_hook(site(idx, CODE[ATTN_OUT])))
        if RESID_MID in mods:
            mods[RESID_MID].register_forward_pre_hook(_in_hook(site(idx, CODE[RESID_MID]), inner=True))
        if MLP_IN in mods:  # registered before the router's and the MLP's hooks: it runs first
            mods[MLP_IN].register_forward_pre_hook(_mlp_in_hook(site(idx, CODE[MLP_IN])))
        if MLP_POST in mods:  # the down projection's input: act(gate) * up, (tokens, d_mlp)
            mods[MLP_POST].register_forward_pre_hook(_mlp_in_hook(site(idx, CODE[MLP_POST])))
        if ROUTER_LOGITS in mods:  # the gate's output: (tokens, n_experts)
            mods[ROUTER_LOGITS].register_forward_hook(_block_hook(site(idx, CODE[ROUTER_LOGITS])))
        if MLP_OUT in mods:
            mods[MLP_OUT].register_forward_hook(_block_hook(site(idx, CODE[MLP_OUT])))
        module.register_forward_hook(_out_hook(site(idx, OUT)))
        if Q in mods:
            sites += [site(idx, CODE[Q]), site(idx, CODE[Q] + 1)]  # q and k
        sites += [site(idx, CODE[p]) for p in (Z, ATTN_OUT, RESID_MID, MLP_IN, ROUTER_LOGITS, MLP_OUT) if p in mods]
        if MLP_POST in mods:  # the tap's own site (hooks) and its pieces' (capture, steering)
            sites += [site(idx, CODE[MLP_POST]), *mlp_piece_sites(idx, mlp_chunks)]
        sites.append(site(idx, OUT))
    return sorted(sites)
