"""vLLM's V2 GPU model runner (`vllm/v1/worker/gpu/model_runner.py`, vLLM's default on GPU since 0.26 for
most models), giving the runtime what `runner` gives it on the V1 runner: a wrapper around every forward
pass, the step's batch layout and host positions, the CUDA-graph mode decision, the request bookkeeping.

V2 differs where it matters to us:
- it has no `_model_forward`: the forward is inline in `execute_model`, and a FULL graph is replayed by the
  graph manager without calling the model at all. So the "forward" we wrap is the whole `execute_model`.
- the batch order and row offsets are decided inside `execute_model`, after the CUDA-graph mode. So the
  layout is computed before the step from the scheduler output, with vLLM's own `sort_batch_req_ids`, and
  checked after the forward against the `InputBatch` vLLM built: a difference is a `LensIncompatibleVLLM`
  (never captures filed on the wrong rows).
- it keeps no per-request `SamplingParams` (V1's `runner.requests`): the adapter records each new request's
  params from the scheduler output and forgets them when the request finishes (preempted requests are
  dropped by V2 and re-sent as new; their state here is kept, as V1 keeps them).
- the CUDA-graph mode is picked by `CudaGraphManager.dispatch`; steps that need Python at the taps see
  vLLM's candidates without the modes they cannot use (vLLM's own matching then picks among the rest).

Installed only when the operator opts in (`VLLM_LENS_V2_RUNNER=1`); otherwise the frontend keeps vLLM on
the V1 runner (`compat.engine.force_v1_model_runner`). Which adapter serves a runner is decided by the
class the worker built (`is_v2`), never by the environment alone.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import numpy as np

from vllm_worker.compat.version import LensIncompatibleVLLM, require, then, wrap

# the V2 runner class once its patches are installed (None: no runner is served by this adapter)
_V2_CLS: type | None = None


@dataclasses.dataclass
class _Step:
    """One `execute_model` call with tokens to run."""

    runner: Any
    sched: Any  # vLLM's SchedulerOutput
    layout: tuple[list[str], np.ndarray] | None = None  # (request ids in batch order, host query_start_loc)
    starts: np.ndarray | None = None  # computed tokens of each request before the step, batch order
    level: int | None = None  # the step's `needs_python` answer, asked once
    full: bool = False  # a FULL CUDA graph was replayed for it


@dataclasses.dataclass
class _Request:
    sampling_params: Any
    prompt_len: int | None


_STEP: _Step | None = None  # the V2 step running now (one engine step at a time per worker thread)


def enabled() -> bool:
    """Whether the operator asked for the V2 runner (`VLLM_LENS_V2_RUNNER`)."""
    from vllm_worker import envs

    return bool(envs.get("VLLM_LENS_V2_RUNNER"))


def has_v2_runner() -> bool:
    """Whether this vLLM has a V2 runner at all (its env switch exists)."""
    import vllm.envs as venvs

    return "VLLM_USE_V2_MODEL_RUNNER" in getattr(venvs, "environment_variables", {})


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _uses(fn: Any, name: str) -> bool:
    """Whether vLLM's function `fn` reads attribute/global `name` (its code object names it)."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    return code is not None and name in code.co_names


def _fields(cls: type) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "_fields", ()))


def internals() -> dict[str, Any]:
    """Every V2 internal the adapter relies on, checked against the installed vLLM: a moved one is a
    `LensIncompatibleVLLM` naming it. Imports the classes only (nothing runs; works without a GPU)."""
    import vllm.v1.worker.gpu.cudagraph_utils as cg
    import vllm.v1.worker.gpu.input_batch as ib
    import vllm.v1.worker.gpu.model_runner as mr
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    runner = require(mr, "GPUModelRunner", "vllm.v1.worker.gpu.model_runner")
    for name in ("load_model", "execute_model"):
        require(runner, name, "V2 GPUModelRunner")
    if _params(runner.execute_model)[:4] != ["self", "scheduler_output", "intermediate_tensors", "dummy_run"]:
        raise LensIncompatibleVLLM(
            f"vLLM internal moved: V2 GPUModelRunner.execute_model{_params(runner.execute_model)}"
        )
    # the step's shape we rely on: the mode is dispatched, a FULL graph replays through the manager, and
    # the step's InputBatch is left in execute_model_state
    for name in ("dispatch_cg_and_sync_dp", "run_fullgraph", "execute_model_state", "cudagraph_manager"):
        if not _uses(runner.execute_model, name):
            raise LensIncompatibleVLLM(f"vLLM internal moved: V2 GPUModelRunner.execute_model no longer uses {name}")
    # ... and the batch order comes from sort_batch_req_ids (in prepare_inputs, or gather_batch_req_state)
    if not any(
        _uses(getattr(runner, m, None), "sort_batch_req_ids") for m in ("prepare_inputs", "gather_batch_req_state")
    ):
        raise LensIncompatibleVLLM(
            "vLLM internal moved: the V2 runner no longer orders its batch by sort_batch_req_ids"
        )
    sort = require(mr, "sort_batch_req_ids", "vllm.v1.worker.gpu.model_runner")
    sort_args = set(_params(sort))
    if (
        not {"num_tokens_per_req", "decode_query_len"}
        <= sort_args
        <= {
            "num_tokens_per_req",
            "draft_tokens",
            "decode_query_len",
        }
    ):
        raise LensIncompatibleVLLM(f"vLLM internal moved: sort_batch_req_ids{sorted(sort_args)}")
    state = require(mr, "ExecuteModelState", "vllm.v1.worker.gpu.model_runner")
    if "input_batch" not in _fields(state):
        raise LensIncompatibleVLLM("vLLM internal moved: V2 ExecuteModelState.input_batch not found")
    batch = require(ib, "InputBatch", "vllm.v1.worker.gpu.input_batch")
    for f in ("req_ids", "query_start_loc_np", "num_computed_tokens_np", "positions"):
        if f not in _fields(batch):
            raise LensIncompatibleVLLM(f"vLLM internal moved: V2 InputBatch.{f} not found")
    buffers = require(ib, "InputBuffers", "vllm.v1.worker.gpu.input_batch")
    if not _uses(buffers.__init__, "positions"):
        raise LensIncompatibleVLLM("vLLM internal moved: V2 InputBuffers.positions not found")
    manager = require(cg, "CudaGraphManager", "vllm.v1.worker.gpu.cudagraph_utils")
    for name in ("dispatch", "run_fullgraph", "run_pw_graph"):
        require(manager, name, "CudaGraphManager")
    if not _uses(manager.dispatch, "_candidates"):
        raise LensIncompatibleVLLM("vLLM internal moved: CudaGraphManager.dispatch no longer reads _candidates")
    for cls, names in (
        (
            SchedulerOutput,
            (
                "scheduled_new_reqs",
                "scheduled_cached_reqs",
                "num_scheduled_tokens",
                "total_num_scheduled_tokens",
                "scheduled_spec_decode_tokens",
                "finished_req_ids",
            ),
        ),
        (NewRequestData, ("req_id", "prompt_token_ids", "sampling_params", "num_computed_tokens")),
        (CachedRequestData, ("req_ids", "num_computed_tokens")),
    ):
        for f in names:
            if f not in _fields(cls):
                raise LensIncompatibleVLLM(f"vLLM internal moved: {cls.__qualname__}.{f} not found")
    return {
        "GPUModelRunner": runner,
        "sort_batch_req_ids": sort,
        "ExecuteModelState": state,
        "InputBatch": batch,
        "InputBuffers": buffers,
        "CudaGraphManager": manager,
    }


def check() -> None:
    """Frontend, before the engine is built with the V2 runner allowed: fail now, naming what moved."""
    if has_v2_runner():
        internals()


def is_v2(runner: Any) -> bool:
    """Whether `runner` is the V2 runner this adapter serves (by the class the worker built)."""
    return _V2_CLS is not None and isinstance(runner, _V2_CLS)


# ---------------------------------------------------------------- patches


# (finished, idle) of `runner.patch_step_notices`, called by the V2 `execute_model` below as by V1's
STEP_NOTICES: list[tuple[Callable[[Any, Any], None], Callable[[Any], None]]] = []


def patch_runner(on_loaded: Callable[[Any], None], around_forward: Callable[..., Any]) -> None:
    """As `runner.patch_runner`, on the V2 runner: `on_loaded(runner)` after `load_model` (before vLLM
    compiles or captures anything); `around_forward(runner, orig, *args, positions=..., **kw)` wraps each
    `execute_model` that runs tokens (the batch layout is known then: `batch_layout`)."""
    global _V2_CLS
    found = internals()
    cls, manager = found["GPUModelRunner"], found["CudaGraphManager"]

    def make_execute(orig: Callable) -> Callable:
        def execute_model(self, scheduler_output, *args, **kwargs):
            dummy = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
            if dummy or getattr(self, "_lens_runtime", None) is None:
                return orig(self, scheduler_output, *args, **kwargs)
            for finished, _ in STEP_NOTICES:  # (before `_track_requests` forgets them)
                if scheduler_output.finished_req_ids:
                    finished(self, scheduler_output.finished_req_ids)
            _track_requests(self, scheduler_output)
            if not scheduler_output.total_num_scheduled_tokens:
                out = orig(self, scheduler_output, *args, **kwargs)
                for _, idle in STEP_NOTICES:
                    idle(self)
                return out
            global _STEP
            prev, step = _STEP, _Step(self, scheduler_output)
            _STEP = self._lens_step = step
            positions = require(require(self, "input_buffers", "V2 GPUModelRunner"), "positions", "InputBuffers")

            def forward(runner, *a, positions=None, **kw):
                out = orig(runner, *a, **kw)
                _check_layout(step)  # before anything is filed from the step's rows
                return out

            try:
                # `positions`: vLLM's persistent buffer, filled inside the step before the forward; the
                # taps read it during the forward (V1 passes the same rows to `_model_forward`)
                return around_forward(self, forward, scheduler_output, *args, positions=positions, **kwargs)
            finally:
                _STEP, self._lens_step = prev, None

        return execute_model

    def make_run_full(orig: Callable) -> Callable:
        def run_fullgraph(self, *args, **kwargs):
            step = _STEP
            if step is not None and self is getattr(step.runner, "cudagraph_manager", None):
                step.full = True
            return orig(self, *args, **kwargs)

        return run_fullgraph

    wrap(cls, "load_model", then(on_loaded))
    wrap(cls, "execute_model", make_execute)
    wrap(manager, "run_fullgraph", make_run_full)
    _V2_CLS = cls


class _Without:
    """vLLM's dispatch candidates (token count -> descriptors, best first) minus some CUDA-graph modes:
    vLLM's own `dispatch` then picks the best compatible one left, or eager."""

    def __init__(self, base: Any, banned: set) -> None:
        self._base, self._banned = base, banned

    def __contains__(self, key: Any) -> bool:
        return key in self._base

    def __getitem__(self, key: Any) -> list:
        return [d for d in self._base[key] if d.cg_mode not in self._banned]

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self._base else default


def banned_modes(level: int, breakable: bool) -> set:
    """CUDA-graph modes a step at `needs_python` level cannot use. Breakable piecewise graphs (vLLM's
    graph breaks at attention ops only, not at our tap op) replay the taps' Python as recorded: banned
    from level 1 on."""
    from vllm.config import CUDAGraphMode

    if not level:
        return set()
    if level >= 2 or breakable:
        return {CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE}
    return {CUDAGraphMode.FULL}


def dispatch_without(manager: Any, banned: set, *args: Any, **kwargs: Any) -> Any:
    """vLLM's `CudaGraphManager.dispatch` choosing among the candidates of modes not in `banned`."""
    orig = getattr(type(manager).dispatch, "__wrapped__", type(manager).dispatch)
    if not banned:
        return orig(manager, *args, **kwargs)
    cands = require(manager, "_candidates", "CudaGraphManager")
    manager._candidates = _Without(cands, banned)
    try:
        return orig(manager, *args, **kwargs)
    finally:
        manager._candidates = cands


def patch_cudagraph_dispatch(needs_python: Callable[[Any], int]) -> None:
    """As `runner.patch_cudagraph_dispatch`, on V2: `needs_python(runner)` is asked once per step, when
    vLLM picks the step's CUDA-graph mode (the layout is known: see `batch_layout`)."""
    manager = internals()["CudaGraphManager"]

    def make_dispatch(orig: Callable) -> Callable:
        def dispatch(self, *args, **kwargs):
            step = _STEP
            if step is None or self is not getattr(step.runner, "cudagraph_manager", None):
                return orig(self, *args, **kwargs)  # dummy runs, capture, a drafter's manager
            if step.level is None:
                step.level = needs_python(step.runner)
            if not step.level:
                return orig(self, *args, **kwargs)
            return dispatch_without(
                self, banned_modes(step.level, bool(getattr(self, "use_breakable_cg", False))), *args, **kwargs
            )

        return dispatch

    wrap(manager, "dispatch", make_dispatch)


# ---------------------------------------------------------------- per step


def _refuse_unsupported(runner: Any) -> None:
    """Layouts where vLLM splits or re-partitions a step's rows after our layout is made."""
    if getattr(runner, "pcp_manager", None) is not None:
        raise LensIncompatibleVLLM("inspect-lens under the V2 runner does not support prefill context parallel")
    if getattr(runner, "ubatch_runner", None) is not None:
        raise LensIncompatibleVLLM("inspect-lens under the V2 runner does not support micro-batching (DBO)")


def _track_requests(runner: Any, sched: Any) -> None:
    reqs = runner.__dict__.setdefault("_lens_v2_reqs", {})
    for rid in sched.finished_req_ids:
        reqs.pop(rid, None)
    for new in sched.scheduled_new_reqs:
        n = getattr(new, "prompt_len", None)
        if not isinstance(n, int):
            ids = new.prompt_token_ids
            n = None if ids is None else len(ids)
        reqs[new.req_id] = _Request(new.sampling_params, n)


def _step_of(runner: Any) -> _Step:
    step = getattr(runner, "_lens_step", None)
    if step is None:
        raise LensIncompatibleVLLM("V2 runner: the batch layout was asked for outside a step")
    return step


def _sort(runner: Any, sched: Any) -> list[str]:
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    args = {
        "num_tokens_per_req": sched.num_scheduled_tokens,
        "draft_tokens": sched.scheduled_spec_decode_tokens,
        "decode_query_len": require(runner, "decode_query_len", "V2 GPUModelRunner"),
    }
    return list(sort_batch_req_ids(**{k: v for k, v in args.items() if k in _params(sort_batch_req_ids)}))


def layout_of(runner: Any, sched: Any) -> tuple[list[str], np.ndarray]:
    """(request ids in the order V2 lays them out, host query_start_loc) of a scheduler output."""
    req_ids = _sort(runner, sched)
    counts = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=len(req_ids))
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    return req_ids, qsl


def batch_layout(runner: Any) -> tuple[list[str], np.ndarray]:
    step = _step_of(runner)
    if step.layout is None:
        _refuse_unsupported(runner)
        step.layout = layout_of(runner, step.sched)
    return step.layout


def starts_of(sched: Any, req_ids: list[str]) -> np.ndarray:
    """Tokens each request had computed before the step (what V2 copies into its request state)."""
    known = {new.req_id: new.num_computed_tokens for new in sched.scheduled_new_reqs}
    cached = sched.scheduled_cached_reqs
    known.update(zip(cached.req_ids, cached.num_computed_tokens))
    try:
        return np.fromiter((known[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    except KeyError as e:
        raise LensIncompatibleVLLM(f"V2 runner: request {e} scheduled but neither new nor cached") from None


def host_positions(runner: Any, qsl: Any) -> np.ndarray:
    step = _step_of(runner)
    req_ids, _ = batch_layout(runner)
    start = starts_of(step.sched, req_ids)
    step.starts = start
    return positions_from(start, qsl)


def positions_from(start: np.ndarray, qsl: np.ndarray) -> np.ndarray:
    """Row positions: each request's computed tokens + the row's offset in its chunk."""
    return np.repeat(start - qsl[:-1], np.diff(qsl)) + np.arange(int(qsl[-1]))


def _check_layout(step: _Step) -> None:
    """After the forward: the layout we planned with is the one vLLM ran."""
    if step.layout is None:
        return  # nothing was planned from it
    state = getattr(step.runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None)
    if batch is None:
        raise LensIncompatibleVLLM("V2 runner: no execute_model_state.input_batch after the forward")
    req_ids, qsl = step.layout
    n = len(req_ids)
    if list(batch.req_ids) != req_ids or not np.array_equal(np.asarray(batch.query_start_loc_np)[: n + 1], qsl):
        raise LensIncompatibleVLLM(
            "V2 runner laid the batch out differently from what inspect-lens planned with "
            f"({list(batch.req_ids)[:4]}... vs {req_ids[:4]}...)"
        )
    if step.starts is not None and not np.array_equal(np.asarray(batch.num_computed_tokens_np)[:n], step.starts):
        raise LensIncompatibleVLLM("V2 runner: the step's positions differ from what inspect-lens planned with")


def forward_replays_full_graph() -> bool | None:
    """Whether the running V2 step replayed a FULL CUDA graph; None outside a V2 step."""
    return None if _STEP is None else _STEP.full


# ---------------------------------------------------------------- per request


def _requests(runner: Any) -> dict[str, _Request]:
    return runner.__dict__.setdefault("_lens_v2_reqs", {})


def request_extra_args(runner: Any, req_id: str) -> dict | None:
    r = _requests(runner).get(req_id)
    sp = None if r is None else r.sampling_params
    return None if sp is None else sp.extra_args


def request_max_positions(runner: Any, req_id: str) -> int | None:
    r = _requests(runner).get(req_id)
    if r is None:
        return None
    max_tokens = getattr(r.sampling_params, "max_tokens", None)
    if not isinstance(r.prompt_len, int) or not isinstance(max_tokens, int):
        return None
    return r.prompt_len + max_tokens - 1


def request_prompt_len(runner: Any, req_id: str) -> int | None:
    return getattr(_requests(runner).get(req_id), "prompt_len", None)


def live_request_ids(runner: Any) -> Any:
    return _requests(runner).keys()
