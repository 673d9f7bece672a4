"""Worker side: the per-engine runtime that ties requests, plan, taps, store and parameters together.

Per step: find the rows of requests that asked for something (`plan`). When every such request fits
the graph-safe path (capture and steering, no Python hooks), the plan only fills device buffers that
the kernel inside the taps reads (`graph`), vLLM keeps its CUDA graphs (full ones included), and the
step's captures are copied out after it. Otherwise the step is kept off full graphs and the taps call
`on_tap` from Python between piecewise graphs (steering and hooks from `edits`, capture rows kept for
the step). Either way the captures are filed in `store`. Steps with no feature active leave every
buffer empty: the kernel returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_worker import compat, counters, envs
from vllm_worker.api.hooks import HookContext
from vllm_worker.protocol import errors, points
from vllm_worker.protocol.host_threads import one_thread
from vllm_worker.protocol.spec import PAYLOAD_KEY
from vllm_worker.transport import shm
from vllm_worker.worker import (
    action_step,
    actions,
    faults,
    gpu_clock,
    graph,
    probe_payloads,
    probes,
    ready_probes,
    saes,
    seams,
    taps,
    tp_wide,
    vector_refs,
)
from vllm_worker.worker.admission import Admission
from vllm_worker.worker.params import Params
from vllm_worker.worker.persistent_hooks import PersistentHooks
from vllm_worker.worker.plan import RequestState, Rows, StepPlan, make_plan
from vllm_worker.worker.python_path import PythonPath, wide_needs_python
from vllm_worker.worker.request_results import RequestResults
from vllm_worker.worker.saved_state import pickle_saved
from vllm_worker.worker.store import CaptureStore

logger = logging.getLogger("vllm_worker")


class LensRuntime:
    """Installed on a model runner once its model is loaded (before vLLM compiles it)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.model = compat.runner_model(runner)
        if faults.active() == "layout":
            raise compat.LensIncompatibleVLLM(
                f"fault injected at load: no decoder layers in {type(self.model).__name__}"
            )
        layers = list(compat.iter_stage_layers(runner))
        self.layer_ids = [i for i, _ in layers]
        self._local_layers = frozenset(self.layer_ids)
        hf_config = compat.hf_config(runner)
        self.model_class = compat.model_class(hf_config)
        self.missing = compat.missing_points(hf_config)  # point -> why this model lacks it
        if compat.tp_world_size() > 1:  # each rank holds a slice of the heads
            for p in (points.Z, points.Q, points.K):  # (mlp_post: gathered, `tp_wide`)
                self.missing.setdefault(p, f"{p} under tensor parallelism is not supported yet")
        if compat.sequence_parallel_moe(runner):  # never a wrong tensor: rank 0's rows are not the batch's
            self.missing.setdefault(
                points.ROUTER_LOGITS,
                "router_logits under sequence-parallel MoE (data + expert parallel: each rank routes only "
                "its slice of the tokens) is not supported yet",
            )
        layout = compat.layout_for(hf_config)
        inner: dict = {}
        if layout is not None:
            try:
                inner = {i: compat.inner_modules(m, layout) for i, m in layers}
            except compat.LensIncompatibleVLLM as e:  # vLLM renamed a block: resid_* still work
                logger.warning("inspect-lens: inner hook points unavailable on %s: %s", self.model_class, e)
                self.missing = {p: f"{self.model_class}: {e}" for p in points.INNER}
        for mods in inner.values():  # a point the model lacks gets no tap (its width may differ)
            for p in [p for p in mods if p in self.missing]:
                del mods[p]
        # the sites this stage holds (installed before vLLM compiles the model: see taps)
        d_model, d_mlp = compat.hidden_size(runner), compat.mlp_width(hf_config)
        chunks = points.mlp_chunks(d_mlp, d_model)
        self.sites = taps.install(layers, inner, chunks)
        # mlp_post: its tap's site -> (site, first column, end column) of each d_model-wide piece
        self.wide = {
            points.site(i, points.MLPPOST): [
                (s, j * d_model, min((j + 1) * d_model, d_mlp)) for j, s in enumerate(points.mlp_piece_sites(i, chunks))
            ]
            for i, mods in inner.items()
            if points.MLP_POST in mods
        }
        self._local = frozenset(self.sites)
        self.tp_rank = compat.tp_rank()
        # under TP each rank's mlp_post tap sees its slice of d_mlp: gathered on the Python path, never the kernel
        self.tp_wide = tp_wide.WideGather(self.tp_rank, self.wide) if self.wide and compat.tp_world_size() > 1 else None
        # the kernel never acts at an mlp_post tap's own site (hooks, whole-row edits: Python path), nor under
        # TP at its pieces
        pieces = {s for ps in self.wide.values() for s, _, _ in ps} if self.tp_wide is not None else set()
        pieces |= set(self.wide)
        self.capturing_rank = self.tp_rank == 0
        p = next(self.model.parameters())
        self.device = p.device
        self._gpu_clock = gpu_clock.enabled(self.device)  # benchmarks: device time of each forward
        self.dtype = p.dtype if p.is_floating_point() else torch.float32
        self._reqs: dict[str, RequestState | None] = {}
        self.store = CaptureStore(self.device)
        self.params = Params(self.model)
        self._shm_host = shm.host_id()
        if self._shm_host is not None and shm.sweep_stale():
            logger.info("inspect-lens: removed capture files left in %s by engines that died", shm.shm_dir())
        self._d_model = compat.hidden_size(runner)
        self.graph: graph.GraphTaps | None = None
        if graph.enabled():
            try:
                self.graph = graph.GraphTaps(
                    [s for s in self.sites if s not in pieces],
                    self._d_model,
                    self.dtype,
                    self.device,
                    compat.max_tokens(runner),
                    self.store.side,
                )
            except Exception as e:  # noqa: BLE001 - the Python path still serves every request
                logger.warning(
                    "inspect-lens: graph-safe taps unavailable (%s: %s); steps with capture or "
                    "steering run without CUDA graphs",
                    type(e).__name__,
                    e,
                )
        if self.graph is not None and self.tp_wide is None:
            self.graph.wide = self.wide
        taps.set_graph(self.graph)
        self._layout: tuple | None = None  # (req_ids, qsl) the cached plan was made for
        self._cached_plan: StepPlan | None = None  # plan of the last batch composition seen ...
        self._plan_key: tuple | None = None  # ... and that composition (request ids, row offsets)
        self.steps_with_features = 0
        self.persistent = PersistentHooks()  # hooks on every request, and their results
        # steering, hooks and capture from Python at the taps (steps off the graph-safe path, and seams)
        self.python = PythonPath(self._d_model, self._local, self._fail, self.persistent, counters.STEP_TIMINGS)
        self.python.wide, self.python.tp = self.wide, self.tp_wide
        self.saes = saes.WorkerSaes(self.device, self._local_layers)  # `lens_load_sae`
        self.actions = actions.ActionTable(self._d_model, self.device)  # `probe_actions`
        self.actions.rows_per_step = 1 + compat.draft_tokens(runner)
        self.probes = probes.WorkerProbes(self.device, self._local_layers)  # `lens_load_probe`
        self.admission = Admission(
            runner,
            self.device,
            self.dtype,
            self._d_model,
            self._local,
            self._local_layers,
            self.missing,
            self.capturing_rank,
            self._shm_host,
            self.store,
            self.graph,
            self.persistent,
            self._ctx,
            self.saes,
            self.actions,
            self.probes,
        )
        logger.info(
            "inspect-lens: %d taps on %d decoder layers (%s..%s) of %s on TP rank %d%s",
            len(self.sites),
            len(layers),
            self.layer_ids[0],
            self.layer_ids[-1],
            self.model_class,
            self.tp_rank,
            "" if not self.missing else f"; points not available: {', '.join(self.missing)}",
        )

    # ---------------------------------------------------------------- per request state

    def _request(self, req_id: str) -> RequestState | None:
        try:
            return self._reqs[req_id]
        except KeyError:
            pass
        args = compat.request_extra_args(self.runner, req_id)
        payload = None if not args else args.get(PAYLOAD_KEY)
        req = self.admission.admit(req_id, payload) if payload is not None or self.persistent else None
        self._reqs[req_id] = req
        if req is not None and self.tp_wide is not None:
            self.tp_wide.admitted(req_id, req)
        if req is not None and req.entries is not None and self.wide and wide_needs_python(req, self.wide):
            self._free_entries(req)  # mlp_post work the kernel cannot do: the Python path
            req.entries = None
        return req

    def _ctx(self, saved: dict, external: str) -> HookContext:
        return HookContext(
            saved=saved, request_id=external, tp_rank=self.tp_rank, model=self.model, _params=self.params.get
        )

    def _fail(self, requests: list[RequestState], stage: str, e: Exception) -> None:
        """Our own code failed at `stage` for these requests: each gets the error (reported when its
        results are fetched) and runs without features from now on; everyone else is untouched."""
        msg = errors.internal(stage, e)
        logger.error("inspect-lens: %s", msg["message"])
        for r in requests:
            if r.store is None:
                r.store = RequestResults([])
            r.store.fail(msg)
            r.capture, r.capture_slot, r.steers, r.simple_add, r.hooks, r.sae, r.probes = [], {}, [], {}, [], [], []
            self._free_entries(r)
            r.entries = {}
            self.actions.free(r.acts)
            r.acts = []
        self._plan_key = None  # re-plan without them

    def _free_entries(self, r: RequestState) -> None:
        """Give the request's steering entries back to the graph-safe table; its actions then gate none (each
        step copies an action's gate into the entries it names: given back, they may be another request's)."""
        if r.entry_ids and self.graph is not None:
            self.graph.free_entries(r.entry_ids)
        r.entry_ids = []
        for u in r.acts:
            u.entries = None

    def _prune(self) -> None:
        """Release the requests that left. Checked by id, not by count: the new requests of this batch are
        not tracked yet, so as many may have joined as left (their steering entries and action slots would
        stay held until a batch with fewer requests)."""
        live = compat.live_request_ids(self.runner)
        left = []
        for rid in [r for r in self._reqs if r not in live]:
            st = self._reqs.pop(rid)
            if self.tp_wide is not None:
                self.tp_wide.forget(rid)
            if st is not None:
                self._free_entries(st)
                left.append(st)
        self._release_actions(left)

    def _release_actions(self, left: list[RequestState]) -> None:
        """The requests left: their actions' outcome stays in their results (read together: one wait for
        the device a step, not three a request), their slots go back."""
        acting = [r for r in left if r.acts]
        kept = [r for r in acting if r.store is not None and self.capturing_rank]
        try:
            for r, out in zip(kept, self.actions.outcomes([r.acts for r in kept])):
                assert r.store is not None
                r.store.actions = out
        except Exception as e:  # noqa: BLE001 - ours: each of them is told (never an outcome silently missing)
            for r in kept:
                r.store.fail(errors.internal("reading probe action outcomes", e))  # type: ignore[union-attr]
        finally:  # (their slots go back whatever happened)
            for r in acting:
                self.actions.free(r.acts)
                r.acts = []

    def _observe(self, plan: StepPlan, stage: tuple[torch.Tensor, int] | None, dev_pos: Any, pos: np.ndarray) -> None:
        """After a step: the probe actions' scores folded in on the device, gates and stops updated (`stage`:
        the graph path's ring and the step's base; None: the Python path's rows)."""
        try:
            faults.check("actions")
            step = action_step.current(self.actions, plan)
            if action_step.settled(step, self.actions):  # every action fired for good: nothing to fold (`action_step`)
                return
            xs = action_step.python_rows(plan) if stage is None else action_step.graph_rows(step, *stage)
            positions = action_step.device_positions(dev_pos, pos, self.device)
            action_step.observe(
                self.actions, step, xs, positions, None if self.graph is None else self.graph.entries.gate
            )
        except Exception as e:  # noqa: BLE001 - these requests fail; everyone else goes on
            self._fail([r for r in plan.requests if r.acts], "probe actions", e)

    def _active(self, req_ids: list, qsl) -> Rows:
        """(request, start row, end row) of this batch's requests that use a feature."""
        active = []
        for j, rid in enumerate(req_ids):
            if rid is None:
                continue
            r = self._request(rid)
            if r is not None and not r.failed:
                s, e = int(qsl[j]), int(qsl[j + 1])
                if e > s:
                    active.append((r, s, e))
        return active

    def _gather_taps(self, req_ids: list) -> frozenset:
        """mlp_post taps this step gathers across TP ranks (`tp_wide`); none without TP."""
        if self.tp_wide is None:
            return frozenset()
        return self.tp_wide.step_taps(req_ids, [self._reqs.get(r) for r in req_ids if r is not None])

    def _current_plan(self) -> StepPlan | None:
        """The plan of the step vLLM is preparing: made once per batch composition (decode steps with
        the same requests and row offsets reuse it)."""
        req_ids, qsl = compat.batch_layout(self.runner)
        key = (tuple(req_ids), qsl.tobytes())
        if key != self._plan_key:  # batch composition changed: plan again
            # in one torch thread (`host_threads`; docs/decisions.md, "seventeenth session")
            with one_thread(envs.get("VLLM_LENS_WORKER_ONE_THREAD")):
                self._replan(req_ids, qsl, key)
        self._layout = (req_ids, qsl)
        return self._cached_plan

    def _replan(self, req_ids: list, qsl: np.ndarray, key: tuple) -> None:
        """The plan of a new batch composition (admission, the flush, the plan), kept for its steps."""
        t0 = time.monotonic()
        self._prune()
        t = time.perf_counter()
        active = self._active(req_ids, qsl)
        try:
            self.admission.flush()  # the new requests' steering to the device, in one copy
        except Exception as e:  # noqa: BLE001 - the requests it was moving fail; the step goes on
            self._fail(self.admission.abandon(), "moving steering to the device", e)
            active = [a for a in active if not a[0].failed]
        counters.STEP_TIMINGS["admit_s"] += time.perf_counter() - t
        try:
            plan = None
            gather = self._gather_taps(req_ids)
            if active:
                faults.check("plan")
                plan = make_plan(
                    active,
                    self.device,
                    self.capturing_rank,
                    self._local,
                    None if gather else self.graph,  # (a collective: Python path, every rank alike)
                    int(qsl[-1]),
                    seams.enabled(),
                )
            if gather:  # every rank gathers at these taps, even one whose requests all failed here
                plan = plan or StepPlan(None, {}, {}, {}, {})
                plan.gather = gather
            if plan is not None and plan.capture:
                self.store.open_plan(plan)
            self._cached_plan, self._plan_key = plan, key
        except Exception as e:  # noqa: BLE001 - fail these requests; the step runs plain
            self._fail([r for r, _, _ in active], "planning", e)
            self._cached_plan = None
        counters.replanned(t0, len(req_ids))

    def prepare_step(self) -> int:
        """Asked before vLLM picks the step's CUDA-graph mode (`compat.patch_cudagraph_dispatch`): 0 when
        any graph may replay (no feature, or all on the graph-safe kernel); 1 when the step needs Python at
        the taps between layers (hooks, or more than the graph buffers hold): no full graph; 2 when it needs
        Python at a tap inside a layer (not a splitting op): no CUDA graph at all."""
        plan = self._current_plan()
        if plan is None:
            return 0
        if plan.graph is not None:  # Python only at the hooks' sites, if any (`seams`)
            python_at = plan.seam_sites
            if not python_at:
                return 0
        else:
            python_at = plan.sites
        if any(taps.is_inner(s) for s in python_at):
            counters.STEP_TIMINGS["graphless_steps"] += 1
            return 2
        # full graphs cut at the taps replay the hooks (a batch without one runs eagerly)
        return 0 if plan.graph is not None and seams.ready() else 1

    def _invalidate(self) -> None:
        """Request states changed outside a step (hooks registered / cleared): re-plan next step."""
        self._plan_key = None

    # ---------------------------------------------------------------- forward pass

    def around_forward(self, orig: Any, *args: Any, **kwargs: Any) -> Any:
        # several engines may share a process (tests, notebooks): the taps act for the one running now;
        # outside forwards (vLLM capturing graphs right after load) they act for the latest loaded
        prev_graph = taps.set_graph(self.graph)
        t, cpu = time.monotonic(), time.thread_time()
        ev = gpu_clock.mark() if self._gpu_clock else None
        try:
            return self._forward(orig, args, kwargs)
        finally:
            taps.set_graph(prev_graph)
            end = time.monotonic()
            counters.FORWARD_CLOCK.append((t, end, cpu) if ev is None else (t, end, cpu, ev, gpu_clock.mark()))

    def _forward(self, orig: Any, args: tuple, kwargs: dict) -> Any:
        plan = self._current_plan()
        g = self.graph
        if plan is not None and plan.graph is not None:
            return self._graph_step(plan, orig, args, kwargs)
        if g is not None:
            g.clear()
        if plan is None:
            return orig(self.runner, *args, **kwargs)
        with self.python.at(plan, kwargs):
            out = orig(self.runner, *args, **kwargs)
        if plan.fired == 0:
            # The forward ran without reaching our taps (e.g. a CUDA graph replayed): the requests in the
            # plan would silently get nothing. Never let that pass.
            raise compat.LensIncompatibleVLLM(
                "inspect-lens taps did not run during a forward pass that needed them (was a CUDA graph "
                "replayed for a step with Python hooks?)"
            )
        self.python.fail_missed(plan, plan.sites, "the taps at {} did not run (a CUDA graph replayed?)")
        if plan.act_got and self._layout is not None:
            pos = compat.host_positions(self.runner, self._layout[1])
            self._observe(plan, None, kwargs.get("positions"), pos)
        self.steps_with_features += 1
        counters.STEP_TIMINGS["python_steps"] += 1
        if plan.captured and not plan.broken:
            t = time.perf_counter()
            try:
                faults.check("file")
                self.store.finish_step(plan)
            except Exception as e:  # noqa: BLE001
                self._fail([r for r in plan.requests if r.capture], "filing captures", e)
            counters.STEP_TIMINGS["python_file_s"] += time.perf_counter() - t
        return out

    def _graph_step(self, plan: StepPlan, orig: Any, args: tuple, kwargs: dict) -> Any:
        g, gp, layout = self.graph, plan.graph, self._layout
        assert g is not None and gp is not None and layout is not None  # a graph plan is made only with graph taps
        _, qsl = layout
        pos = compat.host_positions(self.runner, qsl)
        if self.device.type == "cpu":  # cheap here: check the host positions against vLLM's own
            dev = kwargs.get("positions")
            if dev is not None and not np.array_equal(dev[: len(pos)].numpy(), pos):
                raise compat.LensIncompatibleVLLM("host positions differ from the forward pass's positions")
        t0 = time.perf_counter()
        try:
            faults.check("fill")
            # a decode step of an unchanged batch finds its table on the device: only the ring's base moves
            if g.reuse(gp):
                counters.STEP_TIMINGS["reused_tables"] += 1
            else:
                ctl = g.host_ctl(gp.n, gp.live_cols)
                gp.fill(ctl, pos)
                g.upload(gp.n, gp.live_cols, gp if gp.steady else None)
            base = g.ring_alloc(gp.total, gp.n_capture > 0) if gp.total else 0
            assert base is not None  # plans fit the ring (make_plan checks stage_rows)
            g.set_base(base)
        except Exception as e:  # noqa: BLE001 - fail these requests; the step runs plain
            g.clear()
            self._fail(plan.requests, "preparing the step", e)
            return orig(self.runner, *args, **kwargs)
        hooked = plan.seam_sites
        # Python hooks at these sites, after the kernel (`_tap`); cut full graphs replay them
        python = self.python.at(plan, kwargs, hooked) if hooked else contextlib.nullcontext()
        t1 = time.perf_counter()
        with python:
            try:
                out = orig(self.runner, *args, **kwargs)
            finally:
                g.active = False
        t2 = time.perf_counter()
        if hooked:
            counters.STEP_TIMINGS["seam_steps"] += 1
            self.python.fail_missed(plan, hooked, "the hooks at {} did not run")
        if g.error is not None:  # the kernel raised inside the forward: these requests fail, nobody else
            self._fail(plan.requests, "running the graph-safe taps", RuntimeError(g.error))
            return out
        if g.fired == 0 and not (compat.forward_replays_full_graph() and g.launches_in_capture > 0):
            raise compat.LensIncompatibleVLLM(
                "inspect-lens taps did not run during a forward pass that needed them (no tap kernel was "
                "called, nor recorded into the CUDA graph that was replayed)"
            )
        self.steps_with_features += 1
        if gp.sae:  # SAE features of staged rows, on the device, before they are copied or reused
            try:
                saes.features_from_stage(gp, g.stage, base, pos)
            except Exception as e:  # noqa: BLE001
                self._fail([r for r in plan.requests if r.sae], "encoding SAE features", e)
        if gp.act:  # probe actions' rows, scored on the device before the ring is reused
            self._observe(plan, (g.stage, base), kwargs.get("positions"), pos)
        if gp.probes:  # probe scores of staged rows, likewise
            try:
                faults.check("probes")
                probes.scores_from_stage(gp, g.stage, base, pos)
            except Exception as e:  # noqa: BLE001
                self._fail([r for r in plan.requests if r.probes], "scoring probes", e)
        n_cap = gp.n_capture
        if n_cap:
            try:
                faults.check("file")
                self.store.file_graph_step(plan, g, base, n_cap, pos[gp.cap_rows[:n_cap]])
            except Exception as e:  # noqa: BLE001
                self._fail([r for r in plan.requests if r.capture], "filing captures", e)
        counters.STEP_TIMINGS["graph_steps"] += 1
        counters.STEP_TIMINGS["plan_s"] += t1 - t0
        counters.STEP_TIMINGS["forward_s"] += t2 - t1
        counters.STEP_TIMINGS["after_s"] += time.perf_counter() - t2
        return out

    # ---------------------------------------------------------------- fetch (RPC)

    def fetch(
        self, wanted: list[tuple[str, dict[int, int]]], shm_host: str | None = None, released: list | None = None
    ) -> dict[str, Any]:
        """`shm_host`: the frontend's machine id; on the same machine, captures travel through the shared
        memory result pool. `released`: pool regions the frontend no longer uses."""
        use_shm = shm_host is not None and shm_host == shm.host_id()
        return self.store.fetch(wanted, self.capturing_rank, self.sites, pickle_saved, use_shm, released)

    def note_finished(self, req_ids: Any) -> None:
        """vLLM names these requests finished (before the step that drops them: `ready_probes`)."""
        if self.capturing_rank:
            ready_probes.note_finished(self._reqs, req_ids)

    def idle(self) -> None:
        """A step ran no tokens: the engine has nothing new to run (`ready_probes`)."""
        if self.capturing_rank:
            self.store.prepare_ready()

    def probe_progress(self, wanted: list[tuple[str, int, int]]) -> list:
        """Running requests' probe scores from a position on (`lens_probe_progress`): [key, child, payload]
        for each request this rank scores; nothing from the other ranks."""
        out: list = []
        if not self.capturing_rank:
            return out
        cache: dict = {}  # shared: each record copied to the host once for all (`Span.host_values`)
        asks = []
        for key, child, start in wanted:
            st = self.store.peek(key, child)
            if st is not None and st.has_probes and st.error is None:
                asks.append((key, child, start, st))
        together = probe_payloads.together([a[3] for a in asks], cache, [a[2] for a in asks])
        for (key, child, start, st), got in zip(asks, together):
            if got is None:
                got = probes.payload(st.probes, start, running=True, cache=cache)
            if got:
                out.append([key, child, got])
        return out

    # ---------------------------------------------------------------- persistent hooks (RPC)

    def register_hooks(self, hooks: list[tuple[bytes, list[int], str, bool, bool]]) -> int:
        n = self.persistent.register(hooks, self._local_layers)
        # plain requests cached as "nothing to do" must be re-planned
        self._reqs = {k: v for k, v in self._reqs.items() if v is not None}
        self._invalidate()
        return n

    def collect_hook_results(self) -> bytes | None:
        return pickle_saved(self.persistent.results) if self.capturing_rank else None

    def pop_persistent_errors(self, request_ids: list[str]) -> dict[str, errors.Failure]:
        return self.persistent.pop_errors(request_ids) if self.capturing_rank else {}

    def clear_hooks(self) -> None:
        self.persistent.clear()
        kept: dict[str, RequestState | None] = {}
        for k, v in self._reqs.items():
            if v is None:
                continue
            v.hooks = [h for h in v.hooks if not h.persistent]
            if v.capture or v.steers or v.simple_add or v.hooks or v.sae or v.probes or v.acts:
                kept[k] = v
        self._reqs = kept
        self._invalidate()

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        pool = self.store.pool_status()
        return {
            "layers": self.layer_ids,
            "points": [p for p in points.POINTS if p not in self.missing],
            "model_class": self.model_class,
            "tp_rank": self.tp_rank,
            "stored_requests": len(self.store),
            "stored_bytes": self.store.stored_bytes,
            "steps_with_features": self.steps_with_features,
            **self.persistent.status(),
            "prefetched": sorted(self.params.prefetched),
            "fetch_timings": dict(counters.FETCH_TIMINGS),
            "step_timings": dict(counters.STEP_TIMINGS),
            "hook_timings": dict(counters.HOOK_TIMINGS),
            "seams": dict(seams.SEAM_STATS),
            # shared-memory result regions handed to the frontend and not yet given back
            "result_regions": (pool or {}).get("regions_in_use", 0),
            "result_pool": pool,
            # per-request state the worker keeps while requests run (0 once they leave; a request's leaving
            # is seen at the next step)
            "request_states": sum(v is not None for v in self._reqs.values()),
            "steering_entries": 0 if self.graph is None else self.graph.entries.in_use(),
            # chains stored once for the requests sharing them, and requests refused by a full table
            "steering_shared_chains": 0 if self.graph is None else self.graph.entries.shared_chains(),
            "steer_table_full": 0 if self.graph is None else self.graph.entries.full,
            "probe_score_chunks": self.store.probe_records(),
            # named vectors held for requests naming them by reference, and steers resolved from one
            "held_vectors": vector_refs.HELD.count(),
            "vector_refs_resolved": vector_refs.HELD.resolved,
            **self.actions.status(),
        }
