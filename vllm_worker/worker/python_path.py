"""Steps that run Python at the taps: steering, SAE clamps, hooks (inline, or deferred after the forward
when they only read), and the capture rows kept for the step — between piecewise CUDA graphs, or at the
seams of graph-path steps (`seams`). A failure here fails the step's requests (`fail`), never the engine.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from vllm_worker import compat
from vllm_worker.protocol import points
from vllm_worker.worker import actions, edits, faults, probes, saes, seams, taps
from vllm_worker.worker.persistent_hooks import PersistentHooks
from vllm_worker.worker.plan import HookRun, RequestState, StepPlan
from vllm_worker.worker.stream_rows import stream_rows
from vllm_worker.worker.tp_wide import WideGather

# Device memory the stream snapshots of deferred read-only hooks may hold within one step; past it the
# hooks queued so far run at once (prefill steps with hooks at many layers).
DEFER_MAX_BYTES = 256 << 20


class PythonPath:
    """The taps' handler while a step runs from Python (`at`): acts for the step's plan at each site."""

    def __init__(
        self,
        d_model: int,
        local: frozenset,
        fail: Callable[[list[RequestState], str, Exception], None],
        persistent: PersistentHooks,
        timings: dict,
    ) -> None:
        self.d_model, self.local, self.fail, self.persistent = d_model, local, fail, persistent
        self.timings = timings  # the runtime's step diagnostics
        self.plan: StepPlan | None = None  # the plan of the forward pass running now
        self.wide: dict[int, list[tuple[int, int, int]]] = {}  # mlp_post: tap site -> its pieces' columns
        self.tp: WideGather | None = None  # under TP: mlp_post rows gathered across the ranks

    @contextlib.contextmanager
    def at(self, plan: StepPlan, kwargs: dict, wanted: frozenset = frozenset()) -> Iterator[None]:
        """During the forward the taps call `on_tap` with `plan` (and cut full graphs replay the hooks at
        `wanted`, `seams`)."""
        positions = kwargs.get("positions")
        if positions is None:
            raise compat.LensIncompatibleVLLM("forward pass without `positions`")
        plan.begin_step(positions)
        self.plan = plan
        prev_handler, prev_wanted = taps.set_handler(self.on_tap), seams.set_wanted(wanted)
        try:
            yield
            self.run_deferred(plan)
        finally:
            taps.set_handler(prev_handler)
            seams.set_wanted(prev_wanted)
            self.plan = None

    def fail_missed(self, plan: StepPlan, sites: frozenset, message: str) -> None:
        """Never a silent no-op: the requests acting at those of `sites` (on this stage) whose tap never
        called `on_tap` this step fail, loudly (`message` names the sites at `{}`)."""
        missed = (sites & self.local) - plan.fired_sites
        if missed and not plan.broken:
            names = ", ".join(points.describe(s) for s in sorted(missed))
            hit = [r for r in plan.requests if _touches(r, missed)]
            self.fail(hit, "running the step", RuntimeError(message.format(names)))

    def on_tap(self, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        plan = self.plan
        if plan is None:
            return
        plan.fired += 1
        plan.fired_sites.add(site)
        pieces = self.wide.get(site)
        if pieces is not None:
            plan.fired_sites.update(s for s, _, _ in pieces)
            if self.tp is not None:
                self._tp_tap(plan, hidden, site, pieces)
                return
        if plan.broken:
            return
        try:
            faults.check("tap")
            if pieces is not None:
                self._wide_tap(plan, hidden, site, pieces)
            else:
                self._tap(plan, hidden, residual, site)
        except Exception as e:  # noqa: BLE001 - the plan's requests fail; their batch-mates go on
            plan.broken = True
            self.fail(plan.requests, f"tap {points.describe(site)}", e)

    def _tap(self, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        """At one site: steering, hooks at the point, capture, then the next layer's pre-hooks (the stream
        leaving layer i is the one entering layer i + 1). With a graph plan the kernel already steered and
        captured here (`plan.RequestState.seam_ok`): only the hooks run. Read-only hooks (`defer_hooks`)
        get a snapshot of the stream here and run after the forward."""
        defer = plan.defer_hooks and site in plan.seam_sites
        if plan.graph is not None:
            if defer:
                self._defer(plan, hidden, residual, site)
                return
            edits.run_hooks((site, False), plan, hidden, residual, self._hook_failed)
            edits.run_hooks((site, True), plan, hidden, residual, self._hook_failed)
            return
        edits.steer(site, plan, hidden, residual)
        if plan.sae_clamp:
            saes.clamp_at(site, plan, hidden, residual)
        if defer:  # nothing below writes to the stream: one snapshot serves both hook positions
            self._defer(plan, hidden, residual, site)
        else:
            edits.run_hooks((site, False), plan, hidden, residual, self._hook_failed)
        cap = plan.capture.get(site)
        if cap is not None:
            idx = cap[0]
            rows = stream_rows(hidden, residual, idx)
            if rows.shape[1] < self.d_model:  # a narrower site (router logits) travels in d-wide rows
                rows = torch.nn.functional.pad(rows, (0, self.d_model - rows.shape[1]))
            plan.captured.append((site, rows))
        if plan.sae_feat:
            saes.features_at(site, plan, hidden, residual)
        if plan.act_rows:
            actions.rows_at(site, plan, hidden, residual)
        if plan.probe_rows:
            probes.scores_at(site, plan, hidden, residual)
        if not defer:
            edits.run_hooks((site, True), plan, hidden, residual, self._hook_failed)

    def _wide_tap(self, plan: StepPlan, hidden: torch.Tensor, site: int, pieces: list) -> None:
        """mlp_post (`_tap`'s order): each d_model-wide piece is steered and captured as a site of its own
        (a narrower last piece through a padded copy: vectors and rows are d_model wide); hooks see the whole
        d_mlp-wide row at the tap's site."""
        defer = plan.defer_hooks and site in plan.seam_sites
        python = plan.graph is None  # else the kernel steered and captured the pieces already
        if python:
            edits.steer(site, plan, hidden, None)  # whole-row edits (ablate, cap, norm_match), in their order
            for s, lo, hi in pieces:
                self._piece(plan, hidden, s, lo, hi, steer=True)
        if defer:
            self._defer(plan, hidden, None, site)
        else:
            edits.run_hooks((site, False), plan, hidden, None, self._hook_failed)
        if python:
            for s, lo, hi in pieces:
                self._piece(plan, hidden, s, lo, hi, steer=False)
        if not defer:
            edits.run_hooks((site, True), plan, hidden, None, self._hook_failed)

    def _tp_tap(self, plan: StepPlan, hidden: torch.Tensor, site: int, pieces: list) -> None:
        """mlp_post under TP (`tp_wide`): the whole row gathered (by every rank, even one whose plan broke:
        the others wait for it), acted on as with TP=1, this rank's slice written back."""
        if site not in plan.gather:
            return
        assert self.tp is not None
        try:
            full = self.tp.gather(hidden)
            if plan.broken:
                return
            faults.check("tap")
            self._wide_tap(plan, full, site, pieces)
            self.tp.write_back(full, hidden)
        except Exception as e:  # noqa: BLE001 - the plan's requests fail; their batch-mates go on
            plan.broken = True
            self.fail(plan.requests, f"tap {points.describe(site)}", e)

    def _piece(self, plan: StepPlan, hidden: torch.Tensor, s: int, lo: int, hi: int, steer: bool) -> None:
        if steer and (s in plan.steer or s in plan.steer_batched):
            if hi - lo == self.d_model:
                edits.steer(s, plan, hidden[:, lo:hi], None)
            else:
                tmp = torch.nn.functional.pad(hidden[:, lo:hi], (0, self.d_model - (hi - lo)))
                edits.steer(s, plan, tmp, None)
                hidden[:, lo:hi] = tmp[:, : hi - lo]
        cap = None if steer else plan.capture.get(s)
        if cap is not None:
            rows = hidden[:, lo:hi].index_select(0, cap[0])
            if rows.shape[1] < self.d_model:
                rows = torch.nn.functional.pad(rows, (0, self.d_model - rows.shape[1]))
            plan.captured.append((s, rows))

    def _defer(self, plan: StepPlan, hidden: torch.Tensor, residual: torch.Tensor | None, site: int) -> None:
        """The stream at `site` as it is now (a copy: later layers reuse these buffers), for the read-only
        hooks there to run after the forward."""
        snap = hidden + residual if residual is not None else hidden.clone()
        held = sum(s.numel() * s.element_size() for _, s in plan.deferred)
        if plan.deferred and held + snap.numel() * snap.element_size() > DEFER_MAX_BYTES:
            self.run_deferred(plan)
        plan.deferred.append((site, snap))

    def run_deferred(self, plan: StepPlan) -> None:
        """The read-only hooks queued by `_defer`, in tap order, on their snapshots."""
        queued, plan.deferred = plan.deferred, []
        if plan.broken:
            return
        try:
            for site, snap in queued:
                edits.run_hooks((site, False), plan, snap, None, self._hook_failed)
                edits.run_hooks((site, True), plan, snap, None, self._hook_failed)
                self.timings["deferred_sites"] += 1
        except Exception as e:  # noqa: BLE001 - as at a tap: the plan's requests fail, batch-mates go on
            plan.broken = True
            self.fail(plan.requests, "running deferred read-only hooks", e)

    def _hook_failed(self, h: HookRun, msg: str) -> None:
        if h.persistent:
            self.persistent.failed(h.ctx.request_id, msg)


def _touches(r: RequestState, sites: frozenset) -> bool:
    own = set(r.capture) | set(r.simple_add) | {s for st in r.steers for s in st.layers} | {u.site for u in r.sae}
    own |= {s for u in r.acts for s in u.sites}
    own |= {s for u in r.probes for s in u.weights}
    own |= {u.out_site for u in r.sae if u.out_site is not None}
    return bool(own & sites) or any(s in sites for h in r.hooks for s, _ in h.at)


def wide_needs_python(r: RequestState, wide: dict[int, list[tuple[int, int, int]]]) -> bool:
    """mlp_post work the graph-safe kernel cannot do for request `r`: whole-row edits (at the tap's own site)
    that got no entries at its pieces (`graph.GraphTaps.whole`: not served under TP, for a probe action's
    gated steering, or beyond `interventions.MAX_WHOLE_STEPS` steps), or a hook at the tap that must run
    before the request's capture of the pieces (the kernel captures before a seam's hooks run:
    `plan.RequestState.seam_ok` sees only the tap's site, not its pieces'). A gated steer at a tap is never
    served here, even where the request's plain steering (cut into pieces) holds entries at its pieces."""
    own = r.entries or {}
    whole = {s for st in r.steers for s in st.layers if s in wide} | {s for s in r.simple_add if s in wide}
    if any(wide[s][0][0] not in own for s in whole):
        return True
    if any(st.gate is not None and any(s in wide for s in st.layers) for st in r.steers):
        return True
    early = {s for h in r.hooks for s, late in h.at if not late and s in wide}
    caps = set(r.capture)
    return any(p in caps for tap in early for p, _, _ in wide[tap])
