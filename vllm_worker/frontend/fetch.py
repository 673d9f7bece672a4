"""Results of finished requests: fetched from the workers by RPC in bounded round trips (through the
shared-memory result pool on one machine), decoded and merged across pipeline stages, and attached to
the outputs of `LLM.generate`, `LLMEngine.step` and `AsyncLLM.generate`."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Generator

import torch

from vllm_worker import compat
from vllm_worker.api.hooks import HookError, UnsupportedError
from vllm_worker.counters import FETCH_BATCHES, FRONTEND_TIMINGS
from vllm_worker.envs import limit
from vllm_worker.frontend import mlp_post
from vllm_worker.frontend.probe_results import Outputs, probe_outputs, probe_outputs_many
from vllm_worker.frontend.round_trips import RoundTrips
from vllm_worker.frontend.state import Pending, consumer_of, engine_state, pending_of, result_pools
from vllm_worker.protocol import probe_wire, rpc
from vllm_worker.protocol.errors import Failure, all_internal, failure, messages
from vllm_worker.protocol.points import MLP_POST, RESID_POST, ROUTER_LOGITS, K, Q, Z, point_sites
from vllm_worker.protocol.spec import ModelShape
from vllm_worker.protocol.wire import dtype_from_name, tensor_from_bytes
from vllm_worker.transport import result_views, row_layout, shm

PROBES_ONLY = frozenset({"probes", probe_wire.BLOCK})  # a part holding probe scores and nothing else
FETCH_GROUP_BYTES = 512 << 20  # per RPC round trip when results travel inside the RPC reply
# ... and when they travel through the shared-memory result pool (the reply holds only region names): one
# round trip lets the worker assemble a whole batch in parallel threads (docs/decisions.md)


def fetch_groups(
    todo: list[tuple[Pending, dict[int, int]]], shm_ok: bool = False
) -> list[list[tuple[str, dict[int, int]]]]:
    """Split `lens_fetch` arguments into RPC round trips of bounded estimated size (`shm_ok`: every worker
    shares this machine, so results come back as shared-memory files and the reply holds only names)."""
    cap = limit("VLLM_LENS_FETCH_GROUP_SHM_GB") if shm_ok else FETCH_GROUP_BYTES
    groups: list[list] = []
    size = 0
    for p, children in todo:
        est = sum(children.values()) * len(p.layers) * p.d_model * 4
        if not groups or (groups[-1] and size + est > cap):
            groups.append([])
            size = 0
        groups[-1].append((p.key, children))
        size += est
    return groups


def merge_fetched(merged: dict[str, dict], rank_results: list) -> None:
    """Fold one round trip's per-rank answers into `merged`: {key: {child: [part per stage]}}."""
    for rank_result in rank_results:
        for key, per_child in (rank_result or {}).items():
            dst = merged.setdefault(key, {})
            if "error" in per_child:
                dst["error"] = per_child["error"]
                continue
            for child, payload in per_child.items():
                dst.setdefault(int(child), []).append(payload)


def _by_engine(engine: Any, todo: list[tuple[Pending, dict[int, int]]]) -> list[tuple[int | None, list]]:
    """`todo` split by the data-parallel engine that ran each request (fetched from that engine only);
    `None`: the one engine, or every engine for a request whose route is unknown (results are merged by
    key, so an engine without them adds nothing)."""
    if compat.engine_count(engine) <= 1:
        return [(None, todo)]
    groups: dict[int | None, list] = {}
    for p, children in todo:
        for target in compat.engines_of(engine, p.key) or [None]:
            groups.setdefault(target, []).append((p, children))
    return sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


def _fetch_rounds(engine: Any, todo: list[tuple[Pending, dict[int, int]]]) -> Generator[tuple, Any, dict]:
    """The one fetch loop, for the sync and async paths alike: yields each RPC call `(engine index or None,
    method, *args)` to make, is sent the ranks' answers, returns the merged results. Asks once per engine
    whether every worker shares this machine (results then travel through the shared-memory result pool; a
    worker on another node returns them inside the RPC reply, which must stay small). Under data
    parallelism each request's results come from the engine vLLM routed it to."""
    host = shm.host_id()
    state = engine_state(engine)
    everywhere = state.shm_everywhere
    if host is not None and everywhere is None:
        hosts = yield (None, rpc.HOST_ID)
        everywhere = state.shm_everywhere = all(h == host for h in hosts)
    merged: dict[str, dict] = {}
    for target, items in _by_engine(engine, todo):
        pools = state.pools_of(target)
        for group in fetch_groups(items, host is not None and bool(everywhere)):
            got: dict[str, dict] = {}
            merge_fetched(got, (yield (target, rpc.FETCH, group, host, result_views.take_released(pools))))
            found = result_views.pools_of(got)
            pools |= found
            state.pools |= found
            if not merged:  # the first (often the only) round trip: its answers are the merge so far
                merged.update(got)
                continue
            for key, per_child in got.items():
                dst = merged.setdefault(key, {})
                for child, parts in per_child.items():
                    if child == "error":
                        dst["error"] = parts
                    else:
                        dst.setdefault(child, []).extend(parts)
    return merged


def _fetch(engine: Any, todo: list[tuple[Pending, dict[int, int]]]) -> dict[str, dict]:
    """`_fetch_rounds` through a sync engine. A fetch that raises leaves its requests' results with the
    workers, and no caller will ask for them again: they are dropped, as an aborted request's are (best
    effort: workers that cannot be reached hold nothing), and the fetch's own error is raised."""
    t = time.perf_counter()
    rounds = _fetch_rounds(engine, todo)
    try:
        target, *call = next(rounds)
        while True:
            assert target is None, "data-parallel engines are served through AsyncLLM"
            target, *call = rounds.send(compat.rpc(engine, *call))
    except StopIteration as done:
        merged = done.value
    except Exception:
        try:
            compat.rpc(engine, rpc.DROP, [p.key for p, _ in todo])
        except Exception:  # noqa: BLE001, S110 - the fetch's own error is the one raised
            pass
        raise
    FRONTEND_TIMINGS["fetch_rpc_s"] += time.perf_counter() - t
    return merged


async def fetch_async(engine_client: Any, todo: list[tuple[Pending, dict[int, int]]]) -> dict[str, dict]:
    """`_fetch` for an async engine client (the HTTP server, `AsyncLLM` callers), a failed fetch's results
    dropped alike (on every data-parallel engine)."""
    t = time.perf_counter()
    rounds = _fetch_rounds(engine_client, todo)
    try:
        target, *call = next(rounds)
        while True:
            target, *call = rounds.send(await compat.rpc_async(engine_client, *call, engine=target))
    except StopIteration as done:
        merged = done.value
    except Exception:
        keys = [p.key for p, _ in todo]
        compat.forget_routes(engine_client, keys)  # (the routes not yet read: no engine answers for them now)
        try:
            await compat.rpc_async(engine_client, rpc.DROP, keys)
        except Exception:  # noqa: BLE001, S110 - the fetch's own error is the one raised
            pass
        raise
    FRONTEND_TIMINGS["fetch_rpc_s"] += time.perf_counter() - t
    return merged


class FetchBatcher(RoundTrips[list[tuple[Pending, dict[int, int]]]]):
    """Fetches made at the same time through one async engine client (every response of an HTTP server
    finishing in the same step) share their RPC round trips (`round_trips`); each caller gets its own
    requests' results. A caller cancelled meanwhile drops its results, which are then released."""

    def __init__(self, engine_client: Any) -> None:
        super().__init__()
        self.engine = engine_client

    async def serve(self, asks: list[list[tuple[Pending, dict[int, int]]]]) -> list[dict[str, dict]]:
        FETCH_BATCHES["batches"] += 1
        FETCH_BATCHES["fetches"] += len(asks)
        merged = await fetch_async(self.engine, [item for todo in asks for item in todo])
        return [{p.key: merged[p.key] for p, _ in todo if p.key in merged} for todo in asks]


async def fetch_batched(engine_client: Any, todo: list[tuple[Pending, dict[int, int]]]) -> dict[str, dict]:
    """`fetch_async` through the engine's `FetchBatcher` (made on first use)."""
    state = engine_state(engine_client)
    if state.fetches is None:
        state.fetches = FetchBatcher(engine_client)
    return await state.fetches.submit(todo)


def release_results(engine: Any) -> int:
    """Give the workers back the result memory of every capture tensor already garbage-collected (this
    otherwise happens with the engine's next fetch); returns how many regions."""
    released = result_views.take_released(result_pools(engine))
    return sum(compat.rpc(engine, rpc.RELEASE, released)) if released else 0


async def release_results_async(engine_client: Any) -> int:
    """`release_results` for an async client: each data-parallel engine gets back its own workers' regions."""
    state = engine_state(engine_client)
    n = 0
    engines = compat.engine_count(engine_client)
    for target in [None] if engines <= 1 else list(range(engines)):
        released = result_views.take_released(state.pools_of(target))
        if released:
            n += sum(await compat.rpc_async(engine_client, rpc.RELEASE, released, engine=target))
    if state.engine_pools:  # pools learnt from a fetch sent to every engine: every engine hears of them
        rest = result_views.take_released(state.pools.difference(*state.engine_pools.values()))
        if rest:
            n += sum(await compat.rpc_async(engine_client, rpc.RELEASE, rest))
    return n


def _part_tensor(part: dict) -> torch.Tensor:
    if "pool" in part:  # written by our own worker on this machine (see transport/result_pool.py)
        return result_views.view(part["pool"], dtype_from_name(part["pool"]["dtype"]))
    return tensor_from_bytes(part["tensor"], "residual_stream")


def discard_parts(parts: list[dict]) -> None:
    """Results that will not be decoded: give their shared memory back."""
    for part in parts:
        if "pool" in part:
            result_views.discard(part["pool"])


def _assemble(p: Pending, parts: list[dict]) -> tuple[torch.Tensor, bool]:
    """The sample's captures `(sites, n_pos, d)` in `p.layers`' order, and whether their mlp_post pieces
    interleave (`row_layout`: the one part holding every site kept as the worker laid it out)."""
    by_layer: dict[int, torch.Tensor] = {}
    for part in parts:
        if "tensor" not in part and "pool" not in part:
            continue
        t = _part_tensor(part)
        layers = part["layers"]
        mixed = bool(part.get(row_layout.INTERLEAVED))
        if layers == p.layers or list(layers) == list(p.layers):  # one stage holds every layer: no re-stacking
            return t, mixed
        if mixed:  # stages' parts stacked site by site: this one's rows in plain order first (a copy)
            t = _plain(t, list(layers))
        for i, layer in enumerate(part["layers"]):
            by_layer.setdefault(layer, t[i])
    missing = [l for l in p.layers if l not in by_layer]
    if missing:
        raise RuntimeError(f"inspect-lens: no worker returned captures for layers {missing}")
    return torch.stack([by_layer[l] for l in p.layers]), False


def _plain(t: torch.Tensor, sites: list[int]) -> torch.Tensor:
    """Interleaved captures (`row_layout`) as `(sites, n_pos, d)` with each site's positions in order (a copy)."""
    n = t.shape[1]
    at = torch.from_numpy(row_layout.rows(sites, n, n))
    return t.reshape(-1, t.shape[-1])[at]


def _mlp_rows(t: torch.Tensor, starts: list[int], c: int) -> torch.Tensor:
    """`(layers, n_pos, c * d)`: the interleaved mlp_post blocks starting at rows `starts` of `t` — a view when
    they are evenly spaced (one layer, or layers with the same other sites between them), else stacked."""
    n, d = t.shape[1], t.shape[-1]
    gaps = {b - a for a, b in zip(starts, starts[1:])}
    if t.is_contiguous() and len(gaps) <= 1:
        step = gaps.pop() if gaps else c
        return t.as_strided((len(starts), n, c * d), (step * n * d, c * d, 1), t.storage_offset() + starts[0] * n * d)
    return torch.stack([t[s0 : s0 + c].reshape(n, c * d) for s0 in starts])


def by_point(
    t: torch.Tensor, sites: list[int], points: dict[str, list[int]], shape: ModelShape, mixed: bool = False
) -> dict[str, Any]:
    """`activations` of a sample: one `(n_layers, n_pos, d)` tensor per point asked for (layers in the order
    asked; `z` / `q`: `(n_layers, n_pos, n_heads, d_head)`, `k`: `n_kv_heads`, `router_logits`: n_experts
    wide, with `expert_ids`), `points` = {point: layers}, and `residual_stream` / `layers` for `resid_post`
    (the same tensor object: the original's names). A point whose rows are consecutive in `t` is a view,
    never a copy; so is mlp_post when `mixed` (`t` as the worker laid it out, `row_layout`: each position's
    pieces adjacent)."""
    row = {s: i for i, s in enumerate(sites)}
    acts: dict[str, Any] = {}
    groups = set(row_layout.mlp_groups(sites)) if mixed else set()
    for point, layers in points.items():
        idx = [row[s] for l in layers for s in point_sites(point, l, shape.mlp_chunks)]
        c = shape.mlp_chunks
        if point == MLP_POST and groups and c > 1:
            starts = [idx[k * c] for k in range(len(layers))]
            if all(
                (s0, c) in groups and idx[k * c : (k + 1) * c] == list(range(s0, s0 + c)) for k, s0 in enumerate(starts)
            ):
                acts[point] = _mlp_rows(t, starts, c)[..., : shape.d_mlp]
                continue
            t, groups = _plain(t, sites), set()  # (never expected: the worker lays out what was asked)
        if len(idx) == 1 or idx == list(range(idx[0], idx[0] + len(idx))):
            # (every row of `t`: `t` itself, one tensor fewer per request)
            acts[point] = t if idx[0] == 0 and len(idx) == t.shape[0] else t[idx[0] : idx[0] + len(idx)]
        else:
            acts[point] = t[idx]
        if point == MLP_POST:  # its d_model-wide pieces, back into d_mlp-wide rows
            acts[point] = mlp_post.assemble(acts[point], len(layers), shape)
        if point in (Z, Q):
            acts[point] = acts[point][..., : shape.n_heads * shape.d_head].unflatten(-1, (shape.n_heads, shape.d_head))
        if point == K:
            acts[point] = acts[point][..., : shape.n_kv_heads * shape.d_head].unflatten(
                -1, (shape.n_kv_heads, shape.d_head)
            )
        if point == ROUTER_LOGITS:  # the first n_experts values of each row; the top-k chosen beside them
            acts[point] = acts[point][..., : shape.n_experts]
            if shape.top_k:  # plain top-k routers only (`compat.moe_shape`)
                acts["expert_ids"] = acts[point].float().topk(shape.top_k, dim=-1).indices
    acts["points"] = {point: list(layers) for point, layers in points.items()}
    if RESID_POST in points:
        acts["residual_stream"], acts["layers"] = acts[RESID_POST], list(points[RESID_POST])
    return acts


def decode_sample(
    p: Pending, got: dict, child: int, probed: Outputs | None = None
) -> tuple[dict | None, dict | None, Failure | None]:
    """(activations, hook_results, failure) of one sample from merged fetch results (`probed`: its probe
    outputs when the fetch computed them for all its samples at once: `_probes_of`)."""
    if "error" in got:
        return None, None, got["error"]
    parts = got.get(child)
    if not parts:
        return None, None, failure("internal", "no results came back from the workers", "fetch")
    if probed is not None and not p.layers and len(parts) == 1 and "probes" in parts[0]:
        if parts[0].keys() <= PROBES_ONLY:  # (what the walk below makes of it, without the walk)
            return {"probe_scores": probed[0], "probe_aggregates": probed[1]}, None, None
    more = False  # SAE features, probe scores or hook state in some part
    for part in parts:
        if "error" in part:  # the first stage's failure
            discard_parts(parts)
            return None, None, part["error"]
        more = more or "sae" in part or "hooks" in part or "probes" in part or "actions" in part
    acts = None
    if p.layers:
        t, mixed = _assemble(p, parts)
        acts = by_point(t, p.layers, p.points, p.shape or ModelShape(0, 0), mixed)
    if not more:  # captures only (most requests)
        return acts, None, None
    features = sae_features(parts)
    if features:
        acts = {**(acts or {}), "sae_features": features}
    fired = [a for part in parts for a in part.get("actions") or ()]  # each on the stage holding its layer
    if fired:
        acts = {**(acts or {}), "probe_actions": sorted(fired, key=lambda a: a["action"])}
    if p.probes:
        scores, aggs = probed or probe_outputs(parts, p.probes, p.prompt_len)
        acts = {**(acts or {}), "probe_scores": scores, "probe_aggregates": aggs}
    hook_parts = [part["hooks"] for part in parts if "hooks" in part]
    hooks = merge_stage_results([_unpickle(h) for h in hook_parts]) if hook_parts else None
    return acts, hooks, None


def sae_features(parts: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """`activations["sae_features"]`: {SAE name: {"positions": (n_pos,), "indices": (n_pos, k) int64,
    "values": (n_pos, k) float32}} (`top_k`: the k strongest per position, strongest first; `features`:
    `indices` is (n_features,), the ids asked for, and `values` (n_pos, n_features))."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for part in parts:
        for name, got in (part.get("sae") or {}).items():  # one pipeline stage holds each SAE's layer
            out[name] = {k: tensor_from_bytes(v, f"sae_features.{name}.{k}") for k, v in got.items()}
    return out


def attach_outputs(llm: Any, outputs: list) -> list:
    """Set `.activations` on finished `RequestOutput`s (and each sample's `CompletionOutput`)."""
    pending = pending_of(compat.processor_of_llm(llm))
    failures: dict[str, Failure] = {}
    if engine_state(llm).persistent_hooks:
        ids = [o.request_id for o in outputs if hasattr(o, "request_id")]
        for rank_errors in compat.rpc(llm, rpc.POP_PERSISTENT_ERRORS, ids):
            failures.update(rank_errors or {})
        for o in outputs:
            f = failures.get(getattr(o, "request_id", ""))
            if f is not None:
                o.hook_error = f["message"]
    todo = _todo(pending, outputs)
    fetched = _fetch(llm, [(p, ch) for _, p, _, ch in todo]) if todo else {}
    failures.update(_apply(todo, fetched))
    if failures:
        raise _hook_error(failures, outputs)
    return outputs


def _todo(pending: dict[str, Pending], outputs: list) -> list:
    """(output, pending entry, {sample index: CompletionOutput}, {child: positions}) of the finished
    outputs that wait for results."""
    todo = []
    for out in outputs:
        p = pending.pop(getattr(out, "request_id", ""), None)
        if p is None or not hasattr(out, "outputs"):
            continue
        samples = {c.index: c for c in out.outputs}
        todo.append((out, p, samples, _positions(out, p, samples, None)))
    return todo


def _positions(out: Any, p: Pending, samples: dict, generated: dict[int, int] | None) -> dict[int, int]:
    """{child: positions run} — `generated` counts tokens when outputs are deltas."""
    n_prompt = len(out.prompt_token_ids or [])
    return {
        (i if p.n > 1 else 0): n_prompt + (len(c.token_ids) if generated is None else generated.get(i, 0)) - 1
        for i, c in samples.items()
    }


def _hook_error(failures: dict[str, Failure], outputs: list) -> HookError:
    if all(f["kind"] == "unsupported" for f in failures.values()):
        return UnsupportedError(messages(failures), outputs)
    return HookError(messages(failures), outputs, internal=all_internal(failures))


def _apply(todo: list, fetched: dict) -> dict[str, Failure]:
    """Decode fetched results onto their samples; returns {request id: hook failure}."""
    failures: dict[str, Failure] = {}
    t = time.perf_counter()
    probed = _probes_of(todo, fetched)
    for out, p, samples, _ in todo:
        got = fetched.get(p.key, {})
        for i, c in samples.items():
            child = i if p.n > 1 else 0
            c.activations, c.hook_results, f = decode_sample(p, got, child, probed.get((p.key, child)))
            c.hook_error = None if f is None else f["message"]
            if f is not None:
                failures[out.request_id if p.n == 1 else f"{out.request_id}#{child}"] = f
        first = samples[min(samples)]
        out.activations, out.hook_results, out.hook_error = first.activations, first.hook_results, first.hook_error
    FRONTEND_TIMINGS["decode_s"] += time.perf_counter() - t
    return failures


def _probes_of(todo: list, fetched: dict) -> dict[tuple[str, int], Outputs]:
    """{(key, child): probe outputs} of every sample in `todo` that asked for probe scores and has its
    parts without a failure: their aggregates computed together (`probe_outputs_many`), not per sample."""
    keys, samples = [], []
    for _, p, chosen, _ in todo:
        got = fetched.get(p.key, {})
        if not p.probes or "error" in got:
            continue
        for i in chosen:
            child = i if p.n > 1 else 0
            parts = got.get(child)
            if parts and not any("error" in part for part in parts):
                keys.append((p.key, child))
                samples.append((parts, p.probes, p.prompt_len))
    return dict(zip(keys, probe_outputs_many(samples))) if len(samples) > 1 else {}


def attach_engine_outputs(engine: Any, outputs: list) -> list:
    """`LLMEngine.step()` driven by the caller: results land on the finished outputs it returns, with
    the same shapes as `LLM.generate` (a hook failure raises `HookError` carrying the outputs)."""
    processor = compat.processor_of_llm_engine(engine)
    if consumer_of(processor) != "engine":
        return outputs  # an `LLM` (or the HTTP server) hands results back itself
    finished = [o for o in outputs if getattr(o, "finished", False)]
    todo = _todo(pending_of(processor), finished)
    if not todo:
        return outputs
    failures = _apply(todo, _fetch(engine, [(p, ch) for _, p, _, ch in todo]))
    if failures:
        raise _hook_error(failures, outputs)
    return outputs


async def attach_async_output(
    engine_client: Any, out: Any, request_id: str | None, generated: dict[int, int] | None, last: dict[int, Any]
) -> None:
    """`AsyncLLM.generate` (AsyncLLMEngine) driven by the caller: results land on each sample's last
    `CompletionOutput` — all in the final `RequestOutput`, except with DELTA outputs and n > 1, where a
    sample that finished earlier keeps them on its own last delta — and `out.activations` is sample 0's.
    Decoded off the event loop."""

    pending = pending_of(compat.processor_of_engine_client(engine_client))
    p = pending.pop(getattr(out, "request_id", ""), None) or (
        None if request_id is None else pending.pop(request_id, None)
    )
    if p is None:
        return
    samples = dict(last) or {c.index: c for c in out.outputs}
    todo = [(out, p, samples, _positions(out, p, samples, generated))]
    merged = await fetch_batched(engine_client, [(p, todo[0][3])])
    failures = await asyncio.to_thread(_apply, todo, merged)
    if failures:
        raise _hook_error(failures, [out])


def _unpickle(data: bytes) -> Any:
    """Results produced by this engine's own workers (never bytes received from a network client)."""
    import cloudpickle

    return cloudpickle.loads(data)


def merge_collected(rank_blobs: list[bytes | None]) -> dict[str, dict[str, Any]]:
    """`lens_collect_hook_results` answers (one per rank) -> {request_id: {"0": saved, ...}}."""
    per_rank = [_unpickle(b) for b in rank_blobs if b is not None]
    ids: list[str] = []
    for r in per_rank:
        ids.extend(k for k in r if k not in ids)
    return {rid: merge_stage_results([r[rid] for r in per_rank if rid in r]) for rid in ids}


def merge_stage_results(stages: list[Any]) -> Any:
    """Merge hook state from pipeline stages (TP duplicates never reach here: only TP rank 0 reports).

    `[saved_of_hook_0, saved_of_hook_1, ...]` per stage -> `{"0": merged_0, ...}`. Keys written on one
    stage are taken as they are; lists under the same key are concatenated in stage (= layer) order;
    dicts merge recursively; for any other value the later stage wins."""
    merged = [_merge_values([st[i] for st in stages]) for i in range(len(stages[0]))]
    return {str(i): m for i, m in enumerate(merged)}


def _merge_values(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    if not values:
        return None
    if all(isinstance(v, dict) for v in values):
        out: dict = {}
        for v in values:
            for k, x in v.items():
                out[k] = _merge_values([out[k], x]) if k in out else x
        return out
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    return values[-1]
