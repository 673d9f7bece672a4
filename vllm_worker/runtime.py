"""Worker side: per forward pass, find the rows of requests that asked for something, steer and
capture them at the decoder-layer outputs, and keep captures until the frontend fetches them.

Hot-path rules: one Python check per layer when nobody in the batch uses a feature; when someone
does, device work is batched per layer and captures cross to the host in one copy per step.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from . import adapter
from .hooks import HookContext
from .spec import PAYLOAD_KEY, RequestSpec, decode
from .wire import tensor_to_bytes

logger = logging.getLogger("vllm_worker")

# Captures kept in the worker until fetched. Past the cap the oldest are dropped and a later fetch of
# them reports it (an error, never a silent empty result).
MAX_STORED_BYTES = int(float(os.environ.get("VLLM_LENS_MAX_STORED_GB", "8")) * (1 << 30))
# Capture chunks kept on the GPU before one batched spill to host memory (see LensRuntime._spill).
GPU_STAGING_BYTES = int(float(os.environ.get("VLLM_LENS_GPU_STAGING_MB", "1024")) * (1 << 20))
# Requests whose persistent-hook results are kept until `clear_hook_results`. Past it, new requests
# fail with an error that says so (never a silent drop).
MAX_PERSISTENT_RESULTS = int(os.environ.get("VLLM_LENS_MAX_PERSISTENT_RESULTS", "10000"))


@dataclass
class _DeviceSteer:
    layers: dict[int, int]  # layer -> row of vectors
    vectors: torch.Tensor  # on device, model dtype
    lut: torch.Tensor | None  # position -> row in vectors[:, row] (or -1); None for 2-D
    scale: float
    norm_match: bool


@dataclass
class _Store:
    """Everything a request hands back: captures, hook state, and the first failure."""

    layers: list[int]
    chunks: list[tuple[int, np.ndarray, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    saved: list[dict] = field(default_factory=list)
    error: str | None = None


@dataclass
class _HookRun:
    fn: Callable
    layers: frozenset
    pre: bool
    ctx: HookContext
    index: int
    persistent: bool


@dataclass(eq=False)
class _Req:
    spec: RequestSpec | None
    child: int
    steers: list[_DeviceSteer]
    capture_slot: dict[int, int]
    hooks: list[_HookRun]
    store: _Store | None
    # layer -> (1, d) sum of this request's position-independent, non-norm-matched vectors there;
    # such layers are steered for the whole batch with one index_add_ (`_Plan.steer_batched`)
    simple_add: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.store is not None and self.store.error is not None


@dataclass
class _Plan:
    positions: torch.Tensor
    # layer -> list of (req, start, end): steering that needs per-request work (positions, norm_match)
    steer: dict[int, list[tuple[_Req, int, int]]]
    # layer -> (row index tensor, per-row add (rows, d)): all simple steering at that layer, batched
    steer_batched: dict[int, tuple[torch.Tensor, torch.Tensor]]
    # layer -> (row index tensor on device, [(req, start, end)])
    capture: dict[int, tuple[torch.Tensor, list[tuple[_Req, int, int]]]]
    # (layer, pre) -> [(req, start, end)]
    hooks: dict[tuple[int, bool], list[tuple[_Req, int, int]]]
    captured: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LensRuntime:
    """Installed on a model runner once its model is loaded."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model = adapter.runner_model(runner)
        self.layers = list(adapter.iter_stage_layers(runner))
        self.layer_ids = [i for i, _ in self.layers]
        self.tp_rank = adapter.tp_rank()
        self.capturing_rank = self.tp_rank == 0
        p = next(self.model.parameters())
        self.device = p.device
        self.dtype = p.dtype if p.is_floating_point() else torch.float32
        self._reqs: dict[str, _Req | None] = {}
        self._store: dict[tuple[str, int], _Store] = {}
        self._evicted: set[str] = set()
        self._stored_bytes = 0
        self._lock = threading.Lock()
        self._plan: _Plan | None = None
        self._staged_bytes = 0  # capture chunks still on the device (CUDA), see _spill
        self.steps_with_features = 0
        # persistent hooks (all requests), their results by caller request id, prefetched params
        self._persistent: list[tuple[Callable, frozenset, bool]] = []
        self._persistent_results: dict[str, list[dict]] = {}
        self._persistent_errors: dict[str, str] = {}
        self._prefetched: dict[str, torch.Tensor] = {}
        for idx, module in self.layers:
            module.register_forward_hook(self._make_post_hook(idx))
            module.register_forward_pre_hook(self._make_pre_hook(idx))
        logger.info("inspect-lens: hooked %d decoder layers (%s..%s) on TP rank %d",
                    len(self.layers), self.layer_ids[0], self.layer_ids[-1], self.tp_rank)

    # ---------------------------------------------------------------- per request state

    def _request(self, req_id: str) -> _Req | None:
        try:
            return self._reqs[req_id]
        except KeyError:
            pass
        args = adapter.request_extra_args(self.runner, req_id)
        payload = None if not args else args.get(PAYLOAD_KEY)
        req = None
        if payload is not None or self._persistent:
            req = self._new_request(req_id, payload)
        self._reqs[req_id] = req
        return req

    def _new_request(self, req_id: str, payload: Any) -> _Req:
        import cloudpickle

        spec = None if payload is None else decode(payload)
        n = 1 if payload is None else int(payload.get("n", 1))
        child = adapter.child_index(req_id, n)
        external = adapter.external_request_id(req_id, n)
        steers = []
        hooks: list[_HookRun] = []
        store = None
        if spec is not None:
            for s in spec.steers:
                lut = None
                if s.positions is not None:
                    lut = torch.full((max(s.positions) + 1,), -1, dtype=torch.long)
                    lut[torch.tensor(s.positions)] = torch.arange(len(s.positions))
                    lut = lut.to(self.device)
                steers.append(_DeviceSteer({l: i for i, l in enumerate(s.layers)},
                                           s.vectors.to(self.device, self.dtype), lut, s.scale, s.norm_match))
            if spec.wants_results:
                store = _Store(spec.capture)
                with self._lock:
                    self._store[(spec.key, child)] = store
            for i, h in enumerate(spec.hooks):
                saved: dict = {}
                store.saved.append(saved)
                hooks.append(_HookRun(cloudpickle.loads(h.fn), frozenset(h.layers), h.pre,
                                      self._ctx(saved, external), i, False))
        if self._persistent:
            if store is None:
                store = _Store([])
            if len(self._persistent_results) >= MAX_PERSISTENT_RESULTS:
                store.error = (f"persistent hook results are full ({MAX_PERSISTENT_RESULTS} requests, "
                               "VLLM_LENS_MAX_PERSISTENT_RESULTS): call collect_hook_results() then "
                               "clear_hook_results()")
                self._persistent_errors[external] = store.error
            else:
                persistent_saved = [{} for _ in self._persistent]
                self._persistent_results[external] = persistent_saved
                for i, (fn, layers, pre) in enumerate(self._persistent):
                    hooks.append(_HookRun(fn, layers, pre, self._ctx(persistent_saved[i], external), i, True))
        simple: dict[int, torch.Tensor] = {}
        complex_layers = {l for st in steers if st.lut is not None or st.norm_match for l in st.layers}
        for st in steers:
            for layer, row in st.layers.items():
                if layer not in complex_layers:
                    add = st.vectors[row].unsqueeze(0) * st.scale
                    simple[layer] = add if layer not in simple else simple[layer] + add
        return _Req(spec, child, [st for st in steers if set(st.layers) & complex_layers],
                    {} if spec is None else {l: i for i, l in enumerate(spec.capture)}, hooks, store,
                    {l: v.contiguous() for l, v in simple.items()})

    def _ctx(self, saved: dict, external: str) -> HookContext:
        return HookContext(saved=saved, request_id=external, tp_rank=self.tp_rank, model=self.model,
                           _params=self.get_parameter)

    def _prune(self) -> None:
        live = adapter.live_request_ids(self.runner)
        if len(self._reqs) > len(live):
            for rid in [r for r in self._reqs if r not in live]:
                del self._reqs[rid]

    # ---------------------------------------------------------------- forward pass

    def around_forward(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        self._prune()
        plan = self._make_plan(kwargs.get("positions"))
        if plan is None:
            return orig(self.runner, *args, **kwargs)
        self._plan = plan
        try:
            out = orig(self.runner, *args, **kwargs)
        finally:
            self._plan = None
        self.steps_with_features += 1
        if plan.captured:
            self._finish_capture(plan)
        return out

    def _make_plan(self, positions: torch.Tensor | None) -> _Plan | None:
        req_ids, qsl = adapter.batch_layout(self.runner)
        active = []
        for j, rid in enumerate(req_ids):
            if rid is None:
                continue
            r = self._request(rid)
            if r is not None:
                s, e = int(qsl[j]), int(qsl[j + 1])
                if e > s:
                    active.append((r, s, e))
        if not active:
            return None
        if positions is None:
            raise adapter.LensIncompatibleVLLM("forward pass without `positions`")
        steer: dict[int, list] = {}
        simple: dict[int, list] = {}
        cap_rows: dict[int, list] = {}
        hooks: dict[tuple[int, bool], list] = {}
        for r, s, e in active:
            for st in r.steers:
                for layer in st.layers:
                    if layer not in r.simple_add:
                        steer.setdefault(layer, []).append((r, s, e))
            for layer in r.simple_add:
                simple.setdefault(layer, []).append((r, s, e))
            for h in r.hooks:
                for layer in h.layers:
                    hooks.setdefault((layer, h.pre), []).append((r, s, e))
            if self.capturing_rank and r.spec is not None:
                for layer in r.spec.capture:
                    cap_rows.setdefault(layer, []).append((r, s, e))
        def on_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(positions.device, non_blocking=True)

        def rows_of(items: list) -> np.ndarray:
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
        return _Plan(positions, steer, batched, capture, hooks)

    def _make_pre_hook(self, layer: int):
        def pre_hook(module: torch.nn.Module, args: tuple) -> None:
            plan = self._plan
            if plan is None:
                return None
            items = plan.hooks.get((layer, True))
            if items:
                hidden, residual = adapter.layer_inputs(args)
                self._run_hooks(layer, True, plan, hidden, residual, items)
            return None

        return pre_hook

    def _make_post_hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            plan = self._plan
            if plan is None:
                return None
            hidden, residual = adapter.residual_parts(output)
            batched = plan.steer_batched.get(layer)
            if batched is not None:
                hidden.index_add_(0, batched[0], batched[1].to(hidden.dtype))
            items = plan.steer.get(layer)
            if items:
                self._steer(layer, plan, hidden, residual, items)
            items = plan.hooks.get((layer, False))
            if items:
                self._run_hooks(layer, False, plan, hidden, residual, items)
            cap = plan.capture.get(layer)
            if cap is not None:
                idx = cap[0]
                rows = hidden.index_select(0, idx)
                if residual is not None:
                    rows = rows + residual.index_select(0, idx)
                plan.captured.append((layer, rows))
            return None

        return hook

    def _run_hooks(self, layer: int, pre: bool, plan: _Plan, hidden: torch.Tensor,
                   residual: torch.Tensor | None, items: list[tuple[_Req, int, int]]) -> None:
        """Run each request's hooks on its own rows; a failure fails that request only."""
        for r, s, e in items:
            for h in r.hooks:
                if h.pre != pre or layer not in h.layers or r.failed:
                    continue
                stream = hidden[s:e] + residual[s:e] if residual is not None else hidden[s:e].clone()
                ctx = h.ctx
                ctx.layer_idx, ctx.seq_len, ctx.positions = layer, e - s, plan.positions[s:e].clone()
                try:
                    new = h.fn(ctx, stream)
                    if new is None:
                        continue
                    if not isinstance(new, torch.Tensor):
                        raise TypeError(f"hook returned {type(new).__name__}, expected a Tensor or None")
                    if new.shape != stream.shape or new.dtype != stream.dtype or new.device != stream.device:
                        raise TypeError(
                            f"hook returned shape {tuple(new.shape)} {new.dtype} on {new.device}; expected "
                            f"{tuple(stream.shape)} {stream.dtype} on {stream.device} (the rows it was given)")
                except Exception:
                    kind = "persistent hook" if h.persistent else "hook"
                    msg = (f"{kind} {h.index} ({'pre' if pre else 'post'}-hook at layer {layer}) failed:\n"
                           + traceback.format_exc())
                    if r.store is None:
                        r.store = _Store([])
                    r.store.error = msg
                    if h.persistent:
                        self._persistent_errors[ctx.request_id] = msg
                    logger.warning("inspect-lens: %s", msg)
                    break
                if residual is not None:
                    hidden[s:e] = new - residual[s:e]
                else:
                    hidden[s:e] = new

    def _steer(self, layer: int, plan: _Plan, hidden: torch.Tensor, residual: torch.Tensor | None,
               items: list[tuple[_Req, int, int]]) -> None:
        for r, s, e in items:
            stream = None
            delta = None
            for st in r.steers:
                row = st.layers.get(layer)
                if row is None:
                    continue
                if st.lut is None:
                    v = st.vectors[row].unsqueeze(0)  # (1, d)
                    mask = None
                else:
                    pos = plan.positions[s:e]
                    n = st.lut.shape[0]
                    vi = st.lut[pos.clamp(max=n - 1)]
                    mask = ((pos < n) & (vi >= 0)).unsqueeze(1)
                    v = st.vectors[row].index_select(0, vi.clamp(min=0))  # (rows, d)
                if st.norm_match:
                    if stream is None:
                        stream = hidden[s:e] if residual is None else hidden[s:e] + residual[s:e]
                        stream = stream.norm(dim=-1, keepdim=True)
                    v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12) * stream
                add = v * st.scale
                if mask is not None:
                    add = add * mask
                delta = add if delta is None else delta + add
            if delta is not None:
                hidden[s:e] += delta.to(hidden.dtype)

    def _finish_capture(self, plan: _Plan) -> None:
        layers = [l for l, _ in plan.captured]
        sizes = [t.shape[0] for _, t in plan.captured]
        dev = torch.cat([t for _, t in plan.captured])
        all_idx = torch.cat([plan.capture[l][0] for l in layers])
        pos_dev = plan.positions.index_select(0, all_idx)
        if dev.is_cuda:
            # stay on the device (no sync per step); spilled to host in one copy when the staging budget
            # is full or at fetch (_spill)
            host, pos_host = dev, pos_dev
            self._staged_bytes += dev.numel() * dev.element_size()
        else:
            host = dev.to("cpu")
            pos_host = pos_dev.to("cpu").numpy()
        off = 0
        with self._lock:
            for layer, size in zip(layers, sizes):
                block = host[off:off + size]
                pblock = pos_host[off:off + size]
                o = 0
                for r, s, e in plan.capture[layer][1]:
                    n = e - s
                    st = r.store
                    view = block[o:o + n]
                    st.chunks.append((r.capture_slot[layer], pblock[o:o + n], view))
                    nb = view.numel() * view.element_size()
                    st.nbytes += nb
                    self._stored_bytes += nb
                    o += n
                off += size
            self._evict_if_needed()
            if self._staged_bytes > GPU_STAGING_BYTES:
                self._spill()

    def _spill(self) -> None:
        """Move every device-resident capture chunk to host memory in one device->host copy."""
        if not self._staged_bytes:
            return
        refs, rows, pos = [], [], []
        for st in self._store.values():
            for i, (slot, p, t) in enumerate(st.chunks):
                if isinstance(p, torch.Tensor):
                    refs.append((st, i, slot, t.shape[0]))
                    rows.append(t)
                    pos.append(p)
        self._staged_bytes = 0
        if not refs:
            return
        host = torch.cat(rows).to("cpu")
        pos_host = torch.cat(pos).to("cpu").numpy()
        off = 0
        for st, i, slot, n in refs:
            st.chunks[i] = (slot, pos_host[off:off + n], host[off:off + n])
            off += n

    def _evict_if_needed(self) -> None:
        while self._stored_bytes > MAX_STORED_BYTES and self._store:
            key = next(iter(self._store))
            st = self._store.pop(key)
            self._stored_bytes -= st.nbytes
            self._evicted.add(key[0])
            logger.error("inspect-lens: capture store over VLLM_LENS_MAX_STORED_GB; dropped request %s", key[0])

    # ---------------------------------------------------------------- fetch (RPC)

    def fetch(self, wanted: list[tuple[str, dict[int, int]]]) -> dict[str, Any]:
        """{key: {child: payload}} for this rank's layers; pops what it returns.

        Hook state and errors come from TP rank 0 only (every rank runs the same hooks on the same
        replicated stream), so nothing comes back duplicated tp_size times."""
        out: dict[str, Any] = {}
        with self._lock:
            self._spill()
            if not self.capturing_rank:  # hooks ran here too; only rank 0 reports
                for key, children in wanted:
                    for child in children:
                        self._store.pop((key, int(child)), None)
                return out
            for key, children in wanted:
                if key in self._evicted:
                    self._evicted.discard(key)
                    out[key] = {"error": "captures were dropped: the worker's store exceeded "
                                         "VLLM_LENS_MAX_STORED_GB before they were fetched"}
                    continue
                per_child = {}
                for child, n_pos in children.items():
                    st = self._store.pop((key, int(child)), None)
                    if st is None:
                        continue
                    self._stored_bytes -= st.nbytes
                    per_child[int(child)] = self._assemble(st, int(n_pos))
                if per_child:
                    out[key] = per_child
        return out

    def _assemble(self, st: _Store, n_pos: int) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        if st.error is not None:
            payload["error"] = st.error
        if st.saved:
            payload["hooks"] = _pickle_saved(st.saved)
        if not st.layers:
            return payload
        mine = [l for l in st.layers if l in self.layer_ids]
        slots = [st.layers.index(l) for l in mine]
        if not st.chunks:
            payload.setdefault("error", "no positions were captured")
            return payload
        d = st.chunks[0][2].shape[-1]
        t = torch.zeros((len(st.layers), n_pos, d), dtype=st.chunks[0][2].dtype)
        filled = np.zeros((len(st.layers), n_pos), dtype=bool)
        # one scatter for the whole request (a few hundred chunks: one per step and layer)
        pos = np.concatenate([c[1] for c in st.chunks])
        slot = np.concatenate([np.full(len(c[1]), c[0]) for c in st.chunks])
        rows = torch.cat([c[2] for c in st.chunks])
        keep = pos < n_pos
        if not keep.all():
            pos, slot, rows = pos[keep], slot[keep], rows[torch.from_numpy(keep)]
        t[torch.from_numpy(slot), torch.from_numpy(pos)] = rows
        filled[slot, pos] = True
        t = t[slots]
        missing = [(l, int(np.flatnonzero(~filled[s])[0])) for l, s in zip(mine, slots) if not filled[s].all()]
        payload.update({"layers": mine, "tensor": tensor_to_bytes(t)})
        if missing:
            payload.setdefault("error", f"positions never ran a forward pass (layer, first missing position): {missing}")
        return payload

    def drop(self, keys: list[str]) -> int:
        with self._lock:
            gone = [k for k in self._store if k[0] in set(keys)]
            for k in gone:
                self._stored_bytes -= self._store.pop(k).nbytes
            return len(gone)

    # ---------------------------------------------------------------- persistent hooks (RPC)

    def register_hooks(self, hooks: list[tuple[bytes, list[int], bool]]) -> int:
        import cloudpickle

        for fn, layers, pre in hooks:
            self._persistent.append((cloudpickle.loads(fn), frozenset(layers), bool(pre)))
        # plain requests cached as "nothing to do" must be re-planned
        self._reqs = {k: v for k, v in self._reqs.items() if v is not None}
        return len(self._persistent)

    def collect_hook_results(self) -> bytes | None:
        if not self.capturing_rank:
            return None
        return _pickle_saved(self._persistent_results)

    def pop_persistent_errors(self, request_ids: list[str]) -> dict[str, str]:
        if not self.capturing_rank:
            return {}
        out = {}
        for rid in request_ids:
            for k in [k for k in self._persistent_errors if k == rid or k.startswith(rid + "#")]:
                out[k] = self._persistent_errors.pop(k)
        return out

    def clear_hook_results(self) -> None:
        self._persistent_results.clear()
        self._persistent_errors.clear()

    def clear_hooks(self) -> None:
        self._persistent.clear()
        self._persistent_results.clear()
        self._persistent_errors.clear()
        self._reqs = {k: v for k, v in self._reqs.items() if v is not None and v.spec is not None}

    # ---------------------------------------------------------------- parameters

    def get_parameter(self, name: str) -> torch.Tensor:
        """Full parameter: prefetched copy if any, else gathered from this stage's TP shards."""
        if name in self._prefetched:
            return self._prefetched[name]
        try:
            return adapter.full_parameter(self.model, name).detach()
        except KeyError:
            raise KeyError(
                f"parameter {name!r} is not on this pipeline stage (or does not exist); prefetch it first "
                "with llm.prefetch_params([...])") from None

    def prefetch(self, names: list[str]) -> list[str]:
        """Collective on every rank: gather TP shards, then share across pipeline stages, so a hook on
        any stage can read e.g. `lm_head.weight` that lives on the last one."""
        for name in names:
            try:
                local = self.get_parameter(name)
            except KeyError:
                local = None
            try:
                self._prefetched[name] = adapter.pp_share(local, name).detach().clone()
            except KeyError:
                raise KeyError(f"prefetch_params: no pipeline stage has a parameter {name!r}") from None
        return sorted(self._prefetched)

    def clear_prefetched(self) -> None:
        self._prefetched.clear()

    def status(self) -> dict[str, Any]:
        return {
            "layers": self.layer_ids,
            "tp_rank": self.tp_rank,
            "stored_requests": len(self._store),
            "stored_bytes": self._stored_bytes,
            "steps_with_features": self.steps_with_features,
            "persistent_hooks": len(self._persistent),
            "persistent_results": len(self._persistent_results),
            "prefetched": sorted(self._prefetched),
        }


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _pickle_saved(obj: Any) -> bytes:
    """Hook state, tensors on CPU, as cloudpickle bytes: produced by our own worker, read by the
    frontend that owns it (the HTTP layer converts to JSON before anything leaves the server)."""
    import cloudpickle

    return cloudpickle.dumps(_to_cpu(obj))
