"""Per-request state (decoded once) and the per-step plan (rebuilt before every forward pass).

The plan turns "which requests sit in which rows of this batch" into what each tap site needs: device
row indices for capture, one batched add per layer for simple steering, and the (request, rows) lists for
the work that stays per request (positional / norm-matched steering, Python hooks). Rows of batch entry j
are `qsl[j]:qsl[j+1]`; built with numpy, no per-request Python work on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .hooks import HookContext


@dataclass
class DeviceSteer:
    layers: dict[int, int]  # layer -> row of vectors
    vectors: torch.Tensor  # on device, model dtype
    lut: torch.Tensor | None  # position -> row in vectors[:, row] (or -1); None for 2-D
    scale: float
    norm_match: bool


@dataclass
class HookRun:
    fn: Callable
    layers: frozenset
    pre: bool
    ctx: HookContext
    index: int
    persistent: bool


@dataclass(eq=False)
class RequestState:
    capture: list[int]  # layers captured (sorted)
    capture_slot: dict[int, int]  # layer -> index in `capture`
    child: int
    steers: list[DeviceSteer]  # steering that needs per-request work (positions, norm_match)
    hooks: list[HookRun]
    store: "object | None"  # store.Store: where results go (None: steering only)
    # layer -> (1, d) sum of this request's position-independent, non-norm-matched vectors there;
    # such layers are steered for the whole batch with one index_add_ (`StepPlan.steer_batched`)
    simple_add: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.store is not None and self.store.error is not None


Rows = list[tuple[RequestState, int, int]]  # (request, start row, end row)


@dataclass
class StepPlan:
    """Built once per batch composition (decode steps with the same requests reuse it); `begin_step`
    resets the per-step part."""

    positions: torch.Tensor
    steer: dict[int, Rows]  # layer -> requests with per-request steering there
    steer_batched: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (rows, (rows, d) adds)
    capture: dict[int, tuple[torch.Tensor, Rows]]  # layer -> (row index on device, requests)
    hooks: dict[tuple[int, bool], Rows]  # (layer, pre) -> requests with hooks there
    captured: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    fired: int = 0  # tap calls seen during the forward (0 with work planned = taps were skipped)
    logs: dict = field(default_factory=dict)  # layer -> store.CaptureLog (store.CaptureStore.open_plan)

    def begin_step(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.captured = []
        self.fired = 0


def split_steers(steers: list[DeviceSteer]) -> tuple[list[DeviceSteer], dict[int, torch.Tensor]]:
    """(steers needing per-request work, {layer: summed simple add}). A layer where any vector is
    positional or norm-matched keeps all its vectors per request (their order of application matters)."""
    complex_layers = {l for st in steers if st.lut is not None or st.norm_match for l in st.layers}
    simple: dict[int, torch.Tensor] = {}
    for st in steers:
        for layer, row in st.layers.items():
            if layer not in complex_layers:
                add = st.vectors[row].unsqueeze(0) * st.scale
                simple[layer] = add if layer not in simple else simple[layer] + add
    return ([st for st in steers if set(st.layers) & complex_layers],
            {l: v.contiguous() for l, v in simple.items()})


def make_plan(active: Rows, positions: torch.Tensor, capturing_rank: bool, local: frozenset) -> StepPlan:
    """`local`: the layers this pipeline stage holds (captures of other stages' layers are theirs)."""
    steer: dict[int, Rows] = {}
    simple: dict[int, Rows] = {}
    cap_rows: dict[int, Rows] = {}
    hooks: dict[tuple[int, bool], Rows] = {}
    for item in active:
        r = item[0]
        for st in r.steers:
            for layer in st.layers:
                steer.setdefault(layer, []).append(item)
        for layer in r.simple_add:
            simple.setdefault(layer, []).append(item)
        for h in r.hooks:
            for layer in h.layers:
                hooks.setdefault((layer, h.pre), []).append(item)
        if capturing_rank:
            for layer in r.capture:
                if layer in local:
                    cap_rows.setdefault(layer, []).append(item)

    def on_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(positions.device, non_blocking=True)

    def rows_of(items: Rows) -> np.ndarray:
        return np.concatenate([np.arange(s, e) for _, s, e in items])

    capture = {layer: (on_device(rows_of(items)), items) for layer, items in cap_rows.items()}
    batched = {}
    for layer, items in simple.items():
        rows = rows_of(items)
        adds = torch.cat([r.simple_add[layer] for r, _, _ in items])  # (n_req, d) on device
        if len(rows) != len(items):  # prefill chunks: one add per row
            adds = adds.index_select(0, on_device(np.repeat(np.arange(len(items)), [e - s for _, s, e in items])))
        batched[layer] = (on_device(rows), adds)
    # a request is listed once per layer even if several of its vectors/hooks act there
    steer = {l: list(dict.fromkeys(v)) for l, v in steer.items()}
    hooks = {k: list(dict.fromkeys(v)) for k, v in hooks.items()}
    return StepPlan(positions, steer, batched, capture, hooks)
